"""int8: uint8 x int8 products summed in int32 (the GEMM engine's ``vpdpbusd`` kernel,
and its widened form on machines without AVX512_VNNI) bit for bit against numpy and
TVM's build; quantized graphs (``dequantize`` before a float product, as TVM's ONNX
frontend imports QDQ models) against TVM's build of the same float graph, within one
output step (:mod:`jitbyoc.tvm.quantized`)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.engines.products import PRODUCTS
from jitbyoc.ir import kir
from jitbyoc.kernels.matmul import MatMul
from jitbyoc.tvm.prepare import prepare
from tests.conftest import build_both, build_model, call_region, jit_function
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit

R = relax.op
# an Intel CPU name whose features Zen 4 and 5, Sapphire Rapids and an Emerald Rapids
# under KVM that hides AVX512_BF16 all have (znver4 code needs SSE4A, which Intel CPUs
# lack; cooperlake's AVX512_BF16 was hidden): the tests run what they build on any of them
VNNI_CPU, SKYLAKE, HASWELL = ({"kind": "llvm", "mcpu": cpu} for cpu in ("cascadelake", "skylake-avx512", "haswell"))
TARGETS = pytest.mark.parametrize("target", [VNNI_CPU, SKYLAKE, HASWELL], ids=["vnni", "avx512", "avx2"])


def _ints(rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _build_for(mod, target: dict):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=tvm.target.Target(target))
        rep = jitbyoc.last_report()
    return relax.VirtualMachine(ex, tvm.cpu()), rep


@TARGETS
@pytest.mark.parametrize("a, b", [("uint8", "int8"), ("int8", "uint8")])
@pytest.mark.parametrize("m, k, n, batch", [(1, 7, 3, ()), (13, 33, 70, ()), (130, 771, 200, ()),
                                            (5, 40, 17, (3,)), (200, 64, 30, ())])
def test_int8_product_is_exact(target, a, b, m, k, n, batch):
    """Every tile and edge of the engine (K not a multiple of 4: a part-filled last quad;
    M > N: B packed once first), both operand orders (a convolution as weight @ pixels),
    with ``vpdpbusd``, with AVX-512 but no VNNI, and with AVX2 only."""
    rng = np.random.default_rng(m * 1000 + k)
    x, w = _ints(rng, (*batch, m, k), a), _ints(rng, (*batch, k, n), b)
    mod = build_model({"x": (x.shape, a), "w": (w.shape, b)},
                      lambda bb, x, w: bb.emit(R.matmul(x, w, out_dtype="int32")))
    vm, rep = _build_for(mod, target)
    assert not rep.fallbacks, rep
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    assert np.array_equal(got, MatMul.reference(x, w))


@pytest.mark.parametrize("m, n", [(32, 128), (1, 1000), (5, 70)])
def test_constant_int8_weight_is_packed_in_quads(m, n):
    """A constant weight is packed at build time, four k interleaved per column: for one
    row too (a classifier), and with N not a whole number of panels (the last padded with
    zero columns, read and dropped)."""
    w = _ints(np.random.default_rng(0), (256, n), "int8")
    mod = build_model({"x": ((m, 256), "uint8")},
                      lambda bb, x: bb.emit(R.matmul(x, relax.const(w), out_dtype="int32")))
    (region,) = jitbyoc.inspect(mod)
    (product,) = [s for s in region.kernel.stages if isinstance(s, MatMul)]
    assert product.panels and product.inputs[1].shape[-1] == PRODUCTS["uint8"].group
    assert product.inputs[1].shape[0] * product.panels >= n and len(region.kernel.stages) == 1
    x = _ints(np.random.default_rng(1), (m, 256), "uint8")
    builds = build_both(mod)
    assert np.array_equal(builds.run(x)[1], MatMul.reference(x, w))


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "avx2"])
@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation, groups", [
    ((1, 16, 14, 14), 32, 3, 1, 1, 1, 1), ((2, 8, 15, 13), 12, 3, 2, 1, 1, 1), ((1, 12, 12, 12), 20, 3, 1, 2, 2, 2),
    ((1, 6, 17, 17), 8, 5, 3, 2, 1, 1), ((1, 64, 14, 14), 40, 1, 1, 0, 1, 1), ((1, 3, 32, 32), 16, 7, 2, 3, 1, 1),
    ((1, 32, 8, 8), 32, 3, 1, 1, 1, 32), ((1, 16, 7, 7), 24, 3, 1, 1, 1, 1), ((1, 8, 9, 9), 8, 3, 1, 1, 2, 1)])
@pytest.mark.parametrize("weight", ["constant", "input"])
def test_int8_convolution_is_exact(target, shape, k, kernel, stride, pad, dilation, groups, weight):
    """Channel quads on the pixel engine (channel counts not a multiple of 4: zero
    channels), 1x1 as a product, depthwise, small maps gathered into columns (7x7 with
    padding, dilation, stride); a constant weight packed at build time, an input weight
    per call; against TVM's build (exact integers both)."""
    rng = np.random.default_rng(shape[1] * 7 + k)
    w = _ints(rng, (k, shape[1] // groups, kernel, kernel), "int8")
    x = _ints(rng, shape, "uint8")

    def conv(x, w):
        return R.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation, groups=groups, out_dtype="int32")
    if weight == "constant":
        mod, args = build_model({"x": (shape, "uint8")}, lambda bb, x: bb.emit(conv(x, relax.const(w)))), [x]
    else:
        mod, args = build_model({"x": (shape, "uint8"), "w": (w.shape, "int8")},
                                lambda bb, x, w: bb.emit(conv(x, w))), [x, w]
    vm, rep = _build_for(mod, target or {"kind": "llvm"})
    assert not rep.fallbacks, rep
    got = vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    ref = build_both(mod).run(*args)[0]
    assert np.array_equal(got, ref)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_an_int8_product(tmp_path):
    m, k, n = 9, 35, 20
    mod = build_model({"x": ((m, k), "uint8"), "w": ((k, n), "int8")},
                      lambda bb, x, w: bb.emit(R.matmul(x, w, out_dtype="int32")))
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    rng = np.random.default_rng(3)
    x, w = _ints(rng, (m, k), "uint8"), _ints(rng, (k, n), "int8")
    for fn in (c_fn, jit_fn):
        (got,) = call_region(fn, region.kernel, [x, w])
        assert np.array_equal(got, MatMul.reference(x, w))
    assert jit_function(region) is not None


# ---- quantized graphs ------------------------------------------------------------------------

def _q(bb, x, scale, zp, dtype):
    return bb.emit(R.quantize(x, relax.const(np.float32(scale)), relax.const(zp, dtype), axis=1, out_dtype=dtype))


def _weight(rng, shape, dtype, per_channel: bool, zero=0):
    """A quantized constant weight: ``(values, scale per output channel or one, zero point)``."""
    q = _ints(rng, shape, dtype)
    n = shape[0]
    scale = (rng.uniform(0.002, 0.01, n) if per_channel else np.array(0.005)).astype(np.float32)
    return q, scale, np.full(scale.shape, zero, dtype)


def _qdq_conv_model(act: str, wdt: str, zx: int, pad: int, per_channel: bool, wzero: int = 0):
    """quantize -> dequantize -> conv2d(dequantized constant weight) + bias -> relu ->
    quantize -> dequantize: one QDQ layer as TVM's ONNX frontend imports it."""
    rng = np.random.default_rng(abs(zx) + pad)
    wq, ws, wz = _weight(rng, (24, 12, 3, 3), wdt, per_channel, wzero)
    bias = rng.standard_normal(24).astype(np.float32) * np.float32(0.1)

    def body(bb, x):
        q = _q(bb, x, 0.02, zx, act)
        xf = bb.emit(R.dequantize(q, relax.const(np.float32(0.02)), relax.const(zx, act), axis=1))
        wf = bb.emit(R.dequantize(relax.const(wq), relax.const(ws), relax.const(wz), axis=0))
        y = bb.emit(R.nn.relu(R.add(R.nn.conv2d(xf, wf, padding=pad), relax.const(bias.reshape(1, 24, 1, 1)))))
        out = _q(bb, y, 0.03, 0, "uint8")
        return bb.emit(R.dequantize(out, relax.const(np.float32(0.03)), relax.const(0, "uint8"), axis=1))
    return build_model({"x": ((1, 12, 10, 10), "float32")}, body)


def _check_within_a_step(builds, x, step: float):
    ref, got = builds.run(x)
    steps = np.abs(got - ref) / step
    assert steps.max() <= 1 + 1e-3, f"{steps.max()} steps"
    assert (steps > 0.5).mean() < 0.02  # a few values across a rounding boundary, not more


def _int8_products(mod) -> list[str]:
    """The dtypes of the products in the module jitbyoc prepares from ``mod``."""
    text = prepare(mod, {"relax.dequantize", "relax.nn.conv2d", "relax.matmul"}).script()
    return [line for line in text.splitlines() if 'out_dtype="int32"' in line]


@pytest.mark.parametrize("act, wdt, zx, pad, per_channel", [
    ("uint8", "int8", 0, 1, True), ("uint8", "int8", 117, 1, True), ("int8", "int8", -5, 1, False),
    ("uint8", "uint8", 3, 0, False)])
def test_quantized_convolution_runs_on_int8(act, wdt, zx, pad, per_channel):
    """uint8 and int8 activations (shifted to uint8), a nonzero activation zero point
    under padding (the input padded with it), int8 and uint8 weights (shifted to int8),
    per-channel and per-tensor scales: int8 convolutions, within one output step of
    TVM's build of the float graph."""
    mod = _qdq_conv_model(act, wdt, zx, pad, per_channel, wzero=128 if wdt == "uint8" else 0)
    assert _int8_products(mod)
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    x = np.random.default_rng(1).standard_normal((1, 12, 10, 10)).astype(np.float32)
    _check_within_a_step(builds, x, 0.03)


def test_quantized_product_with_a_weight_zero_point_stays_float():
    """A weight zero point that stays nonzero as int8 would need row sums of the
    activations too: that product stays float, as the graph says, and still builds."""
    mod = _qdq_conv_model("uint8", "int8", 0, 1, False, wzero=3)
    assert not _int8_products(mod)
    builds = build_both(mod)
    x = np.random.default_rng(2).standard_normal((1, 12, 10, 10)).astype(np.float32)
    ref, got = builds.run(x)
    assert np.abs(got - ref).max() <= 0.03 + 1e-6


def _qdq_linear_model(transposed: bool, k: int = 96, n: int = 80):
    """quantize -> dequantize -> matmul(dequantized constant W) -> quantize ->
    dequantize of a (2, 7, k) input, W as (K, N) or torch's transposed (N, K)."""
    rng = np.random.default_rng(int(transposed))
    wq = _ints(rng, (n, k) if transposed else (k, n), "int8")
    ws = rng.uniform(0.002, 0.01, n).astype(np.float32)

    def body(bb, x):
        q = _q(bb, x, 0.05, 128, "uint8")
        xf = bb.emit(R.dequantize(q, relax.const(np.float32(0.05)), relax.const(128, "uint8"), axis=-1))
        wf = bb.emit(R.dequantize(relax.const(wq), relax.const(ws), relax.const(np.zeros(n, np.int8)),
                                  axis=0 if transposed else 1))
        y = bb.emit(R.matmul(xf, R.permute_dims(wf) if transposed else wf))
        out = _q(bb, y, 0.1, 128, "uint8")
        return bb.emit(R.dequantize(out, relax.const(np.float32(0.1)), relax.const(128, "uint8"), axis=-1))
    return build_model({"x": ((2, 7, k), "float32")}, body)


@pytest.mark.parametrize("transposed", [False, True])
def test_quantized_linear_layer_runs_on_int8(transposed):
    """``matmul(dequantize(x), dequantize(W))`` of a (batch, seq, hidden) input, W as
    (K, N) or torch's transposed (N, K): an int8 product with its weight packed."""
    mod = _qdq_linear_model(transposed)
    assert _int8_products(mod)
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    x = np.random.default_rng(int(transposed)).standard_normal((2, 7, 96)).astype(np.float32)
    _check_within_a_step(builds, x, 0.1)


def _epilogue_roundings(mod) -> list[str]:
    """The quantize rows in the epilogues of the product stages jitbyoc lowers ``mod`` to."""
    return [n.op for region in jitbyoc.inspect(mod) for stage in region.kernel.stages
            if isinstance(stage, kir.KernelStage)
            for _, root in stage.epilogue_stores() for n in kir.walk([root])
            if isinstance(n, kir.Op) and n.op.startswith("round_")]


@pytest.mark.parametrize("model", [lambda: _qdq_conv_model("uint8", "int8", 0, 1, True),
                                   lambda: _qdq_linear_model(True)], ids=["conv2d", "matmul"])
def test_a_requantization_after_a_quantized_product_rounds_by_the_reciprocal(model):
    """A QDQ layer's int8 product stands for a float sum TVM takes in another order, so
    the requantization in its epilogue rounds ``x * (1 / s)`` without the exactness test
    (``round_clamped_product``, within the step the sums' order already allows)."""
    assert _epilogue_roundings(model()) == ["round_clamped_product"]


def test_a_requantization_after_an_integer_product_of_the_graph_stays_exact():
    """An int32 product the graph itself computes (exact in TVM's build too) keeps the
    exactly rounded quotient: its requantization equals TVM's bit for bit."""
    rng = np.random.default_rng(0)
    w = _ints(rng, (16, 8, 3, 3), "int8")
    scale = rng.uniform(1e-4, 4e-4, (1, 16, 1, 1)).astype(np.float32)

    def body(bb, x):
        acc = bb.emit(R.nn.conv2d(x, relax.const(w), padding=1, out_dtype="int32"))
        return _q(bb, bb.emit(R.multiply(R.astype(acc, "float32"), relax.const(scale))), 0.05, 3, "uint8")
    mod = build_model({"x": ((1, 8, 12, 11), "uint8")}, body)
    assert _epilogue_roundings(mod) == ["round_clamped_quotient"]
    ref, got = build_both(mod).run(_ints(rng, (1, 8, 12, 11), "uint8"))
    assert np.array_equal(ref, got)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_a_gathered_int8_convolution(tmp_path):
    """The C nest of a convolution the LLVM rendering gathers into columns first."""
    rng = np.random.default_rng(5)
    w = _ints(rng, (8, 12, 3, 3), "int8")
    mod = build_model({"x": ((1, 12, 9, 9), "uint8"), "w": (w.shape, "int8")}, lambda bb, x, w: bb.emit(
        R.nn.conv2d(x, w, strides=2, padding=1, out_dtype="int32")))
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    x = _ints(rng, (1, 12, 9, 9), "uint8")
    ref = build_both(mod).run(x, w)[0]
    for fn in (c_fn, jit_fn):
        (got,) = call_region(fn, region.kernel, [x, w])
        assert np.array_equal(got, ref)


def test_requantized_pooling_reshape_and_concat_move_the_integers():
    """``quantize(f(dequantize(q)))`` with one set of parameters is ``f(q)`` for max
    pooling, reshape and concat: exactly TVM's result of the float graph, with no float
    tensor left between; a requantization to other parameters stays float."""
    s, z = np.float32(0.04), 7

    def body(bb, a, b):
        qa, qb = (_q(bb, v, s, z, "uint8") for v in (a, b))
        fa, fb = (bb.emit(R.dequantize(q, relax.const(s), relax.const(z, "uint8"), axis=1)) for q in (qa, qb))
        pooled = _q(bb, bb.emit(R.nn.max_pool2d(fa, pool_size=3, strides=2, padding=1)), s, z, "uint8")
        pooled = bb.emit(R.dequantize(pooled, relax.const(s), relax.const(z, "uint8"), axis=1))
        joined = _q(bb, bb.emit(R.concat([pooled, fb], axis=1)), s, z, "uint8")
        back = bb.emit(R.dequantize(joined, relax.const(s), relax.const(z, "uint8"), axis=1))
        flat = _q(bb, bb.emit(R.reshape(back, (1, -1))), s, z, "uint8")
        other = _q(bb, bb.emit(R.nn.max_pool2d(fb, pool_size=2)), np.float32(0.05), 0, "uint8")  # new scale
        return [flat, other]
    mod = build_model({"a": ((1, 4, 10, 10), "float32"), "b": ((1, 3, 5, 5), "float32")}, body)
    text = prepare(mod, {"relax.dequantize", "relax.quantize"}).script()
    assert text.count("R.dequantize(") == 1  # only the one requantized to a new scale
    assert "R.nn.max_pool2d(lv, " in text and "R.concat((lv" in text
    builds = build_both(mod)
    rng = np.random.default_rng(4)
    args = rng.standard_normal((1, 4, 10, 10)).astype(np.float32), rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    for ref, got in zip(*builds.run(*args)):
        assert np.array_equal(ref, got)


@pytest.mark.parametrize("along", [None, 1, 0])
def test_lookup_in_a_dequantized_table_reads_the_quantized_one(along):
    """``take(dequantize(table), ids)`` gathers the int8 rows, then dequantizes them
    (BERT's embeddings): bit for bit TVM's result; a table scaled per gathered row
    (``along`` 0) is dequantized whole, as the graph says."""
    rng = np.random.default_rng(6)
    table = _ints(rng, (50, 8), "int8")
    count = 1 if along is None else table.shape[along]
    scale, zp = rng.uniform(0.01, 0.1, count).astype(np.float32), np.zeros(count, np.int8)

    def body(bb, ids):
        rows = bb.emit(R.dequantize(relax.const(table), relax.const(scale), relax.const(zp), axis=along or 0))
        return bb.emit(R.take(rows, ids, axis=0))
    mod = build_model({"ids": ((3, 5), "int64")}, body)
    text = prepare(mod, {"relax.dequantize", "relax.take"}).script()
    assert ("R.take(metadata" in text) == (along != 0)
    builds = build_both(mod)
    ids = rng.integers(0, 50, (3, 5))
    ref, got = builds.run(ids)
    assert np.array_equal(ref, got)


def test_quantize_and_dequantize_of_a_scalar():
    """A rank-0 tensor (BERT's attention scale, quantized) takes one scale and zero point."""
    def body(bb, x):
        q = bb.emit(R.quantize(x, relax.const(np.float32(0.1)), relax.const(3, "uint8"), axis=0, out_dtype="uint8"))
        return bb.emit(R.dequantize(q, relax.const(np.float32(0.1)), relax.const(3, "uint8"), axis=0))
    builds = build_both(build_model({"x": ((), "float32")}, body))
    assert not builds.report.fallbacks, builds.report
    for v in (0.349, -5.0, 100.0):
        ref, got = builds.run(np.float32(v))
        assert np.array_equal(ref, got)


@pytest.mark.parametrize("act, wdt, wzero", [("uint8", "int8", 0), ("int8", "int8", 0), ("uint8", "uint8", 128)])
def test_integer_matmul_of_dynamic_quantization_runs_on_int8(act, wdt, wzero):
    """MatMulInteger as TVM's ONNX frontend imports ``quantize_dynamic``'s graphs:
    ``matmul(astype(qa) - za, astype(W) - zw, out_dtype=int32)``, ``za`` computed per call;
    on the uint8 x int8 product, exactly TVM's integers."""
    rng = np.random.default_rng(7)
    k, n = 72, 40
    w = _ints(rng, (k, n), wdt)

    def wide(bb, v, zp):
        return bb.emit(R.subtract(bb.emit(R.astype(v, "int32")), bb.emit(R.astype(zp, "int32"))))

    def body(bb, x, za):  # DynamicQuantizeLinear's quantize, its zero point an input here
        q = bb.emit(R.quantize(x, relax.const(np.float32(0.03)), za, axis=0, out_dtype=act))
        a = wide(bb, q, za)
        b = wide(bb, relax.const(w), relax.const(wzero, wdt))
        return bb.emit(R.matmul(a, b, out_dtype="int32"))
    mod = build_model({"x": ((2, 5, k), "float32"), "za": ((), act)}, body)
    assert _int8_products(mod)
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    x, za = rng.standard_normal((2, 5, k)).astype(np.float32), np.array(rng.integers(0, 100), act)
    ref, got = builds.run(x, za)
    assert np.array_equal(ref, got)


@pytest.mark.parametrize("cpu, instruction", [("znver4", "vpdpbusd"), ("skylake-avx512", "vpmaddwd"),
                                              ("haswell", "vpmaddwd"), ("alderlake", "{vex}\tvpdpbusd")])
def test_the_int8_step_is_vpdpbusd_only_where_the_target_has_vnni(cpu, instruction):
    """The product's step (the peak loop's and the microkernel's multiply_units) is
    ``vpdpbusd`` on a VNNI target (AVX-VNNI's VEX form on ymm where the target has AVX2
    and AVX-VNNI only: Alder Lake); elsewhere the widened form, with no VNNI instruction a
    CPU without it would fault on (the exported library's CPU check names the rest): LLVM
    makes the four widened multiply-adds ``vpmaddwd``. The loop's operands are its own
    accumulators, so LLVM cannot fold it (it did, with constant operands)."""
    import llvmlite.binding as llvm

    from jitbyoc import peak
    from jitbyoc.render import isa
    from jitbyoc.toolchain import jit
    from jitbyoc.tvm.target import machine_for

    machine = machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    with isa.compiling_for(machine):
        asm = jit.target_machine(machine).emit_assembly(llvm.parse_assembly(peak._dot_ir("uint8")))
    assert instruction in asm
    assert ("vpdpbusd" in asm) == (cpu in ("znver4", "alderlake"))
