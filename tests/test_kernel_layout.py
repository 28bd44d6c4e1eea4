"""Layout kernels (reshape family as views, permute_dims, concat, split, strided_slice,
take) against TVM's default build and numpy. They only move elements, so every result
must be bit-exact, in every dtype, in both renderings."""

import itertools
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.kernels.layout import Permute
from jitbyoc.kernels.slicing import Take
from jitbyoc.render.portable import TRANSPOSE8, TRANSPOSE8_ORDER
from tests.diff_util import both, build, check_c_matches_llvm, inputs, model, one_region, run

R = relax.op
DTYPES = ["float32", "float64", "int32", "int64", "bool"]


def exact(got, ref):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_array_equal(g, r)


def one_exact_region(mod, cases):
    """Check ``mod`` (made of ``cases``) is one region, run it with jitbyoc and TVM and
    check the results are identical; returns (inputs, jitbyoc's results)."""
    one_region(mod)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    exact(got, ref)
    return arrays, got


def test_reshape_family_is_exact_in_every_dtype_and_costs_no_copy():
    cases = [([((3, 17, 4), dt)], op) for dt in DTYPES for op in range(4)]

    def make(bb, vs, op):
        x = vs[0]
        return bb.emit([R.reshape(x, (17, 12)), R.flatten(x), R.expand_dims(x, [0, -1]),
                        R.squeeze(R.reshape(x, (3, 1, 17, 4)), [1])][op])

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    exact(got, [a.reshape(g.shape) for a, g in zip(arrays, got)])
    (region,) = jitbyoc.inspect(mod)
    assert region.kernel.temps == [], "views need no temporary"


def test_reshape_of_an_elementwise_chain_stays_one_loop_nest():
    cases = [([((6, 10), "float32"), ((6, 10), "float32")], None)]

    def make(bb, vs, _):
        y = bb.emit(R.reshape(R.add(vs[0], vs[1]), (2, 3, 10)))
        return bb.emit(R.nn.relu(R.multiply(y, y)))

    mod = model(cases, make)
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    assert [type(s).__name__ for s in region.kernel.stages] == ["Elementwise"]
    assert region.kernel.temps == []
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    exact(got, ref)


def test_reshape_of_a_kernel_result_is_a_view_of_its_output():
    """The kernel writes the region's output through a view of it, the tail after the
    reshape fused as its epilogue: no temp, no pass of its own."""
    cases = [([((4, 6), "float32")], None)]
    mod = model(cases, lambda bb, vs, _: bb.emit(R.nn.relu(R.reshape(R.nn.softmax(vs[0]), (24,)))))
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert stage.out.base == region.kernel.outputs[0] and stage.out.shape == (4, 6)
    assert stage.epilogue is not None and region.kernel.temps == []
    got, ref = both(mod, inputs(cases))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-7)


def _permute_cases(shapes, dtypes=("float32",)):
    return [([(s, dt)], axes) for s in shapes for dt in dtypes
            for axes in itertools.permutations(range(len(s)))]


@pytest.mark.parametrize("epilogue", [False, True])
def test_permute_dims_all_permutations(epilogue):
    shapes = [(3, 17), (1, 33), (3, 1, 17), (5, 4, 3), (2, 3, 4, 5), (1, 17, 3, 2)]
    cases = _permute_cases(shapes)

    def make(bb, vs, axes):
        y = R.permute_dims(vs[0], list(axes))
        return bb.emit(R.add(y, relax.const(1.5, "float32")) if epilogue else y)

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    shift = np.float32(1.5) if epilogue else np.float32(0)
    exact(got, [Permute.reference(a, axes) + shift for a, (_, axes) in zip(arrays, cases)])


def test_permute_dims_large_tiles_threads_and_dtypes():
    cases = [([((127, 129), dt)], (1, 0)) for dt in DTYPES] + \
        [([((33, 65, 40), "float32")], (2, 0, 1)), ([((8, 64, 12, 65), "float32")], (0, 2, 1, 3)),
         ([((4, 12, 70, 64), "float64")], (0, 1, 3, 2)), ([((300, 300), "float32")], None)]

    def make(bb, vs, axes):
        return bb.emit(R.permute_dims(vs[0], None if axes is None else list(axes)))

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    exact(got, [np.transpose(a, axes) for a, (_, axes) in zip(arrays, cases)])
    (region,) = jitbyoc.inspect(mod)
    assert "TVMBackendParallelLaunch" in region.llvm_ir
    assert "shufflevector" in region.llvm_ir, "whole tiles go through the register transpose"


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 19), min_size=1, max_size=4), st.randoms(use_true_random=False),
       st.booleans())
def test_permute_dims_random(shape, rnd, epilogue):
    axes = list(range(len(shape)))
    rnd.shuffle(axes)
    cases = [([(tuple(shape), "float32"), (tuple(shape[a] for a in axes), "float32")], axes)]

    def make(bb, vs, axes):
        y = R.permute_dims(vs[0], axes)
        return bb.emit(R.multiply(y, vs[1]) if epilogue else y)

    mod = model(cases, make)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    exact(got, ref)
    want = np.transpose(arrays[0], axes) * (arrays[1] if epilogue else 1)
    exact(got, [want.astype("float32")])


def _concat_shapes(axis):
    """Three operands of (3, 5, 17) that differ along ``axis`` only (sizes 1, 4, 2)."""
    return [tuple(k if d == axis % 3 else n for d, n in enumerate((3, 5, 17))) for k in (1, 4, 2)]


def test_concat_split_in_every_dtype_and_axis():
    cases = [([(s, dt) for s in _concat_shapes(axis)], axis) for dt in DTYPES for axis in (0, -2, 2)]

    def make(bb, vs, axis):
        c = bb.emit(R.concat(vs, axis=axis))
        parts = bb.emit(R.split(c, [1, 3], axis=axis))
        return [c] + [bb.emit(relax.TupleGetItem(parts, k)) for k in range(3)]

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    want = []
    pos = 0
    for shapes_, axis in cases:
        c = np.concatenate(arrays[pos:pos + len(shapes_)], axis=axis)
        want += [c] + np.split(c, [1, 3], axis=axis)
        pos += len(shapes_)
    exact(got, want)


def test_stack_and_flip_in_every_dtype_and_axis():
    """stack along every axis (a concat of unit-dim views) and flip of every axis (a
    slice stepping back), with a following elementwise op fused, against TVM and numpy."""
    shape = (3, 5, 17)
    cases = [([(shape, dt)] * 3, axis) for dt in DTYPES for axis in (0, 1, -1, 3)]

    def make(bb, vs, axis):
        stacked = bb.emit(R.stack(vs, axis=axis))
        flipped = bb.emit(R.flip(vs[0], axis=axis % 3))
        combine = R.logical_or if vs[0].ty.dtype == "bool" else R.add
        return [stacked, bb.emit(combine(flipped, vs[1]))]

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    want = []
    for k, (_, axis) in enumerate(cases):
        a, b, c = arrays[3 * k:3 * k + 3]
        flipped = np.flip(a, axis=axis % 3)
        want += [np.stack([a, b, c], axis=axis), flipped | b if a.dtype == bool else flipped + b]
    exact(got, want)


def test_split_sections_uneven_and_fused_epilogue():
    cases = [([((17, 10), "float32")], (3, 0)), ([((4, 12), "float32")], (4, -1)),
             ([((5, 7, 2), "float32")], (2, 1))]

    def make(bb, vs, attrs):
        parts = bb.emit(R.split(vs[0], attrs[0], axis=attrs[1]))
        n = len(parts.ty.fields)
        return [bb.emit(R.nn.relu(relax.TupleGetItem(parts, k))) for k in range(n)]

    one_exact_region(model(cases, make), cases)


SLICES = [  # axes, begin, end, strides (None: the 4-operand form)
    ([1], [2], [9], None), ([0, 2], [-2, 0], [100, 17], [1, 3]), ([2], [-1], [-100], [-1]),
    ([1, 2], [8, 15], [0, 1], [-2, -4]), ([0], [0], [1], [1]), ([-1], [3], [4], [5]),
    ([0, 1, 2], [1, 1, 1], [-1, -1, -1], [2, 2, 2]),
]


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
def test_strided_slice_grid(dtype):
    cases = [([((3, 10, 17), dtype)], s) for s in SLICES]

    def make(bb, vs, s):
        axes, begin, end, strides = s
        return bb.emit(R.strided_slice(vs[0], axes, begin, end, strides))

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    for a, g, (_, (axes, begin, end, strides)) in zip(arrays, got, cases):
        index = [slice(None)] * 3
        for k, ax in enumerate(axes):
            index[ax] = slice(begin[k], end[k], (strides or [1] * len(axes))[k])
        exact([g], [a[tuple(index)]])


@pytest.mark.parametrize("mode", ["fast", "clip", "wrap", "nan"])
def test_take_modes_index_dtypes_and_axes(mode):
    cases = [([((11, 7), "float32"), (ishape, idt)], axis)
             for idt in ("int32", "int64") for axis, ishape in ((0, (2, 3)), (1, (5,)), (-1, ()))]
    # axis=None: TVM's own legalization of mode="nan" fails on it, so that pair uses axis 0
    cases.append(([((13,), "float32"), ((4, 2), "int64")], 0 if mode == "nan" else None))

    def make(bb, vs, axis):
        return bb.emit(R.take(vs[0], vs[1], axis=axis, mode=mode))

    mod = model(cases, make)
    one_region(mod)
    arrays = inputs(cases)
    in_range = mode == "fast"  # TVM reads out of bounds for these: compare in range only
    for k in range(1, len(arrays), 2):
        n = arrays[k - 1].shape[0 if cases[k // 2][1] in (0, None) else -1]
        arrays[k] = (np.abs(arrays[k]) % n if in_range else arrays[k]).astype(arrays[k].dtype)
    got, ref = both(mod, arrays)
    exact(got, ref)
    for g, (x, i), (_, axis) in zip(got, zip(arrays[::2], arrays[1::2]), cases):
        exact([g], [Take.reference(x, i, 0 if axis is None else axis % x.ndim, mode)])


def test_take_fast_mode_counts_negative_indices_from_the_end_and_clamps_the_rest():
    """TVM's "fast" mode reads outside the tensor; jitbyoc takes -n .. -1 from the end, as
    PyTorch does (TVM's torch frontend passes ``x[:, idx]``'s raw indices to a "fast"
    take), and clamps the rest (documented)."""
    cases = [([((5, 3), "float32"), ((7,), "int64")], 0)]
    mod = model(cases, lambda bb, vs, a: bb.emit(R.take(vs[0], vs[1], axis=a)))
    x = np.arange(15, dtype="float32").reshape(5, 3)
    idx = np.array([0, 4, -1, -5, -7, 5, 99], "int64")
    (got,) = run(build(mod, True), [x, idx])
    exact([got], [x[[0, 4, 4, 0, 0, 4, 4]]])


def test_embedding_with_symbolic_sequence_and_epilogue():
    cases = [([((50, 16), "float32"), (("n",), "int32"), (("n", 16), "float32")], None),
             ([(("n", 6), "float32"), ((6, "n"), "float32")], None)]

    def make(bb, vs, _):
        if len(vs) == 3:  # token embedding + positional embedding
            return bb.emit(R.add(R.take(vs[0], vs[1], axis=0), vs[2]))
        t = bb.emit(R.permute_dims(vs[0], [1, 0]))
        c = bb.emit(R.concat([t, vs[1]], axis=0))
        return bb.emit(R.strided_slice(c, [0], [1], [12], [2]))

    mod = model(cases, make, sym=["n"])
    one_region(mod)
    for n in (1, 17):
        arrays = inputs(cases, {"n": n}, seed=n)
        arrays[1] = np.abs(arrays[1]) % 50
        got, ref = both(mod, arrays)
        exact(got, ref)


def test_attention_head_split_chain_is_one_region():
    """BERT-style: x @ W (left to TVM here) -> + bias -> reshape heads -> transpose ->
    scale; and the way back: transpose -> reshape -> + residual. One region each way."""
    cases = [([(("n", 96), "float32"), ((96,), "float32"), ((96,), "float32")], None)]

    def make(bb, vs, _):
        x, bias, res = vs
        h = bb.emit(R.permute_dims(R.reshape(R.add(x, bias), (x.ty.shape[0], 4, 24)), [1, 0, 2]))
        s = bb.emit(R.multiply(h, relax.const(0.125, "float32")))
        back = bb.emit(R.reshape(R.permute_dims(s, [1, 0, 2]), (x.ty.shape[0], 96)))
        return bb.emit(R.add(back, res))

    mod = model(cases, make, sym=["n"])
    info = one_region(mod)
    assert info.ops.count("relax.permute_dims") == 2 and info.ops.count("relax.reshape") == 2
    for n in (3, 33):
        arrays = inputs(cases, {"n": n}, seed=n)
        got, ref = both(mod, arrays)
        np.testing.assert_array_equal(got[0], ref[0])


def test_unsupported_layouts_stay_with_tvm_with_reasons():
    cases = [([(("n", 4), "float32")], "flatten"), ([(("n", 4), "float32")], "reshape"),
             ([(("n", 4), "float32")], "slice")]

    def make(bb, vs, kind):
        x = vs[0]
        if kind == "flatten":
            return bb.emit(R.flatten(x))
        if kind == "reshape":
            return bb.emit(R.reshape(x, (x.ty.shape[0], 2)))  # (n, 4) -> (n, 2): fewer elements
        return bb.emit(R.strided_slice(x, [0], [1], [2]))

    mod = model(cases, make, sym=["n"])
    reasons = {f.op: f.reason for f in jitbyoc.report(mod).fallbacks}
    assert "relax.flatten" not in reasons  # (n, 4) -> (n * 4,): a derived size (test_symbolic_sizes)
    assert "hold as many elements" in reasons["relax.reshape"]  # (sizes only a result shows: test_fresh_sizes)
    assert "symbolic" in reasons["relax.strided_slice"]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the C rendering")
def test_c_rendering_matches_llvm_exactly(tmp_path):
    cases = [([((40, 33, 9), "float32"), ((9,), "int32"), ((40, 9, 33), "float32")], None),
             ([((7, 300), "int64")], None), ([((70, 72), "float64")], None)]  # whole tiles

    def make(bb, vs, _):
        if len(vs) == 1 and int(vs[0].ty.shape[0]) == 70:
            return bb.emit(R.permute_dims(vs[0]))
        if len(vs) == 1:
            return bb.emit(R.permute_dims(R.strided_slice(vs[0], [1], [299], [0], [-3])))
        x, idx, y = vs
        t = bb.emit(R.permute_dims(x, [0, 2, 1]))
        c = bb.emit(R.concat([t, y], axis=1))
        parts = bb.emit(R.split(c, 3, axis=0))
        g = bb.emit(R.take(relax.TupleGetItem(parts, 1), idx, axis=1, mode="wrap"))
        return [bb.emit(R.nn.relu(g)), bb.emit(relax.TupleGetItem(parts, 2))]

    mod = model(cases, make)
    one_region(mod)
    check_c_matches_llvm(mod, inputs(cases), tmp_path)


def test_register_transpose_network_is_a_transpose():
    """The shuffle rounds of the in-register 8x8 transpose, replayed in numpy."""
    rows = [np.arange(8) + 10 * k for k in range(8)]
    for shuffles in TRANSPOSE8:
        rows = [np.concatenate([rows[a], rows[b]])[list(mask)] for a, b, mask in shuffles]
    out = np.zeros((8, 8), int)
    for row, k in zip(rows, TRANSPOSE8_ORDER):
        out[k] = row
    np.testing.assert_array_equal(out, (np.arange(8)[:, None] * 10 + np.arange(8)).T)


def test_layout_chain_feeding_a_second_heavy_kernel_keeps_its_order():
    """permute_dims -> broadcast_to -> matmul -> matmul: splitting the region at the second
    matmul must not move the permute (which feeds the first matmul only through the
    broadcast) out of the region that needs it."""
    cases = [([((8, 6), "float32"), ((2, 8, 5), "float32"), ((5, 3), "float32")], None)]

    def make(bb, vs, _):
        x, w1, w2 = vs
        b = bb.emit(R.broadcast_to(bb.emit(R.permute_dims(x)), (2, 6, 8)))
        return bb.emit(R.matmul(bb.emit(R.matmul(b, w1)), w2))

    mod = model(cases, make)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    want = np.broadcast_to(arrays[0].T, (2, 6, 8)) @ arrays[1] @ arrays[2]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_broadcasts_and_fills_are_values_that_fuse():
    """broadcast_to/full_like/zeros_like/ones_like: no stage of their own; a kernel that
    needs the full tensor (permute_dims) gets it materialized, elementwise users do not."""
    cases = [([((3, 1), "float32"), ((4, 3, 5), "float32")], "bcast"),
             ([((6, 4), "float32"), ((), "float32")], "fill"),
             ([((1, 7), "int32")], "kernel"), ([((5, 6), "float32")], "ones")]

    def make(bb, vs, kind):
        if kind == "bcast":
            return bb.emit(R.multiply(R.broadcast_to(vs[0], (4, 3, 5)), vs[1]))
        if kind == "fill":
            return [bb.emit(R.add(vs[0], R.full_like(vs[0], vs[1]))),
                    bb.emit(R.full_like(vs[0], vs[1], dtype="int32"))]
        if kind == "kernel":
            return bb.emit(R.permute_dims(R.broadcast_to(vs[0], (3, 7))))
        return [bb.emit(R.add(R.ones_like(vs[0]), vs[0])), bb.emit(R.zeros_like(vs[0], "int64"))]

    mod = model(cases, make)
    arrays, got = one_exact_region(mod, cases)
    x, y, f = arrays[0], arrays[1], arrays[3]
    exact(got[:3], [x * y, arrays[2] + f, np.full((6, 4), f, "float32").astype("int32")])
    exact(got[3:4], [np.ascontiguousarray(np.broadcast_to(arrays[4], (3, 7)).T)])
