"""arange, full, cumsum and index_tensor (ops decoder LLMs leave to TVM otherwise):
differential against TVM's default build and each kernel's numpy reference, the C
rendering against the LLVM one, and a symbolic size where the op allows one."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from jitbyoc.kernels.gather import IndexTensor
from jitbyoc.kernels.generate import Arange, Eye, Size, Triangle
from jitbyoc.kernels.scan import Cumsum
from tests.conftest import build_both, build_model, build_tvm
from tests.diff_util import check_c_matches_llvm

R = relax.op


def _both(params, body, inputs, ops, tmp_path, tvm_fails=None):
    """jitbyoc's and TVM's results (TVM's None where its build fails with ``tvm_fails``)."""
    mod = build_model(params, body)
    if tvm_fails:
        with pytest.raises(Exception, match=tvm_fails):
            build_tvm(mod)
    builds = build_both(mod, tvm_builds=not tvm_fails)
    assert builds.report.offloaded_ops == ops, str(builds.report)
    tvm_out, jit_out = builds.run(*inputs)
    check_c_matches_llvm(mod, inputs, tmp_path)
    return tvm_out, jit_out


@pytest.mark.parametrize("dt, start, step", [("int64", 0, 1), ("int32", 5, 2), ("int8", 3, 1),
                                             ("uint16", 7, 3)])
@pytest.mark.parametrize("n", [1, 7, 130])
def test_arange(dt, start, step, n, tmp_path):
    x = np.ones(n, dt)
    tvm_out, jit_out = _both({"x": ((n,), dt)}, lambda bb, x: bb.emit(
        R.add(R.arange(start, start + n * step, step, dt), x)), [x], 2, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_allclose(jit_out, Arange.reference(n, start, step, dt) + x, rtol=1e-6)


@pytest.mark.parametrize("dt, start, stop, step, why", [("int32", 5, -1, -2, "step <= 0"),
                                                       ("float32", 0.0, 0.7, 0.1, "dtype float32")])
def test_aranges_left_to_tvm(dt, start, stop, step, why):
    mod = build_model({"x": ((1,), dt)}, lambda bb, x: bb.emit(R.add(R.arange(start, stop, step, dt), x)))
    builds = build_both(mod)
    assert builds.report.offloaded_ops == 1 and why in builds.report.fallbacks[0].reason


def test_arange_of_a_symbolic_length(tmp_path):
    for n in (1, 7, 500):
        x = np.arange(n, dtype="int64") * 3
        tvm_out, jit_out = _both({"x": (("n",), "int64")}, lambda bb, x: bb.emit(
            R.add(R.arange(0, x.ty.shape[0], 1, "int64"), x)), [x], 2, tmp_path)
        np.testing.assert_array_equal(jit_out, tvm_out)
        np.testing.assert_array_equal(jit_out, np.arange(n) * 4)


@pytest.mark.parametrize("dt, fill", [("float32", 1.5), ("int64", -3), ("bool", True)])
def test_full(dt, fill, tmp_path):
    """The target shape is symbolic: a shape argument of the composite (see
    jitbyoc.tvm.composite_types), the fill value a rank-0 input."""
    x, v = np.zeros((3, 5), dt), np.asarray(fill, dt)
    combine = R.logical_or if dt == "bool" else R.add
    tvm_out, jit_out = _both({"x": (("n", 5), dt), "v": ((), dt)}, lambda bb, x, v: bb.emit(
        combine(R.full(x.ty.shape, v, dt), x)), [x, v], 2, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_array_equal(jit_out, np.full((3, 5), fill, dt))


@pytest.mark.parametrize("op", ["tril", "triu"])
@pytest.mark.parametrize("shape, k", [((5, 7), 0), ((5, 7), 2), ((7, 5), -3), ((2, 3, 9, 4), 1), (("n", 6, 6), -1)])
@pytest.mark.parametrize("dt", ["float32", "int64", "bool"])
def test_triangles(op, shape, k, dt, tmp_path):
    """LLMs' causal masks: tril/triu of the last two dims, offsets above and below the
    diagonal, a symbolic batch; a following op fused."""
    concrete = tuple(3 if d == "n" else d for d in shape)
    x = np.random.default_rng(k + 5).integers(-4, 5, concrete).astype(dt)
    combine = R.logical_or if dt == "bool" else R.add
    tvm_out, jit_out = _both({"x": (shape, dt)}, lambda bb, x: bb.emit(
        combine(getattr(R, op)(x, k), x)), [x], 2, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    want = Triangle.reference(x, op == "tril", k)
    np.testing.assert_array_equal(jit_out, want | x if dt == "bool" else want + x)


@pytest.mark.parametrize("shape, axis", [((7,), 0), ((3, 17), 1), ((3, 17), 0), ((2, 5, 3), 1), (("n", 9), 0)])
@pytest.mark.parametrize("dt, out_dt", [("float32", "float32"), ("int64", "int64"), ("int32", "int64"),
                                        ("bool", "int64"), ("float32", "float64"),
                                        ("bool", "bool")])
@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum(shape, axis, dt, out_dt, exclusive, tmp_path):
    rng = np.random.default_rng(len(shape) * 10 + axis)
    concrete = tuple(6 if d == "n" else d for d in shape)
    x = (rng.random(concrete) < 0.5) if dt == "bool" else (rng.standard_normal(concrete) * 10).astype(dt)
    tvm_out, jit_out = _both({"x": (shape, dt)}, lambda bb, x: bb.emit(
        R.cumsum(x, axis=axis, dtype=out_dt, exclusive=exclusive)), [x], 1, tmp_path,
        tvm_fails="kDLFloat" if out_dt == "bool" else None)  # TVM 0.27 cannot build a bool cumsum
    want = Cumsum.reference(x, axis, out_dt, exclusive)
    if tvm_out is not None:
        np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_allclose(jit_out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_shape, index_shapes", [
    ((5, 4), [(3,)]), ((5, 4, 2), [(3,), (3,)]), ((5, 4, 2), [(2, 1), (1, 3)]),
    ((6,), [(2, 3)]), ((7, 3), [("n",)]),
])
@pytest.mark.parametrize("dt, idt", [("float32", "int64"), ("int64", "int32"), ("bool", "int64")])
def test_index_tensor(x_shape, index_shapes, dt, idt, tmp_path):
    rng = np.random.default_rng(len(index_shapes))
    x = (rng.random(x_shape) < 0.5) if dt == "bool" else (rng.standard_normal(x_shape) * 10).astype(dt)
    idx = [rng.integers(0, x_shape[k], tuple(4 if d == "n" else d for d in s)).astype(idt)
           for k, s in enumerate(index_shapes)]
    params = {"x": (x_shape, dt), **{f"i{k}": (s, idt) for k, s in enumerate(index_shapes)}}
    tvm_out, jit_out = _both(params, lambda bb, x, *ind: bb.emit(R.index_tensor(x, relax.Tuple(list(ind)))),
                             [x, *idx], 1, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_array_equal(jit_out, IndexTensor.reference(x, *idx))


@pytest.mark.parametrize("shape", [(1,), (3, 7), (17, 1, 3), ("n", 7)])
def test_size(shape, tmp_path):
    concrete = tuple(3 if d == "n" else d for d in shape)
    x = np.zeros(concrete, "float32")
    tvm_out, jit_out = _both({"x": (shape, "float32")}, lambda bb, x: bb.emit(R.size(x)), [x], 1, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_array_equal(jit_out, Size.reference(x))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (7, 3), (17, 17)])
@pytest.mark.parametrize("k", [-2, 0, 1, 5])
@pytest.mark.parametrize("dt", ["float32", "int64", "bool"])
def test_eye_like(shape, k, dt, tmp_path):
    """eye_like with a following op fused (its epilogue)."""
    x = np.random.default_rng(k + 3).integers(0, 2, shape).astype(dt)
    combine = R.logical_or if dt == "bool" else R.add
    tvm_out, jit_out = _both({"x": (shape, dt)}, lambda bb, x: bb.emit(combine(R.eye_like(x, k), x)),
                             [x], 2, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    want = Eye.reference(*shape, k, dt)
    np.testing.assert_array_equal(jit_out, want | x if dt == "bool" else want + x)


def test_eye_like_of_another_dtype_is_left_to_tvm():
    mod = build_model({"x": ((3, 3), "float32")}, lambda bb, x: bb.emit(R.eye_like(x, 0, "int32")))
    (fallback,) = build_both(mod, tvm_builds=False).report.fallbacks
    assert "ignores it" in fallback.reason


@pytest.mark.parametrize("dt", ["float32", "int32", "bool"])
def test_zeros(dt, tmp_path):
    x = np.ones((3, 7), dt)
    combine = R.logical_or if dt == "bool" else R.add
    tvm_out, jit_out = _both({"x": ((3, 7), dt)}, lambda bb, x: bb.emit(combine(R.zeros((3, 7), dt), x)),
                             [x], 2, tmp_path)
    np.testing.assert_array_equal(jit_out, tvm_out)
    np.testing.assert_array_equal(jit_out, x)
