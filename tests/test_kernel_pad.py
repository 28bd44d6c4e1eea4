"""nn.pad in every mode against TVM's default build and numpy; the C rendering too."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from jitbyoc.kernels.pad import Pad
from tests.conftest import build_both, build_model
from tests.diff_util import CC, check_c_matches_llvm

WIDTHS = [((2, 3, 5), (0, 0, 1, 2, 3, 0)), ((1, 3, 4, 6), (0, 0, 0, 0, 1, 1, 2, 2)),
          ((4, 7), (1, 0, 0, 3)), ((9,), (2, 2)), ((2, 2, 3, 3), (1, 0, 0, 1, 2, 2, 0, 1))]


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bool"])
@pytest.mark.parametrize("shape,width", WIDTHS)
def test_pad_matches_tvm_and_numpy(shape, width, dtype, mode, tmp_path):
    value = {"float32": -1.5, "int32": 7, "uint8": 3, "bool": 1}[dtype]
    mod = build_model({"x": (shape, dtype)}, lambda bb, x: bb.emit(
        relax.op.nn.pad(x, width, pad_mode=mode, pad_value=value)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    x = np.random.default_rng(len(shape)).integers(0, 9, shape).astype(dtype)
    want, got = builds.run(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, Pad.reference(x, width[0::2], width[1::2], mode, value))
    if CC is not None and dtype == "float32":
        check_c_matches_llvm(mod, [x], tmp_path)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_pad_with_a_following_op_fused(mode):
    """An elementwise op after the pad runs in the pad's loop (its epilogue), once per
    element."""
    mod = build_model({"x": ((2, 3, 5, 6), "float32")}, lambda bb, x: bb.emit(relax.op.add(relax.op.multiply(
        relax.op.nn.pad(x, (0, 0, 1, 0, 2, 1, 1, 2), pad_mode=mode, pad_value=1.5), relax.const(3.0, "float32")),
        relax.const(1.0, "float32"))))
    builds = build_both(mod)
    assert builds.report.fallbacks == [] and len(builds.report.regions) == 1, str(builds.report)
    x = np.random.default_rng(5).standard_normal((2, 3, 5, 6)).astype("float32")
    want, got = builds.run(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, Pad.reference(x, (0, 1, 2, 1), (0, 0, 1, 2), mode, 1.5) * 3 + 1, rtol=1e-6)


def test_a_zero_pad_before_a_conv_folds_into_its_padding():
    """torch.export's MobileNet-style ``pad -> conv2d``: one conv with the widths added to
    its padding (no pad op left, one region), same values as TVM's build of the pad."""
    def body(bb, x, w):
        padded = bb.emit(relax.op.nn.pad(x, (0, 0, 0, 0, 1, 0, 0, 1)))
        return bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(padded, w, strides=(2, 2), padding=(1, 1, 1, 1))))

    mod = build_model({"x": ((1, 8, 9, 9), "float32"), "w": ((8, 8, 3, 3), "float32")}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == [] and len(builds.report.regions) == 1, str(builds.report)
    assert "relax.nn.pad" not in builds.report.regions[0].ops
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 8, 9, 9)).astype("float32"), rng.standard_normal((8, 8, 3, 3)).astype("float32")
    want, got = builds.run(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_nonzero_pad_before_a_conv_is_kept():
    def body(bb, x, w):
        padded = bb.emit(relax.op.nn.pad(x, (0, 0, 0, 0, 1, 1, 1, 1), pad_value=2.0))
        return bb.emit(relax.op.nn.conv2d(padded, w))

    mod = build_model({"x": ((1, 4, 6, 6), "float32"), "w": ((4, 4, 3, 3), "float32")}, body)
    builds = build_both(mod)
    assert any("relax.nn.pad" in r.ops for r in builds.report.regions), str(builds.report)
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((1, 4, 6, 6)).astype("float32"), rng.standard_normal((4, 4, 3, 3)).astype("float32")
    want, got = builds.run(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
