"""conv1d/2d/3d_transpose against TVM's default build and the float64 numpy reference, the
C rendering against the LLVM one."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from jitbyoc.kernels.conv_transpose import ConvTranspose
from tests.conftest import build_both, build_model
from tests.diff_util import CC, check_c_matches_llvm

CASES = [  # (x shape, out channels per group, kernel, strides, padding, output_padding, dilation, groups)
    ((1, 1, 3, 3), 2, (3, 3), (1, 1), (0, 0, 0, 0), (0, 0), (1, 1), 1),
    ((2, 4, 5, 5), 3, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), (1, 1), 1),
    ((1, 6, 4, 7), 2, (4, 2), (3, 2), (1, 0, 2, 1), (2, 1), (1, 2), 3),
    ((1, 3, 7, 1), 5, (2, 1), (2, 1), (0, 0, 0, 0), (0, 0), (2, 1), 1),
    # 1-D (padding: left, right)
    ((1, 1, 3), 2, (3,), (1,), (0, 0), (0,), (1,), 1),
    ((2, 4, 17), 3, (4,), (3,), (1, 2), (2,), (2,), 2),
    ((1, 3, 1), 7, (1,), (2,), (0, 0), (1,), (1,), 1),
    # 3-D (padding: front, top, left, back, bottom, right)
    ((1, 1, 3, 3, 3), 2, (3, 3, 3), (1, 1, 1), (0, 0, 0, 0, 0, 0), (0, 0, 0), (1, 1, 1), 1),
    ((2, 4, 3, 5, 2), 3, (2, 3, 2), (2, 1, 3), (1, 0, 1, 0, 1, 1), (1, 0, 2), (1, 2, 1), 2),
    ((1, 2, 1, 7, 3), 1, (1, 2, 3), (1, 2, 2), (0, 1, 1, 0, 0, 1), (0, 1, 0), (1, 1, 2), 1),
]


@pytest.mark.parametrize("xshape,n_out,kernel,strides,padding,out_pad,dilation,groups", CASES)
def test_conv_transpose_matches_tvm(xshape, n_out, kernel, strides, padding, out_pad, dilation, groups, tmp_path):
    wshape = (xshape[1], n_out, *kernel)
    op = getattr(relax.op.nn, f"conv{len(kernel)}d_transpose")
    mod = build_model({"x": (xshape, "float32"), "w": (wshape, "float32")}, lambda bb, x, w: bb.emit(
        relax.op.nn.relu(op(x, w, strides=strides, padding=padding, output_padding=out_pad, dilation=dilation,
                            groups=groups))))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(sum(xshape))
    x, w = rng.standard_normal(xshape).astype("float32"), rng.standard_normal(wshape).astype("float32")
    want, got = builds.run(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ref = ConvTranspose.reference(x.astype(np.float64), w.astype(np.float64), strides, padding[:len(kernel)],
                                  dilation, groups, got.shape[2:])
    np.testing.assert_allclose(got, np.maximum(ref, 0), rtol=1e-5, atol=1e-5)
    if CC is not None:
        check_c_matches_llvm(mod, [x, w], tmp_path, rtol=1e-6, atol=1e-6)
