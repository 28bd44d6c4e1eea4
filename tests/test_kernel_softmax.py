"""softmax / log_softmax: rows along the last axis are explicit vectors (whole strips and a
masked tail), other axes scalar rows. Differential against TVM's default build and numpy,
over row lengths around the vector width, symbolic lengths, masked (-inf) scores as
attention produces them, and the C rendering."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.kernels.softmax import Softmax

from .conftest import build_both, build_model, run
from .diff_util import check_c_matches_llvm

LENGTHS = (1, 3, 7, 16, 17, 33, 128, 500)


def _model(shape, dtype, axis=-1, log=False, scale=None):
    op = relax.op.nn.log_softmax if log else relax.op.nn.softmax

    def body(bb, x):
        y = bb.emit(op(x, axis=axis))
        return bb.emit(relax.op.multiply(y, relax.const(scale, dtype))) if scale else y
    return build_model({"x": (shape, dtype)}, body)


def _check(mod, x, dtype, log=False):
    builds = build_both(mod)
    assert not builds.report.fallbacks, str(builds.report)
    got, want = run(builds.jit, x), run(builds.tvm, x)
    tol = 2e-6 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, Softmax.reference(x.astype("float64"), -1, log), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_last_axis_rows_match_tvm(n, log, dtype):
    x = (np.random.default_rng(n).standard_normal((3, 5, n)) * 4).astype(dtype)
    _check(_model((3, 5, n), dtype, log=log), x, dtype, log)


@pytest.mark.parametrize("n", [1, 17, 300])
def test_symbolic_row_length(n):
    mod = build_model({"x": ((2, "n"), "float32")}, lambda bb, x: bb.emit(relax.op.nn.softmax(x)))
    builds = build_both(mod)
    x = np.random.default_rng(n).standard_normal((2, n)).astype("float32")
    np.testing.assert_allclose(run(builds.jit, x), run(builds.tvm, x), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 17, 300])
def test_symbolic_row_length_with_a_fused_epilogue(n):
    """The epilogue of rows whose length is a symbolic size gets the size's value as its
    extent (the LLVM rendering passed the size's name, and the build failed)."""
    def body(bb, x):
        return bb.emit(relax.op.multiply(bb.emit(relax.op.nn.softmax(x)), relax.const(3.0, "float32")))

    builds = build_both(build_model({"x": ((2, "n"), "float32")}, body))
    assert not builds.report.fallbacks, str(builds.report)
    x = np.random.default_rng(n).standard_normal((2, n)).astype("float32")
    np.testing.assert_allclose(run(builds.jit, x), run(builds.tvm, x), rtol=2e-6, atol=1e-6)


def test_masked_scores_as_attention_makes_them():
    """-inf entries (a causal mask) get exactly 0; a row of -inf only is NaN, as in TVM."""
    x = np.random.default_rng(0).standard_normal((4, 37)).astype("float32")
    x[np.triu_indices(4, 1, 37)] = -np.inf
    x[3] = -np.inf
    builds = build_both(_model((4, 37), "float32"))
    got, want = run(builds.jit, x), run(builds.tvm, x)
    np.testing.assert_allclose(got[:3], want[:3], rtol=2e-6, atol=1e-7)
    assert (got[:3][np.isneginf(x[:3])] == 0).all()
    assert np.isnan(got[3]).all() and np.isnan(want[3]).all()


def test_other_axes_and_a_fused_epilogue():
    x = np.random.default_rng(1).standard_normal((6, 19, 5)).astype("float32")
    for axis in (0, 1):
        builds = build_both(_model((6, 19, 5), "float32", axis=axis, scale=3.0))
        np.testing.assert_allclose(run(builds.jit, x), run(builds.tvm, x), rtol=2e-6, atol=1e-6)
    builds = build_both(_model((6, 19, 5), "float32", scale=3.0))
    np.testing.assert_allclose(run(builds.jit, x), run(builds.tvm, x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("log", [False, True])
def test_c_rendering_matches_llvm(log, tmp_path):
    x = np.random.default_rng(2).standard_normal((5, 41)).astype("float32")
    check_c_matches_llvm(_model((5, 41), "float32", log=log), [x], tmp_path, rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("s", [1, 7, 37])
def test_attention_scores_scale_and_mask_ride_in_the_products_epilogue(s):
    """A batched product's (H, S, S) read as (1, H, S, S), scaled and masked, then softmax:
    the scale and mask are the product's epilogue (no pass of their own over the scores),
    and the result matches TVM."""
    from jitbyoc.ir import kir
    from jitbyoc.kernels.matmul import MatMul

    def body(bb, q, k, m):
        t = bb.emit(relax.op.reshape(relax.op.matmul(q, relax.op.permute_dims(k, [0, 2, 1])), (1, 4, s, s)))
        t = bb.emit(relax.op.add(relax.op.multiply(t, relax.const(0.25, "float32")), m))
        return bb.emit(relax.op.nn.softmax(t, axis=-1))
    mod = build_model({"q": ((4, s, 16), "float32"), "k": ((4, s, 16), "float32"),
                       "m": ((1, 1, s, s), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    kinds = [type(st) for st in region.kernel.stages]
    assert kinds == [MatMul, Softmax], [kir.describe(st) for st in region.kernel.stages]
    assert region.kernel.stages[0].epilogue is not None
    rng = np.random.default_rng(s)
    args = [rng.standard_normal(sh).astype("float32") for sh in ((4, s, 16), (4, s, 16), (1, 1, s, s))]
    builds = build_both(mod)
    np.testing.assert_allclose(run(builds.jit, *args), run(builds.tvm, *args), rtol=2e-5, atol=1e-6)
