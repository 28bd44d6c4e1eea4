"""max_pool2d / avg_pool2d / adaptive_avg_pool2d kernels: differential against TVM's
default build (windowed pooling must match it exactly: same order of adds, one division)
and the float64 numpy reference, over every window attribute and awkward sizes."""

import itertools

import ml_dtypes
import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.pool2d import Pool2d
from jitbyoc.kernels.pool_planes import row_bands, runs_flat
from jitbyoc.render.vectors import lanes
from tests.diff_util import check_c_matches_llvm
from tests.spatial_util import CC, build, grid_model, random_inputs, run, run_c

F32 = "float32"
POOLS = {"max": relax.op.nn.max_pool2d, "avg": relax.op.nn.avg_pool2d}


def pool(bb, x, attrs):
    attrs = dict(attrs)
    kind = attrs.pop("kind")
    if kind == "adaptive":
        return bb.emit(relax.op.nn.adaptive_avg_pool2d(x, **attrs))
    return bb.emit(POOLS[kind](x, **attrs))


def reference(x, attrs, out_hw):
    a = dict(attrs)
    kind = a.pop("kind")
    if kind == "adaptive":
        return Pool2d.reference(x, kind, out_hw)
    return Pool2d.reference(x, kind, out_hw, a["pool_size"], a.get("strides", (1, 1)),
                            a.get("dilation", (1, 1)), a.get("padding", (0, 0, 0, 0)),
                            a.get("count_include_pad", False))


def window_grid():
    """Every combination of padding, stride, ceil_mode and count_include_pad, with input
    size, window and dilation cycled through them (a full product takes minutes)."""
    out = []
    for k, (pad, stride, ceil, include, kind) in enumerate(itertools.product(
            [(0, 0, 0, 0), (1, 0, 1, 2)], [(1, 1), (2, 3)], [False, True], [False, True], ["max", "avg"])):
        if kind == "max" and include:
            continue  # count_include_pad means nothing to max pooling
        hw = [(7, 8), (17, 3), (5, 5)][k % 3]
        size, dil = [(2, 2), (3, 1)][k // 3 % 2], [(1, 1), (2, 1)][k // 2 % 2]
        out.append(((1, 3) + hw, dict(kind=kind, pool_size=size, strides=stride, dilation=dil,
                                      padding=pad, ceil_mode=ceil, count_include_pad=include)))
    return out


ADAPTIVE = [((2, 17, 7, 7), (1, 1)), ((1, 3, 9, 5), (4, 3)), ((1, 5, 5, 5), (5, 5)),
            ((1, 1, 3, 7), (2, 5)), ((1, 16, 1, 1), (1, 1)), ((3, 4, 127, 3), (1, 1))]
RESNET_MAXPOOL = ((1, 64, 112, 112), dict(kind="max", pool_size=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1)))
# Inception's branch pool: rows of two vectors, the second masked, taps outside at both ends
INCEPTION_AVGPOOL = ((1, 19, 28, 28), dict(kind="avg", pool_size=(3, 3), strides=(1, 1), padding=(1, 1, 1, 1)))
# the last window starts just below the input (bottom padding > window): padding only
BELOW = [((1, 2, 4, 5), dict(kind=kind, pool_size=(2, 1), strides=(2, 1), dilation=(2, 1),
                              padding=(0, 0, 4, 0), count_include_pad=True))
         for kind in ("max", "avg")]


def all_cases():
    grid = window_grid() + [(s, dict(kind="adaptive", output_size=o)) for s, o in ADAPTIVE]
    return [([(s, F32)], a) for s, a in grid + [RESNET_MAXPOOL] + BELOW + [INCEPTION_AVGPOOL]]


def check(got, x, attrs, tvm_out):
    """Bit-equal to TVM; against numpy exact for max, and within ``(count + 1) * eps``
    of the mean magnitude for averages (sequential sum of ``count`` terms, one division)."""
    np.testing.assert_array_equal(got, tvm_out)
    ref = reference(x, attrs, got.shape[2:])
    if attrs["kind"] == "max":
        np.testing.assert_array_equal(got, ref)
        return
    count = np.prod(x.shape[2:]) if attrs["kind"] == "adaptive" else np.prod(attrs["pool_size"])
    bound = (count + 1) * np.finfo(x.dtype).eps * reference(np.abs(x), attrs, got.shape[2:])
    assert np.all(np.abs(got - ref) <= bound)


def test_grid_matches_tvm_default_exactly_and_numpy():
    cs = all_cases()
    mod = grid_model(cs, pool)
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [] and rep.offloaded_ops == len(cs)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        check(got[k], args[k], attrs, ref[k])


def test_bfloat16_pools_match_tvm_default_exactly():
    """A bfloat16 pool (the bf16 mode's roundings moved before max pools,
    ``jitbyoc/tvm/round_early.py``; bfloat16 models) runs on jitbyoc as TVM's build
    computes it: each value widened, the window pooled in float32, the result rounded
    once. Before, it stayed with TVM, and a bf16 mode's producer wrote its input twice:
    widened for the pool, rounded for the products."""
    cs = [([(shapes[0][0], "bfloat16")], attrs) for shapes, attrs in all_cases()]
    mod = grid_model(cs, pool)
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [] and rep.offloaded_ops == len(cs), str(rep)
    args = [a.astype(np.float32).astype(ml_dtypes.bfloat16) for a in random_inputs(
        [([(shapes[0][0], F32)], attrs) for shapes, attrs in cs])]
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        np.testing.assert_array_equal(got[k].view(np.uint16), ref[k].view(np.uint16), err_msg=str(attrs))


@pytest.mark.parametrize("dt", [F32, "bfloat16"])
def test_a_pool_of_a_few_thousand_outputs_runs_on_the_thread_pool(dt):
    """An Inception module's pool of 256 x 6 x 6 outputs (9 taps each) is worth the pool's
    threads (THREAD_MIN["pool"]); it ran on one thread while the other waited. Smaller
    ones stay on the calling thread."""
    for shape, threads in (((1, 256, 13, 13), True), ((1, 16, 13, 13), False)):
        attrs = dict(kind="max", pool_size=(3, 3), strides=(2, 2))
        (region,) = jitbyoc.inspect(grid_model([([(shape, dt)], attrs)], pool))
        assert ("TVMBackendParallelLaunch" in region.llvm_ir) == threads, shape


def test_max_of_infinities_and_all_padding_windows():
    """TVM pads max pooling with the lowest finite value: -inf inputs and windows that
    see only padding (ceil_mode) give that value, not -inf."""
    attrs = dict(kind="max", pool_size=(2, 2), strides=(3, 3), padding=(0, 0, 2, 2), ceil_mode=True)
    cs = [([((1, 2, 4, 4), F32)], attrs)]
    x = np.full((1, 2, 4, 4), -np.inf, F32)
    x[0, 1, 0, 0] = 5.0
    mod = grid_model(cs, pool)
    got, ref = run(build(mod, True), [x])[0], run(build(mod, False), [x])[0]
    np.testing.assert_array_equal(got, ref)
    assert got[0, 0, 0, 0] == np.finfo(F32).min and got[0, 1, 0, 0] == 5.0


def test_float64():
    cs = [([((2, 3, 9, 10), "float64")], dict(kind="avg", pool_size=(3, 3), strides=(2, 2),
                                               padding=(1, 1, 1, 1), count_include_pad=True))]
    args = random_inputs(cs)
    mod = grid_model(cs, pool)
    got, ref = run(build(mod, True), args)[0], run(build(mod, False), args)[0]
    assert got.dtype == np.float64
    check(got, args[0], cs[0][1], ref)


def test_symbolic_batch_two_values():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.ir.expr.Var("n", "int64"), 4, 11, 11), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.max_pool2d(x, pool_size=3, strides=2, padding=1))
            out = bb.emit_output(relax.op.nn.adaptive_avg_pool2d(y, (1, 1)))
        bb.emit_func_output(out)
    mod = bb.get()
    assert jitbyoc.report(mod).fallbacks == []
    ex, ex_ref = build(mod, True), build(mod, False)
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 4, 11, 11)).astype(F32)
        got, ref = run(ex, [x])[0], run(ex_ref, [x])[0]
        assert got.shape == (n, 4, 1, 1)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_epilogue_is_fused():
    def make(bb, x, attrs):
        y = bb.emit(relax.op.nn.avg_pool2d(x, pool_size=2, strides=2))
        return bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(-0.25, F32))))

    cs = [([((2, 5, 9, 9), F32)], {})]
    mod = grid_model(cs, make)
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert isinstance(stage, Pool2d) and stage.epilogue is not None
    args = random_inputs(cs)
    np.testing.assert_array_equal(run(build(mod, True), args)[0], run(build(mod, False), args)[0])


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) to build the C rendering")
@pytest.mark.parametrize("index", [5, 13, 22, 23, 25, 29, 30, 32])
def test_c_rendering_matches_llvm_exactly(index, tmp_path):
    cs = [all_cases()[index]]
    mod = grid_model(cs, pool)
    (region,) = jitbyoc.inspect(mod)
    args = random_inputs(cs, seed=index)
    llvm_out = run(build(mod, True), args)[0]
    c_out = run_c(region, {region.arg_names[0]: args[0]}, llvm_out.shape, F32, tmp_path)
    np.testing.assert_array_equal(c_out, llvm_out)


def test_nhwc_stays_with_tvm_with_reason():
    cs = [([((1, 9, 9, 4), F32)], dict(kind="max", pool_size=(2, 2), layout="NHWC"))]
    mod = grid_model(cs, pool)
    rep = jitbyoc.report(mod)
    assert [f.op for f in rep.fallbacks] == ["relax.nn.max_pool2d"] and "layout" in rep.fallbacks[0].reason
    args = random_inputs(cs)
    np.testing.assert_array_equal(run(build(mod, True), args)[0], run(build(mod, False), args)[0])


@st.composite
def pool_configs(draw):
    kind = draw(st.sampled_from(["max", "avg"]))
    size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = tuple(draw(st.integers(0, (size[i % 2] - 1) * dil[i % 2] // 2 + 1)) for i in range(4))
    # rows up to 40 wide: several vectors of columns, a masked tail, taps outside at both ends
    hw = tuple(draw(st.integers(max(1, (size[i] - 1) * dil[i] + 1 - pad[i] - pad[i + 2]), (12, 40)[i]))
               for i in range(2))
    return (draw(st.integers(1, 2)), draw(st.integers(1, 5))) + hw, dict(
        kind=kind, pool_size=size, dilation=dil, padding=pad,
        strides=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        ceil_mode=draw(st.booleans()), count_include_pad=draw(st.booleans()))


@settings(max_examples=8, deadline=None)
@given(pool_configs())
def test_random_configs_match_numpy(config):
    shape, attrs = config
    cs = [([(shape, F32)], attrs)]
    (x,) = random_inputs(cs)
    got = run(build(grid_model(cs, pool), True), [x])[0]
    ref = reference(x, attrs, got.shape[2:])  # float64 inside, result in float32
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


ND_CASES = [  # (op, input shape, attrs): 1-D pools, and 3-D windows trivial along some dims
    ("max_pool1d", (2, 3, 17), {"pool_size": (3,), "strides": (2,), "padding": (1, 1)}),
    ("avg_pool1d", (2, 3, 17), {"pool_size": (4,), "strides": (3,), "padding": (2, 1), "ceil_mode": True}),
    ("avg_pool1d", (1, 5, 9), {"pool_size": (3,), "padding": (1, 1), "count_include_pad": True}),
    # ONNX LRN as TVM's frontend writes it: a 3-D average over channels of x*x
    ("avg_pool3d", (5, 1, 7, 5, 3), {"pool_size": (3, 1, 1), "padding": (1, 0, 0, 1, 0, 0),
                                     "count_include_pad": True}),
    ("max_pool3d", (2, 3, 4, 9, 9), {"pool_size": (1, 3, 3), "strides": (1, 2, 2), "padding": (0, 1, 1, 0, 1, 1)}),
    ("avg_pool3d", (1, 2, 3, 8, 6), {"pool_size": (1, 2, 2), "strides": (1, 2, 2)}),
]


@pytest.mark.parametrize("op,shape,attrs", ND_CASES)
def test_pool1d_and_pool3d_as_2d_pools_match_tvm(op, shape, attrs, tmp_path):
    layout = "NCW" if op.endswith("1d") else "NCDHW"

    def make(bb, x):  # and a following op, in the same region
        return bb.emit(relax.op.negative(getattr(relax.op.nn, op)(x, layout=layout, **attrs)))

    x = relax.Var("x", relax.TensorType(shape, F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(make(bb, x))
        bb.emit_func_output(out)
    mod = bb.get()
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [], str(rep)
    xs = np.random.default_rng(len(shape)).standard_normal(shape).astype(F32)
    got, want = run(build(mod, True), [xs]), run(build(mod, False), [xs])
    np.testing.assert_array_equal(got[0], want[0])
    if CC is not None:
        check_c_matches_llvm(mod, [xs], tmp_path)


GENERAL_3D = [  # windows no 2-D pool of views can run
    ("avg_pool3d", (1, 2, 5, 6, 7), {"pool_size": (2, 2, 2)}),
    ("avg_pool3d", (1, 3, 32, 32, 32), {"pool_size": (2, 2, 2), "count_include_pad": True}),  # ONNX LpPool; threads
    ("max_pool3d", (2, 3, 6, 5, 7), {"pool_size": (3, 2, 3), "strides": (2, 1, 2), "padding": (1, 0, 1, 1, 1, 0)}),
    ("avg_pool3d", (1, 2, 7, 7, 7), {"pool_size": (3, 3, 3), "strides": (2, 2, 2), "padding": (1, 1, 1, 1, 1, 1),
                                     "count_include_pad": True, "ceil_mode": True}),
    ("avg_pool3d", (1, 1, 9, 8, 9), {"pool_size": (2, 3, 2), "dilation": (2, 1, 3), "padding": (0, 1, 2, 1, 1, 0)}),
]


@pytest.mark.parametrize("op,shape,attrs", GENERAL_3D)
def test_general_3d_windows_match_tvm(op, shape, attrs):
    x = relax.Var("x", relax.TensorType(shape, F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            # LpPool's form: a following multiply and power, fused (applied once per output)
            pooled = getattr(relax.op.nn, op)(x, layout="NCDHW", **attrs)
            out = bb.emit_output(relax.op.power(relax.op.multiply(pooled, relax.const(8.0, F32)),
                                                relax.const(2.0, F32)))
        bb.emit_func_output(out)
    mod = bb.get()
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [] and "Pool3d" in str([type(s).__name__ for r in jitbyoc.inspect(mod)
                                                     for s in r.kernel.stages]), str(rep)
    xs = np.random.default_rng(sum(shape)).standard_normal(shape).astype(F32)
    got, want = run(build(mod, True), [xs]), run(build(mod, False), [xs])
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("dt", ["uint8", "int8", "int32", "int64"])
def test_integer_max_pool_matches_tvm_exactly(dt, tmp_path):
    """Integer max pooling (ONNX MaxPool on uint8): TVM starts from and pads with the
    dtype's lowest value; a window of padding only yields it. C matches LLVM."""
    cs = [([((1, 3, 7, 5), dt)], dict(kind="max", pool_size=(3, 2), strides=(2, 2), padding=(1, 0, 4, 1))),
          ([((2, 1, 17, 3), dt)], dict(kind="max", pool_size=(2, 2), strides=(1, 1), dilation=(2, 1),
                                        ceil_mode=True))]
    rng = np.random.default_rng(1)
    info = np.iinfo(dt)
    args = [rng.integers(info.min, info.max, s, dtype=dt, endpoint=True) for (((s, _),), _) in cs]
    mod = grid_model(cs, pool)
    assert jitbyoc.report(mod).fallbacks == []
    got, want = run(build(mod, True), args), run(build(mod, False), args)
    for g, w, x, (_, attrs) in zip(got, want, args, cs):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(g, reference(x, attrs, g.shape[2:]))
    one = grid_model(cs[:1], pool)
    (region,) = jitbyoc.inspect(one)
    c_out = run_c(region, {region.arg_names[0]: args[0]}, got[0].shape, dt, tmp_path)
    np.testing.assert_array_equal(c_out, got[0])


def test_integer_average_pool_stays_with_tvm():
    mod = grid_model([([((1, 2, 4, 4), "int32")], dict(kind="avg", pool_size=(2, 2)))], pool)
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert "int32 not supported" in fallback.reason


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("stride", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("width", [15, 16, 17, 33, 112])
def test_rows_on_explicit_vectors_match_tvm_exactly(kind, stride, width):
    """Column strides up to 4 take explicit vectors (one masked span load and a shuffle per
    vector of outputs; 5 stays scalar): every span and tail, with padding and dilation."""
    attrs = {"kind": kind, "pool_size": (3, 3), "strides": (2, stride), "padding": (1, 1, 1, 2),
             "dilation": (1, 2 if width == 33 else 1)}
    cs = [([((2, 3, 9, width), F32)], attrs)]
    mod = grid_model(cs, pool)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("kind,stride,include", [("max", 1, False), ("avg", 1, True), ("avg", 2, False),
                                                 ("max", 3, False), ("avg", 4, True)])
def test_long_rows_loop_over_interior_vectors_match_tvm_exactly(kind, stride, include):
    """Rows of many vectors: edge vectors unrolled (masks, counts), the interior run of
    vectors one loop at a runtime column; dilation makes the edges several vectors wide."""
    attrs = {"kind": kind, "pool_size": (3, 3), "strides": (1, stride), "padding": (1, 9, 2, 20),
             "dilation": (1, 5), "count_include_pad": include}
    cs = [([((1, 3, 6, 401), F32)], attrs)]
    mod = grid_model(cs, pool)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    np.testing.assert_array_equal(got[0], ref[0])


def test_lrn_over_large_maps_is_a_loop_not_unrolled():
    """ZFNet's LRN, an average over 5 channels of 109x109 maps (rows of 11881 columns): its
    interior vectors are one loop. Unrolled, the region was ~90,000 LLVM instructions and
    took seconds to build (slower than TVM's whole build of ZFNet)."""
    shape = (1, 1, 96, 109, 109)
    x = relax.Var("x", relax.TensorType(shape, F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.avg_pool3d(x, pool_size=(5, 1, 1), padding=(2, 0, 0, 2, 0, 0),
                                                        layout="NCDHW", count_include_pad=True))
        bb.emit_func_output(out)
    mod = bb.get()
    (region,) = jitbyoc.inspect(mod)
    assert region.llvm_ir.count("\n") < 2000, region.llvm_ir.count("\n")
    xs = np.random.default_rng(5).standard_normal(shape).astype(F32)
    got, want = run(build(mod, True), [xs]), run(build(mod, False), [xs])
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("op, attrs", [
    ("avg_pool2d", {"pool_size": (5, 1), "padding": (2, 0, 2, 0), "count_include_pad": True}),
    ("max_pool2d", {"pool_size": (3, 6), "strides": (2, 5), "padding": (1, 2, 1, 1)})])
def test_few_planes_split_into_row_bands(op, attrs, tmp_path):
    """One plane (LRN's average over channels as TVM's frontend views it: C rows of H*W
    columns; a window pool with column stride 5) runs as (plane, row band) tasks, each
    band with its share of the fused epilogue: equal to TVM's build and to the C
    rendering. On one plane Inception v1's LRN ran on one thread."""
    shape = (1, 1, 37, 270)
    x = relax.Var("x", relax.TensorType(shape, F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(getattr(relax.op.nn, op)(x, **attrs))
            out = bb.emit_output(bb.emit(relax.op.negative(relax.op.nn.relu(y))))
        bb.emit_func_output(out)
    mod = bb.get()
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert isinstance(stage, Pool2d) and stage.epilogue is not None and row_bands(stage) == 8
    xs = np.random.default_rng(7).standard_normal(shape).astype(F32)
    got, want = run(build(mod, True), [xs]), run(build(mod, False), [xs])
    np.testing.assert_array_equal(got[0], want[0])
    if CC is not None:
        check_c_matches_llvm(mod, [xs], tmp_path)


FLAT_CASES = [((1, 512, 13, 13), "uint8", {"pool_size": (3, 3), "padding": (1, 1, 1, 1)}),  # Inception v1's
              ((2, 4, 28, 28), "uint8", {"pool_size": (3, 3), "padding": (1, 1, 1, 1)}),
              ((1, 9, 5, 7), "int8", {"pool_size": (3, 2), "padding": (2, 0, 0, 1)}),
              ((1, 8, 9, 11), "uint8", {"pool_size": (3, 3), "padding": (2, 2, 2, 2), "dilation": (2, 2)}),
              ((1, 8, 6, 5), "uint8", {"pool_size": (2, 3), "padding": (0, 1, 0, 1), "ceil_mode": True}),
              ((1, 832, 7, 7), F32, {"pool_size": (3, 3), "padding": (1, 1, 1, 1)})]


@pytest.mark.parametrize("shape,dt,attrs", FLAT_CASES)
def test_small_maps_pool_whole_planes_at_once(shape, dt, attrs, tmp_path):
    """Stride-1 max pools over maps at most half a vector wide (uint8 13x13 on 64 lanes)
    take each plane as one flat run, a constant mask of in-input lanes per vector and tap:
    every pad, dilation, and the fused epilogue, equal to TVM's build, numpy's reference
    and the C rendering (which keeps the row loops)."""
    x = relax.Var("x", relax.TensorType(shape, dt))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.max_pool2d(x, **attrs))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(out)
    mod = bb.get()
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert stage.epilogue is not None and runs_flat(stage, lanes(dt))
    rng = np.random.default_rng(11)
    xs = (rng.integers(-128, 128, shape) if dt == "int8" else rng.integers(0, 256, shape)).astype(dt)
    got, want = run(build(mod, True), [xs]), run(build(mod, False), [xs])
    np.testing.assert_array_equal(got[0], want[0])
    ref = reference(xs, dict(kind="max", **{k: v for k, v in attrs.items() if k != "ceil_mode"}), got[0].shape[2:])
    np.testing.assert_array_equal(got[0], np.maximum(ref, 0).astype(dt))
    if CC is not None:
        check_c_matches_llvm(mod, [xs], tmp_path)
