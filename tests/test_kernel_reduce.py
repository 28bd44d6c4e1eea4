"""Reduction kernels (sum, prod, max, min, mean, variance, std) against TVM's default
build and float64 numpy, over every axis subset, keepdims, negative axes, symbolic dims.

Tolerance (see jitbyoc/kernels/reduce.py): a float32 sum of n terms, in any association
order, is within ``n * eps * sum(|x|)`` of the exact sum; mean divides that bound by n;
variance/std use it for the squared deviations; prod is within ``2 n eps`` relative.
max/min and every integer reduction are exact.
"""

import itertools
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.reduce import Reduce
from tests.diff_util import both, build, check_c_matches_llvm, inputs, model, one_region, run

R = relax.op
KINDS = ["sum", "mean", "max", "min", "prod", "variance", "std"]
SHAPE = (3, 1, 17, 5)


def all_axes(nd):
    """Every non-empty axis subset (some spelled with negative axes), plus None."""
    subsets = [list(c) for k in range(1, nd + 1) for c in itertools.combinations(range(nd), k)]
    return [None] + [[a - nd if (i + a) % 2 else a for i, a in enumerate(s)] for s in subsets]


def reduce_op(kind, x, axes, keep):
    return getattr(R, kind)(x, axes, keep)


def bound(kind, x, axes, keep, ref):
    """The documented error bound for each output element."""
    axes = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)
    n = int(np.prod([x.shape[a] for a in axes]))
    eps = np.finfo(x.dtype).eps
    wide = x.astype(np.float64)
    if kind in ("max", "min"):
        return np.zeros_like(ref, dtype=np.float64)
    if kind == "prod":
        return 2 * n * eps * np.abs(ref.astype(np.float64)) + 1e-30
    if kind in ("variance", "std"):
        dev = (wide - wide.mean(axis=axes, keepdims=True)) ** 2
        b = 4 * n * eps * dev.mean(axis=axes, keepdims=keep) + eps * np.abs(ref)
        if kind == "std":  # d sqrt(v) = dv / (2 sqrt(v))
            b = b / (2 * np.maximum(np.abs(ref.astype(np.float64)), 1e-3)) + eps * np.abs(ref)
        return b
    total = 2 * n * eps * np.abs(wide).sum(axis=axes, keepdims=keep)
    return total / n if kind == "mean" else total


def assert_within(kind, x, axes, keep, got, exact=None):
    ref = Reduce.reference(x, () if axes == [] else
                           tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes),
                           kind, keep)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if exact is not None or x.dtype.kind == "i" or kind in ("max", "min"):
        np.testing.assert_array_equal(got, ref)
        return
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    b = bound(kind, x, axes, keep, ref)
    assert (err <= b + 1e-37).all(), f"{kind} {axes} keepdims={keep}: max err {err.max()} > bound"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "std"])  # std = sqrt(variance)
def test_every_axis_subset_and_keepdims(kind):
    cases = [([(SHAPE, "float32")], (axes, keep)) for axes in all_axes(len(SHAPE))
             for keep in (False, True)]
    mod = model(cases, lambda bb, vs, a: bb.emit(reduce_op(kind, vs[0], *a)))
    one_region(mod)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for x, g, r, (_, (axes, keep)) in zip(arrays, got, ref, cases):
        assert_within(kind, x, axes, keep, g)
        assert_within(kind, x, axes, keep, r)  # TVM's own result meets the same bound


@pytest.mark.parametrize("dtype", ["int32", "int64", "float64"])
def test_other_dtypes(dtype):
    kinds = ["sum", "max", "min", "prod"] + (["mean", "variance"] if dtype == "float64" else [])
    cases = [([((4, 7, 9), dtype)], (kind, axes)) for kind in kinds
             for axes in ([2], [0], [0, 2], None)]
    mod = model(cases, lambda bb, vs, a: bb.emit(reduce_op(a[0], vs[0], a[1], False)))
    one_region(mod)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for x, g, r, (_, (kind, axes)) in zip(arrays, got, ref, cases):
        assert_within(kind, x, axes, False, g)
        if dtype != "float64":
            np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("src, dst", [("int8", "int32"), ("uint8", "int32"), ("int16", "int64"),
                                      ("int32", "int64"), ("uint8", "int16")])
@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_a_widened_integer_is_reduced_as_it_is_read(src, dst, kind):
    """``sum(astype(q, wider))`` (an int8 product's zero-point sums) reads ``q`` and widens
    each element as it folds it: no copy of ``q`` in the wider type is written. Both loop
    orders; exact against TVM and numpy (an int16 sum wraps around in all three alike)."""
    cases = [([((5, 70, 300), src)], axes) for axes in ([2], [1], [0, 2])]
    mod = model(cases, lambda bb, vs, axes: bb.emit(reduce_op(kind, bb.emit(R.astype(vs[0], dst)), axes, True)))
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    reduces = [st for st in region.kernel.stages if isinstance(st, Reduce)]
    assert len(reduces) == len(region.kernel.stages) == 3 and {st.inputs[0].dtype for st in reduces} == {src}
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for x, g, r, (_, axes) in zip(arrays, got, ref, cases):
        want = getattr(np, kind)(x.astype(dst), axis=tuple(axes), keepdims=True).astype(dst)  # sums wrap
        np.testing.assert_array_equal(g, want)
        np.testing.assert_array_equal(g, r)


def test_large_rows_and_columns_run_threaded():
    """Both loop orders, blocks that straddle BLOCK, and thread splits."""
    cases = [([((257, 1031), "float32")], ("sum", [1])), ([((1031, 257), "float32")], ("sum", [0])),
             ([((64, 33, 70), "float32")], ("mean", [0, 2])),
             ([((300, 3, 530), "float32")], ("variance", [0])),
             ([((300, 530), "float32")], ("max", [0])), ([((530, 300), "float32")], ("std", [-1]))]
    mod = model(cases, lambda bb, vs, a: bb.emit(reduce_op(a[0], vs[0], a[1], False)))
    one_region(mod)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for x, g, r, (_, (kind, axes)) in zip(arrays, got, ref, cases):
        assert_within(kind, x, axes, False, g)
        assert_within(kind, x, axes, False, r)
    (region,) = jitbyoc.inspect(mod)
    assert "TVMBackendParallelLaunch" in region.llvm_ir


def test_row_reduction_is_vectorized():
    cases = [([((64, 1024), "float32")], kind) for kind in ("sum", "max")]
    mod = model(cases, lambda bb, vs, k: bb.emit(reduce_op(k, vs[0], [-1], False)))
    (region,) = jitbyoc.inspect(mod)
    assert "<16 x float>" in region.llvm_ir_optimized or "<8 x float>" in region.llvm_ir_optimized


@pytest.mark.parametrize("n", [1, 33])
def test_symbolic_dims(n):
    cases = [([(("n", 17), "float32")], (kind, axes, keep)) for kind in ("sum", "mean", "max")
             for axes in ([1], [0], None) for keep in (False, True)]
    mod = model(cases, lambda bb, vs, a: bb.emit(reduce_op(a[0], vs[0], a[1], a[2])), sym=["n"])
    one_region(mod)
    arrays = inputs(cases, {"n": n}, seed=n)
    got, ref = both(mod, arrays)
    for x, g, r, (_, (kind, axes, keep)) in zip(arrays, got, ref, cases):
        assert_within(kind, x, axes, keep, g)


def test_fused_epilogue_and_chain_is_one_region():
    """sum -> multiply -> add is the kernel's epilogue; a hand-written softmax (exp, sum,
    divide) followed by reshape and permute stays one region."""
    cases = [([((6, 40), "float32"), ((6,), "float32")], "epilogue"),
             ([((4, 6, 10), "float32")], "chain")]

    def make(bb, vs, kind):
        if kind == "epilogue":
            s = bb.emit(R.sum(vs[0], axis=[1]))
            return bb.emit(R.add(R.multiply(s, relax.const(0.5, "float32")), vs[1]))
        e = bb.emit(R.exp(vs[0]))
        p = bb.emit(R.divide(e, R.sum(e, axis=[-1], keepdims=True)))
        return bb.emit(R.permute_dims(R.reshape(p, (24, 10)), [1, 0]))

    mod = model(cases, make)
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    fused = [s for s in region.kernel.stages if isinstance(s, Reduce) and s.epilogue is not None]
    assert len(fused) == 1
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    x, b, y = arrays
    np.testing.assert_allclose(got[0], x.sum(axis=1) * 0.5 + b, rtol=1e-5, atol=40 * 1e-7 * 4)
    e = np.exp(y.astype(np.float64))
    want = (e / e.sum(-1, keepdims=True)).reshape(24, 10).T
    np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-7)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 13), min_size=1, max_size=4), st.data())
def test_random_shapes_and_axes(shape, data):
    nd = len(shape)
    axes = data.draw(st.lists(st.integers(-nd, nd - 1), min_size=1, max_size=nd,
                              unique_by=lambda a: a % nd))
    kind = data.draw(st.sampled_from(KINDS))
    keep = data.draw(st.booleans())
    cases = [([(tuple(shape), "float32")], None)]
    mod = model(cases, lambda bb, vs, _: bb.emit(reduce_op(kind, vs[0], axes, keep)))
    arrays = inputs(cases)
    (got,) = run(build(mod, True), arrays)
    assert_within(kind, arrays[0], axes, keep, got)


def test_unsupported_reductions_stay_with_tvm_with_reasons():
    cases = [([((4, 5), "int32")], ("mean", [1])),  # (a float16 sum runs in float32: widen)
             ([((4, 5), "float32")], ("sum", [])), ([((4, 0), "float32")], ("max", [1]))]
    mod = model(cases, lambda bb, vs, a: bb.emit(reduce_op(a[0], vs[0], a[1], False)))
    reasons = [f.reason for f in jitbyoc.report(mod).fallbacks]
    assert any("dtype int32 not supported" in r for r in reasons)
    assert any("empty axis list" in r for r in reasons)
    assert any("empty reduction" in r for r in reasons)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the C rendering")
def test_c_rendering_matches_llvm(tmp_path):
    cases = [([((33, 300), "float32")], (kind, axes)) for kind in KINDS for axes in ([1], [0])]
    cases += [([((9, 40), "int64")], ("prod", [1]))]
    cases += [([((9, 40), "int8")], ("sum", axes, "int32")) for axes in ([1], [0])]  # widened as read

    def make(bb, vs, a):
        x = vs[0] if len(a) == 2 else bb.emit(R.astype(vs[0], a[2]))
        return bb.emit(reduce_op(a[0], x, a[1], False))
    mod = model(cases, make)
    one_region(mod)
    # sums differ only by association order (LLVM vector lanes, C in order): n * eps
    check_c_matches_llvm(mod, inputs(cases), tmp_path, rtol=300 * 1.2e-7, atol=300 * 1.2e-7)


@pytest.mark.parametrize("kernel", ["conv", "none"])
def test_an_output_a_reduction_reads_is_computed_once(kernel):
    """A squeeze-and-excitation block's ``y = silu(conv(x) + b)`` is an output and what
    ``mean`` and ``max`` read: ``y`` is computed once, into its output (the conv writes
    it with the SiLU as its epilogue; the reductions read it), not once for the output
    and again into a temp for each reduction."""
    rng = np.random.default_rng(3)
    w = relax.const((rng.standard_normal((12, 1, 3, 3)) * 0.3).astype("float32"))
    b = relax.const(rng.standard_normal((1, 12, 1, 1)).astype("float32"))

    def make(bb, vs, _):
        y = vs[0] if kernel == "none" else bb.emit(R.nn.conv2d(vs[0], w, padding=1, groups=12))
        y = bb.emit(R.add(y, b))
        y = bb.emit(R.multiply(y, bb.emit(R.sigmoid(y))))
        return [y, bb.emit(R.mean(y, axis=[2, 3], keepdims=True)), bb.emit(R.max(y, axis=[1])), y]

    cases = [([((1, 12, 9, 7), "float32")], None)]
    mod = model(cases, make)
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    kinds = [type(s).__name__ for s in region.kernel.stages]
    first = "Conv2d" if kernel == "conv" else "Elementwise"
    assert kinds == [first, "Reduce", "Reduce"] and not region.kernel.temps, kinds
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[3], got[0])
