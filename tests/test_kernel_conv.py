"""conv2d / conv1d kernel: differential against TVM's default build and the float64 numpy
reference, over a grid of awkward sizes and every attribute (see jitbyoc/kernels/conv2d.py
for the tolerance: ``K * eps * sum |x * w|`` per output, K = Cin/groups * KH * KW)."""

import os

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import driver
from jitbyoc.engines import conv_plan
from jitbyoc.engines.conv_plan import Layout, Plan
from jitbyoc.kernels.conv2d import Conv2d, ConvGeometry
from tests.spatial_util import CC, build, grid_model, random_inputs, run, run_c

F32 = "float32"

# (x shape, w shape, attrs); attrs use Relax's spelling. Sizes 1, 3, 17, 127, odd spatial
# sizes, channel counts off multiples of 16, every stride/padding/dilation/groups variant.
CONV2D = [
    ((1, 1, 1, 1), (1, 1, 1, 1), {}),
    ((1, 3, 17, 17), (5, 3, 3, 3), dict(padding=(1, 1, 1, 1))),
    ((2, 17, 9, 11), (17, 17, 3, 3), dict(padding=(1, 1, 1, 1))),
    ((1, 8, 13, 7), (20, 8, 1, 1), dict(strides=(2, 2))),
    ((1, 6, 15, 16), (9, 6, 3, 3), dict(strides=(2, 1), padding=(0, 1, 2, 0))),
    ((1, 4, 17, 13), (6, 4, 3, 2), dict(dilation=(2, 3), padding=(2, 1, 0, 3))),
    ((1, 6, 11, 11), (9, 2, 3, 3), dict(strides=(2, 2), padding=(1, 1, 1, 1), groups=3)),
    ((1, 16, 17, 17), (16, 1, 3, 3), dict(padding=(1, 1, 1, 1), groups=16)),  # depthwise
    ((1, 24, 14, 15), (24, 1, 5, 5), dict(strides=(2, 2), padding=(2, 2, 2, 2), groups=24)),
    ((1, 8, 9, 9), (16, 1, 3, 3), dict(padding=(1, 1, 1, 1), groups=8)),  # channel multiplier 2
    ((1, 3, 23, 23), (64, 3, 7, 7), dict(strides=(2, 2), padding=(3, 3, 3, 3))),  # ResNet stem
    ((1, 3, 5, 40), (2, 3, 1, 20), dict(strides=(1, 3))),  # wide window: looped columns
    ((1, 2, 30, 30), (3, 2, 9, 9), dict(strides=(3, 3), dilation=(2, 2))),
    ((3, 127, 3, 3), (33, 127, 3, 3), dict(padding=(1, 1, 1, 1))),
    ((1, 5, 3, 3), (4, 5, 3, 3), {}),  # 1x1 output
    ((1, 4, 6, 6), (4, 4, 2, 2), dict(strides=(4, 4))),  # stride > window: unused phases
    ((1, 4, 9, 9), (4, 4, 3, 3), dict(strides=(2, 2), dilation=(2, 2))),
    ((1, 4, 10, 10), (4, 4, 3, 3), dict(strides=(3, 3), dilation=(2, 2), padding=(0, 2, 1, 0))),
]
CONV1D = [
    ((2, 5, 31), (7, 5, 3), dict(strides=2, padding=(1, 2))),
    ((1, 6, 40), (6, 1, 5), dict(groups=6, dilation=3, padding=(4, 4))),
    ((1, 3, 64), (4, 3, 25), {}),
]


def conv(bb, x, w, attrs):
    op = relax.op.nn.conv1d if x.ty.ndim == 3 else relax.op.nn.conv2d
    return bb.emit(op(x, w, **attrs))


def ref_attrs(x_shape, attrs) -> dict:
    """Relax attrs -> :meth:`Conv2d.reference` keywords (ints broadcast like Relax)."""
    two = len(x_shape) == 4
    tup = lambda v, n: tuple(v) if isinstance(v, (tuple, list)) else (v,) * n  # noqa: E731
    pad = tup(attrs.get("padding", 0), 4 if two else 2)
    return dict(strides=tup(attrs.get("strides", 1), 2 if two else 1),
                padding=pad if two or len(pad) == 2 else pad[:2],
                dilation=tup(attrs.get("dilation", 1), 2 if two else 1), groups=attrs.get("groups", 1))


def error_bound(x, w, attrs, dtype=F32):
    """Twice the worst-case accumulation error (two independently rounded results)."""
    k = np.prod(w.shape[1:])
    u = np.finfo(dtype).eps / 2
    mag = Conv2d.reference(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64), **ref_attrs(x.shape, attrs))
    return 2 * k * u * mag + np.finfo(dtype).tiny


def check(got, x, w, attrs, others=()):
    ref = Conv2d.reference(x.astype(np.float64), w.astype(np.float64), **ref_attrs(x.shape, attrs))
    bound = error_bound(x, w, attrs, got.dtype)
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= bound), f"max err {np.abs(got - ref).max()} vs numpy"
    for other in others:
        assert np.all(np.abs(got - other) <= bound), f"max err {np.abs(got - other).max()} vs TVM"


def cases(grid, dtype=F32):
    return [([(xs, dtype), (ws, dtype)], attrs) for xs, ws, attrs in grid]


def test_grid_matches_tvm_default_and_numpy():
    cs = cases(CONV2D + CONV1D)
    mod = grid_model(cs, conv)
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [] and rep.offloaded_ops == len(cs)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        check(got[k], args[2 * k], args[2 * k + 1], attrs, [ref[k]])


def test_float64():
    cs = cases([((2, 5, 9, 10), (6, 5, 3, 3), dict(strides=(2, 1), padding=(1, 1, 1, 1)))], "float64")
    args = random_inputs(cs)
    (got,) = run(build(grid_model(cs, conv), True), args)
    assert got.dtype == np.float64
    check(got, *args, cs[0][1])


def conv_bias_relu(bb, x, w, b, attrs):
    bias = bb.emit(relax.op.reshape(b, (1, -1, 1, 1))) if attrs.pop("reshape", False) else b
    y = bb.emit(relax.op.add(conv(bb, x, w, attrs), bias))
    return bb.emit(relax.op.nn.relu(y))


@pytest.mark.parametrize("bias_shape", [(1, 12, 1, 1), (12,)])
def test_bias_relu_fused_into_the_conv(bias_shape):
    attrs = dict(strides=(2, 2), padding=(1, 1, 1, 1), reshape=len(bias_shape) == 1)
    cs = [([((2, 7, 13, 13), F32), ((12, 7, 3, 3), F32), (bias_shape, F32)], attrs)]
    mod = grid_model(cs, lambda bb, x, w, b, a: conv_bias_relu(bb, x, w, b, dict(a)))
    regions = [r for r in jitbyoc.inspect(mod) if "relax.nn.conv2d" in r.kernel.ops]
    assert len(regions) == 1 and {"relax.add", "relax.nn.relu"} <= set(regions[0].kernel.ops)
    (stage,) = [s for s in regions[0].kernel.stages if isinstance(s, Conv2d)]
    assert stage.epilogue is not None, "bias + relu run inside the conv's blocks"
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args)[0], run(build(mod, False), args)[0]
    x, w, b = args
    want = np.maximum(Conv2d.reference(x, w, (2, 2), (1, 1, 1, 1)) + b.reshape(1, -1, 1, 1), 0)
    bound = error_bound(x, w, {"strides": (2, 2), "padding": (1, 1, 1, 1)}) + 1e-6 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound) and np.all(np.abs(got - ref) <= bound)


def test_symbolic_batch_two_values():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.ir.expr.Var("n", "int64"), 5, 9, 9), F32))
    w = relax.Var("w", relax.TensorType((6, 5, 3, 3), F32))
    b = relax.Var("b", relax.TensorType((1, 6, 1, 1), F32))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(conv_bias_relu(bb, x, w, b, dict(padding=(1, 1, 1, 1))))
        bb.emit_func_output(out)
    mod = bb.get()
    assert jitbyoc.report(mod).fallbacks == []
    ex, ex_ref = build(mod, True), build(mod, False)
    rng = np.random.default_rng(3)
    for n in (1, 3):
        args = [rng.standard_normal(s).astype(F32) for s in ((n, 5, 9, 9), (6, 5, 3, 3), (1, 6, 1, 1))]
        got, ref = run(ex, args)[0], run(ex_ref, args)[0]
        assert got.shape == (n, 6, 9, 9)
        assert np.all(np.abs(got - ref) <= error_bound(args[0], args[1], dict(padding=(1, 1, 1, 1))) + 1e-6)


# stride = kernel, no padding: one product on the windows gathered as columns
PATCHES = [
    ((1, 3, 32, 32), (16, 3, 16, 16), dict(strides=(16, 16))),  # ViT's embedding, smaller
    ((2, 5, 17, 23), (7, 5, 2, 3), dict(strides=(2, 3))),  # rows and columns left over
    ((1, 16, 8, 8), (24, 16, 4, 4), dict(strides=(4, 4))),  # ConvNeXt's stem
    ((3, 2, 9, 9), (4, 2, 3, 3), dict(strides=(3, 3))),
    ((2, 4, 31), (6, 4, 5), dict(strides=5)),  # conv1d
]


def test_patch_convs_run_on_the_gemm_engine():
    """ViT-B/16's 16x16/16 embedding compiled a direct-conv engine for its one layer (the
    largest job of its build); windows that do not overlap are a matrix product."""
    cs = cases(PATCHES)
    mod = grid_model(cs, conv)
    args = random_inputs(cs)
    ex = build(mod, True)
    engines = driver.last_cache_status()
    assert not [e for e in engines if e.startswith("jitbyoc_lib_conv")] and \
        [e for e in engines if e.startswith("jitbyoc_lib_gemm")], engines
    got, ref = run(ex, args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        check(got[k], args[2 * k], args[2 * k + 1], attrs, [ref[k]])


def test_patch_conv_with_a_constant_weight_bias_and_a_symbolic_batch():
    rng = np.random.default_rng(5)
    weight, bias = rng.standard_normal((12, 3, 4, 4)).astype(F32), rng.standard_normal((1, 12, 1, 1)).astype(F32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.ir.expr.Var("n", "int64"), 3, 18, 17), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), strides=(4, 4)))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(bias)))))
        bb.emit_func_output(out)
    mod = bb.get()
    assert jitbyoc.report(mod).fallbacks == []
    ex, ex_ref = build(mod, True), build(mod, False)
    for n in (1, 3):
        xs = rng.standard_normal((n, 3, 18, 17)).astype(F32)
        got, ref = run(ex, [xs])[0], run(ex_ref, [xs])[0]
        want = np.maximum(Conv2d.reference(xs, weight, (4, 4)) + bias, 0)
        bound = error_bound(xs, weight, dict(strides=(4, 4))) + 1e-6 * np.abs(want)
        assert got.shape == (n, 12, 4, 4) and np.all(np.abs(got - want) <= bound) and np.all(np.abs(got - ref) <= bound)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) to build the C rendering")
@pytest.mark.parametrize("index", [2, 6, 9, 13, len(CONV2D)])
def test_c_rendering_agrees_with_llvm(index, tmp_path):
    grid = CONV2D + CONV1D
    cs = cases([grid[index]])
    mod = grid_model(cs, conv)
    (region,) = jitbyoc.inspect(mod)
    args = random_inputs(cs, seed=index)
    llvm_out = run(build(mod, True), args)[0]
    c_out = run_c(region, dict(zip(region.arg_names, args)), llvm_out.shape, F32, tmp_path)
    check(c_out, *args, cs[0][1], [llvm_out])


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) to build the C rendering")
def test_c_rendering_with_fused_bias_relu(tmp_path):
    attrs = dict(strides=(1, 2), padding=(1, 0, 1, 2), groups=2)
    cs = [([((2, 6, 9, 11), F32), ((10, 3, 3, 3), F32), ((1, 10, 1, 1), F32)], attrs)]
    mod = grid_model(cs, lambda bb, x, w, b, a: conv_bias_relu(bb, x, w, b, dict(a)))
    (region,) = jitbyoc.inspect(mod)
    assert region.kernel.stages[0].epilogue is not None
    args = random_inputs(cs, seed=7)
    llvm_out = run(build(mod, True), args)[0]
    c_out = run_c(region, dict(zip(region.arg_names, args)), llvm_out.shape, F32, tmp_path)
    assert (c_out >= 0).all() and (c_out == 0).any() and (c_out > 0).any()
    bound = error_bound(args[0], args[1], attrs) + 1e-6 * np.abs(llvm_out)
    assert np.all(np.abs(c_out - llvm_out) <= bound)


@pytest.mark.parametrize("attrs, shapes, reason, runs", [
    (dict(data_layout="NHWC", kernel_layout="HWIO"), [(1, 9, 9, 4), (3, 3, 4, 8)], "layout", True),
    (dict(out_layout="NHWC"), [(1, 4, 9, 9), (8, 4, 3, 3)], "layout", False),  # TVM can't either
    (dict(out_dtype="float64"), [(1, 4, 9, 9), (8, 4, 3, 3)], "out_dtype", True),
])
def test_unsupported_stays_with_tvm_with_reason(attrs, shapes, reason, runs):
    cs = [([(s, F32) for s in shapes], attrs)]
    mod = grid_model(cs, conv)
    rep = jitbyoc.report(mod)
    assert [f.op for f in rep.fallbacks] == ["relax.nn.conv2d"] and reason in rep.fallbacks[0].reason
    if not runs:
        return
    args = random_inputs(cs)
    np.testing.assert_array_equal(run(build(mod, True), args)[0], run(build(mod, False), args)[0])


def test_float16_runs_in_float32():
    """A float16 convolution (weight an input) runs in float32 on exactly widened operands,
    its result rounded once (jitbyoc.tvm.widen): numpy's float32 convolution, rounded."""
    cs = cases([((1, 4, 9, 9), (8, 4, 3, 3), {})], "float16")
    mod = grid_model(cs, conv)
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [] and len(rep.regions) == 1, str(rep)
    x, w = (a.astype(np.float16) for a in random_inputs(cs))
    want = Conv2d.reference(x.astype(np.float32), w.astype(np.float32)).astype(np.float16)
    got = run(build(mod, True), [x, w])[0]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2.0 ** -10,
                               atol=2.0 ** -10 * float(np.abs(want).max()))


def run_with_plan(mod, args, layout_dense: bool, lanes: int, j: int, v: int, rows: int):
    """Run the single conv region of ``mod`` compiled with a forced plan."""
    return outputs_with_plan(mod, args, (layout_dense, lanes, j, v, rows), 1)[0]


def outputs_with_plan(mod, args, plan: tuple, calls: int) -> list:
    """The outputs of ``calls`` calls of the single conv region of ``mod`` compiled with
    a forced plan ``(layout_dense, lanes, j, v, rows)``, each into a NaN-filled output."""
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    dense, lanes, j, v, rows = plan
    # the engines pack into workspaces of each thread's own: no region buffer to resize
    stage.plan = Plan(Layout(stage.geo, dense), lanes, j, v, min(rows, stage.geo.oh))
    fn, tensors = driver.load_region(region)[region.symbol], [tvm.runtime.tensor(a) for a in args]
    out, outs = tvm.runtime.empty(tuple(stage.out.shape), F32), []
    for _ in range(calls):
        out.copyfrom(np.full(out.shape, np.nan, F32))
        fn(*tensors, out)
        outs.append(out.numpy())
    return outs


PLANS = [(False, 16, 5, 2, 3), (False, 8, 3, 8, 100), (True, 16, 16, 1, 2), (True, 8, 7, 3, 1), (True, 8, 2, 8, 5)]


@pytest.mark.parametrize("index, plan", [(i, p) for k, p in enumerate(PLANS)
                                         for i in ([4, 6, 8, 12, len(CONV2D)] * 2)[k:k + 2]])
def test_every_layout_and_vector_width(index, plan):
    """Both workspace layouts, 512- and 256-bit vectors, remainder channel blocks, chunks
    of up to 8 vectors (overrunning into the slack) and row bands of several sizes."""
    cs = cases([(CONV2D + CONV1D)[index]])
    args = random_inputs(cs, seed=index)
    got = run_with_plan(grid_model(cs, conv), args, *plan)
    check(got, *args, cs[0][1])


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(1, 20), st.integers(1, 2),
       st.booleans(), st.sampled_from([8, 16]), st.integers(1, 16), st.integers(1, 4), st.integers(1, 9))
def test_forced_plans_store_whole_and_partial_vectors(c, h, w, k, stride, dense, lanes, j, v, rows):
    """Output rows from 1 to 40 wide against vectors of 8 and 16 lanes, in both layouts,
    with row bands and remainder channel blocks: vectors inside a row (or, dense, inside
    the band) take plain stores, the rest masked ones; every output is written once."""
    cs = cases([((1, c, h, w), (k, c, 3, 3), dict(strides=(stride, stride), padding=(1, 1, 1, 1)))])
    args = random_inputs(cs, seed=h * 41 + w)
    got = run_with_plan(grid_model(cs, conv), args, dense, lanes, j, v, rows)
    check(got, *args, cs[0][1])


@pytest.mark.skipif(int(os.environ.get("TVM_NUM_THREADS", os.cpu_count())) < 2, reason="one thread takes every band")
@pytest.mark.parametrize("x_shape, w_shape, attrs, rows", [
    ((1, 8, 9, 9), (40, 8, 3, 3), dict(padding=(1, 1, 1, 1)), 100),  # one band: thread 0's range is empty
    ((1, 6, 11, 11), (12, 2, 3, 3), dict(padding=(1, 1, 1, 1), groups=3), 100),  # 3 units on 2 threads
    ((2, 5, 13, 7), (9, 5, 3, 3), dict(strides=(2, 2), padding=(1, 1, 1, 1)), 2),  # bands of 2 rows, 2 images
])
def test_bands_taken_from_another_threads_range_are_packed_by_the_taker(x_shape, w_shape, attrs, rows):
    """A thread packs its own range of row bands into a workspace of its own; a task it
    takes from another thread's range (that thread is behind, or its range is the only
    one) packs that band's rows, window reach included, into its own first. One output
    channel per task: many tasks per band, so both threads take tasks of every band."""
    cs = cases([(x_shape, w_shape, attrs)])
    args = random_inputs(cs, seed=7)
    for got in outputs_with_plan(grid_model(cs, conv), args, (False, 16, 1, 1, rows), 25):
        check(got, *args, cs[0][1])


@pytest.mark.parametrize("lanes, j, v", [(16, 16, 1), (8, 3, 7)])
def test_engine_stores_vectors_inside_a_row_plainly(lanes, j, v):
    """A vector of outputs inside one output row is stored with plain vector stores (only
    masked stores held a 3-channel stem conv to 35 % of peak: a masked store costs Zen 4
    several plain ones)."""
    from jitbyoc.toolchain import jit
    from jitbyoc.engines import ir_text
    from jitbyoc.engines.conv_engine import ConvEngine
    from jitbyoc.render import isa

    engine = ConvEngine(F32, lanes, j, v)
    optimized = jit.optimize(ir_text(engine, isa.current().triple, jit.data_layout()), engine.pipeline)
    assert f"store <{lanes} x float>" in optimized  # accumulators live in registers: these are outputs
    assert "llvm.masked.store" in optimized  # vectors across a row's end


def test_engine_packs_rows_without_libc_calls():
    """The pack copies a row and zeroes its halos with vector code: a libc call per row
    (memcpy of 224 bytes, memset of a pixel or two) cost a 56x56 3x3 conv with 64 input
    channels 32K calls per image, 4-8 % of the conv's time."""
    from jitbyoc.toolchain import jit
    from jitbyoc.engines import ir_text
    from jitbyoc.engines.conv_engine import ConvEngine
    from jitbyoc.render import isa

    engine = ConvEngine(F32, 16, 16, 1)
    optimized = jit.optimize(ir_text(engine, isa.current().triple, jit.data_layout()), engine.pipeline)
    assert "@llvm.memcpy" not in optimized and "@memcpy" not in optimized


# rows of every length around the vector (16 lanes: 2 x 16 input elements a strip)
STRIDE_2 = [((1, 3, 9, w), (5, 3, kw, 3), dict(strides=(1, 2), padding=(1, p, 0, p)))
            for w, kw, p in [(7, 1, 0), (31, 3, 1), (32, 3, 0), (33, 2, 1), (34, 3, 1), (65, 3, 2), (97, 1, 0)]]


def test_stride_2_rows_are_packed_as_vectors():
    """The pack takes a stride-2 row's elements as the even lanes of two vector loads
    that read nothing past the last element taken (a row ending the input tensor
    included), at every row length around the vector; checked against TVM and numpy."""
    from jitbyoc.engines import ir_text
    from jitbyoc.engines.conv_engine import ConvEngine
    from jitbyoc.render import isa

    even = ", ".join(f"i32 {i}" for i in range(0, 32, 2))
    assert f"<16 x i32> <{even}>" in ir_text(ConvEngine(F32, 16, 16, 1), isa.current().triple, "")
    cs = cases(STRIDE_2)
    mod = grid_model(cs, conv)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        check(got[k], args[2 * k], args[2 * k + 1], attrs, [ref[k]])


@st.composite
def conv_configs(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cin, cout = groups * draw(st.integers(1, 5)), groups * draw(st.integers(1, 7))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    pad = tuple(draw(st.integers(0, 2)) for _ in range(4))
    h = draw(st.integers(max(1, dh * (kh - 1) + 1 - pad[0] - pad[2]), 13))
    w = draw(st.integers(max(1, dw * (kw - 1) + 1 - pad[1] - pad[3]), 13))
    n = draw(st.integers(1, 2))
    return (n, cin, h, w), (cout, cin // groups, kh, kw), dict(
        strides=(sh, sw), dilation=(dh, dw), padding=pad, groups=groups)


@settings(max_examples=8, deadline=None)
@given(conv_configs())
def test_random_configs_match_numpy(config):
    cs = cases([config])
    args = random_inputs(cs)
    (got,) = run(build(grid_model(cs, conv), True), args)
    check(got, *args, config[2])


@settings(max_examples=60, deadline=None)
@given(conv_configs(), st.sampled_from([F32, "float64"]))
def test_plan_prefers_the_engine_menu_within_its_slack(config, dt):
    """The chosen plan is the cheapest candidate, or a menu block (a shared engine)
    costing at most MENU_SLACK times that; ResNet-18's eleven distinct layers need two
    conv engines."""
    (n, c, h, w), (k, cg, kh, kw), attrs = config
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    pt, pl, pb, pr = attrs["padding"]
    oh, ow = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    geo = ConvGeometry(n, c, h, w, k, kh, kw, (sh, sw), (dh, dw), (pt, pl, pb, pr), attrs["groups"], oh, ow)
    costs = {p: conv_plan.cost(p, dt) for p in conv_plan.candidates(geo, dt)}
    chosen, best = conv_plan.choose_plan(geo, dt), min(costs.values())
    assert costs[chosen] == best or (conv_plan.on_menu(chosen, dt)
                                     and costs[chosen] <= best * conv_plan.MENU_SLACK)
    menu = [c for p, c in costs.items() if conv_plan.on_menu(p, dt)]
    if menu and min(menu) <= best * conv_plan.MENU_SLACK:
        assert conv_plan.on_menu(chosen, dt)


def _square_geo(c, size, k, kh, s, pad=None):
    pad = kh // 2 if pad is None else pad
    o = (size + 2 * pad - kh) // s + 1
    return ConvGeometry(1, c, size, size, k, kh, kh, (s, s), (1, 1), (pad,) * 4, 1, o, o)


def _compiling_for(cpu):
    from jitbyoc.render import isa
    from jitbyoc.tvm.target import machine_for

    return isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu})))


@pytest.mark.parametrize("cpu", ["znver4", "haswell", "x86-64"])
def test_a_conv_whose_input_outweighs_its_weights_gets_a_band_per_thread(cpu):
    """Threads pack the rows of their own bands: one band made every thread pack the
    whole input (AVX2, 3x3 64->64 on 56x56). Where the weights are the bigger (3x3 256 on
    14x14) bands stay as load balance alone asks, since each band reads all of them."""
    from jitbyoc.engines import conv_channel_plan

    def geo(c, size):
        return _square_geo(c, size, c, 3, 1)

    def bands(g):
        chan = conv_channel_plan.choose(g, F32)
        rows = chan.rows if chan is not None else conv_plan.choose_plan(g, F32).rows
        return -(-g.oh // rows)

    with _compiling_for(cpu):
        assert bands(geo(64, 56)) >= conv_plan.MIN_UNITS
        assert bands(geo(3, 9)) >= conv_plan.MIN_UNITS
        assert conv_plan.bands_wanted(geo(256, 14), 16) == 1


def test_resnet18_layers_share_two_conv_engines():
    """On Zen 4's issue model (the blocks of :data:`conv_plan.MENUS` were picked on it)."""
    geo = _square_geo
    layers = [geo(3, 224, 64, 7, 2), geo(64, 56, 64, 3, 1)] + [
        g for c, size in [(64, 56), (128, 28), (256, 14)]
        for g in (geo(c, size, 2 * c, 3, 2), geo(c, size, 2 * c, 1, 2), geo(2 * c, size // 2, 2 * c, 3, 1))]
    with _compiling_for("znver4"):
        blocks = {(p.lanes, p.j, p.v) for p in (conv_plan.choose_plan(g, F32) for g in layers)}
    assert len(blocks) == 2, blocks


@pytest.mark.parametrize("c, size, k, kh, s, pad", [(96, 54, 256, 5, 2, 0), (3, 224, 96, 7, 2, 1),
                                                   (3, 224, 64, 7, 2, 3)])
def test_a_machine_with_two_fma_pipes_gets_blocks_of_fewer_broadcasts(c, size, k, kh, s, pad):
    """Zen 4's model picks the 16x1 block (16 broadcast weights and one load per 16 FMAs)
    for ZFNet's 5x5/2 96->256 and the 7x7/2 stems; on Intel's AVX-512 server cores a
    broadcast costs ~1.8 FMAs (:data:`conv_plan.TWO_FMA_PIPES`) and that block ran 1.4x the
    time of 13x2 (ZFNet's 5x5, Emerald Rapids): there the block reuses each broadcast."""
    g = _square_geo(c, size, k, kh, s, pad)
    with _compiling_for("znver4"):
        assert conv_plan.issue_costs() == conv_plan.ONE_FMA_PIPE
        zen = conv_plan.choose_plan(g, F32)
    with _compiling_for("emeraldrapids"):
        assert conv_plan.issue_costs() == conv_plan.TWO_FMA_PIPES
        intel = conv_plan.choose_plan(g, F32)
    assert (zen.j, zen.v) == (16, 1)
    assert intel.v > 1 and intel.j < 16, intel


def test_a_server_core_reporting_a_client_model_gets_two_fma_pipes():
    """A Xeon with AMX under KVM reports model 167, which LLVM names ``rocketlake`` (a
    client core: one 512-bit FMA pipe), but its FMA loop runs at two pipes' rate (418-488
    GFLOP/s on 2 threads). AMX is only on the server cores (Sapphire Rapids on), so it
    picks the two-pipe model: ResNet-50 fp32 0.94-0.96x the time, ZFNet 0.86-0.90x."""
    from jitbyoc.render import isa
    from jitbyoc.tvm.target import machine_for

    amx = tvm.target.Target({"kind": "llvm", "mcpu": "rocketlake", "mattr": ["+amx-tile", "+amx-bf16"]})
    with isa.compiling_for(machine_for(amx)):
        assert conv_plan.issue_costs() == conv_plan.TWO_FMA_PIPES
        intel = conv_plan.choose_plan(_square_geo(96, 54, 256, 5, 2, 0), F32)
    with _compiling_for("rocketlake"):
        assert conv_plan.issue_costs() == conv_plan.ONE_FMA_PIPE
    assert intel.v > 1 and intel.j < 16, intel


@pytest.mark.parametrize("c, size, k", [(128, 14, 160), (160, 14, 192), (96, 14, 128), (64, 14, 96)])
def test_zen5_never_runs_a_conv_on_half_width_vectors(c, size, k):
    """Zen 4's 512-bit FMA is two 256-bit halves, so its model picks 3x7-like blocks of
    256-bit vectors for small 3x3 maps (Inception v2's 14x14 layers: 5x5 of 8 lanes); Zen
    5's pipes are 512 bits wide and those blocks ran at half its rate (the mix loop: 0.46-
    0.51 of the FMA loop). On Zen 5 (:data:`conv_plan.WIDE_FMA_PIPES`) they get full vectors."""
    g = _square_geo(c, size, k, 3, 1)
    with _compiling_for("znver4"):
        assert conv_plan.choose_plan(g, F32).lanes == 8
    with _compiling_for("znver5"):
        assert conv_plan.issue_costs() == conv_plan.WIDE_FMA_PIPES
        assert conv_plan.choose_plan(g, F32).lanes == 16
        assert conv_plan.issue_costs().fmas(1, 256) == conv_plan.issue_costs().fmas(1, 512)
