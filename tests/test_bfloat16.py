"""bfloat16: conversions bit for bit against TVM's build and ml_dtypes; products of
bfloat16 operands summed in float32 (the GEMM engine's ``vdpbf16ps`` kernel, and its
two-FMA form on machines without AVX512_BF16) against numpy's float64 product of the same
rounded operands, within float32 summation's bound; :func:`jitbyoc.lower_precision`
against TVM's build of the same lowered module, and against the float32 model within
bfloat16's rounding bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import jitbyoc
from jitbyoc.kernels.conv_weight_units import pack
from jitbyoc.kernels.layout import Permute
from jitbyoc.kernels.matmul import MatMul
from jitbyoc.kernels.slicing import Slice
from jitbyoc.engines.gemm import panel_width
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_both, build_model, call_region, jit_function
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit

R = relax.op
BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24  # float32's unit roundoff
# an Intel CPU name whose features Zen 4 and 5 and Sapphire Rapids all have (znver4 code
# needs SSE4A, which Intel CPUs lack): the tests run what they build on any of them that
# shows AVX512_BF16 (an Emerald Rapids under KVM hid it: there they build and do not run)
BF16_CPU, SKYLAKE, HASWELL = ({"kind": "llvm", "mcpu": cpu} for cpu in ("cooperlake", "skylake-avx512", "haswell"))
RUNS_BF16 = isa.host().has("avx512bf16")
NO_BF16_HERE = "this CPU has no AVX512_BF16 (or its VM hides it): vdpbf16ps code cannot run here"


def _special_values(rng) -> np.ndarray:
    x = (rng.standard_normal(4096) * np.float32(100)).astype(np.float32)
    snan = np.array([0x7F800001, 0xFFA00000], np.uint32).view(np.float32)  # signalling NaNs
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], np.float32)  # round to even
    tiny = np.array([1e-40, -1e-39, 1.2e-38, np.finfo(np.float32).tiny], np.float32)  # subnormals
    edge = np.array([*snan, np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, np.finfo(np.float32).max], np.float32)
    return np.concatenate([x, ties, tiny, edge]).reshape(1, -1)


def test_float32_to_bfloat16_and_back_bit_for_bit():
    rng = np.random.default_rng(0)
    x = _special_values(rng)
    mod = build_model({"x": (x.shape, "float32")}, lambda bb, x: [
        bb.emit(R.astype(x, "bfloat16")), bb.emit(R.astype(R.astype(x, "bfloat16"), "float32"))])
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    (ref_bf, ref_f), (got_bf, got_f) = builds.run(x)
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16)
    assert np.array_equal(got_bf.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert np.array_equal(got_bf.view(np.uint16)[~nan], ref_bf.view(np.uint16)[~nan])
    assert np.array_equal(got_f.view(np.uint32)[~nan], ref_f.view(np.uint32)[~nan])
    # a NaN stays a NaN of its sign, made quiet (as ml_dtypes); TVM's rounding turns the
    # signalling NaN 0x7f800001 into infinity
    bits = got_bf.view(np.uint16)[nan]
    assert np.isnan(got_bf[nan].astype(np.float32)).all() and (bits & 0x40).all()
    assert np.array_equal(bits >> 15, x.view(np.uint32)[nan] >> 31)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_conversions_matches_jit_bit_for_bit(tmp_path):
    x = _special_values(np.random.default_rng(1))
    mod = build_model({"x": (x.shape, "float32")},
                      lambda bb, x: bb.emit(R.astype(R.astype(x, "bfloat16"), "float32")))
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    (got,), (want,) = call_region(c_fn, region.kernel, [x]), call_region(jit_fn, region.kernel, [x])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _product_model(m, k, n, batch=()):
    """``matmul(astype(x, bf16), astype(w, bf16), out_dtype=float32)`` of float32 inputs."""
    return build_model({"x": ((*batch, m, k), "float32"), "w": ((*batch, k, n), "float32")},
                       lambda bb, x, w: bb.emit(R.matmul(R.astype(x, "bfloat16"), R.astype(w, "bfloat16"),
                                                         out_dtype="float32")))


def _check_summed_in_float32(got, x, w):
    """``got`` is the float32 sum of the exact products of ``x``'s and ``w``'s bfloat16
    roundings, in some order: within ``gamma_K`` of float64's sum of them. Unrounded
    operands miss the bound by far (their difference is of bfloat16's 2**-9)."""
    a, b = (v.astype(BF16).astype(np.float64) for v in (x, w))
    k = x.shape[-1]
    bound = k * U / (1 - k * U) * (np.abs(a) @ np.abs(b)) + 1e-30
    err = np.abs(got - a @ b)
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound.flat[err.argmax()]:.3g}"


def _build_for(mod, target: dict):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=tvm.target.Target(target))
        rep = jitbyoc.last_report()
    return relax.VirtualMachine(ex, tvm.cpu()), rep


@pytest.mark.parametrize("target", [pytest.param(BF16_CPU, marks=pytest.mark.skipif(not RUNS_BF16, reason=NO_BF16_HERE)),
                                    SKYLAKE, HASWELL], ids=["avx512bf16", "avx512", "avx2"])
@pytest.mark.parametrize("m, k, n, batch", [(1, 7, 3, ()), (13, 33, 70, ()), (130, 771, 200, ()),
                                            (64, 256, 128, ()), (5, 40, 17, (3,)), (200, 65, 30, ())])
def test_product_of_bfloat16_operands_is_summed_in_float32(target, m, k, n, batch):
    """Every tile and edge of the engine (odd K: a half-filled last pair; M > N: B packed
    once before the product, gemm_units.packed_once), on the machines
    with ``vdpbf16ps``, with AVX-512 but no BF16, and with AVX2 only."""
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((*batch, m, k)).astype(np.float32)
    w = rng.standard_normal((*batch, k, n)).astype(np.float32)
    vm, rep = _build_for(_product_model(m, k, n, batch), target)
    assert not rep.fallbacks, rep
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    _check_summed_in_float32(got, x, w)


def _linear_model(m, k, n, rng):
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(k ** -0.5)
    bias = rng.standard_normal(n).astype(np.float32)
    return build_model({"x": ((m, k), "float32")}, lambda bb, x: bb.emit(
        R.nn.gelu(R.add(R.matmul(x, R.permute_dims(relax.const(w))), relax.const(bias))))), w, bias


@pytest.mark.parametrize("m, k, n", [(128, 768, 192), (6, 64, 64), (37, 130, 70), (2, 33, 64), (1, 96, 100),
                                     (1, 64, 1000)])
def test_lower_precision_of_a_linear_layer(m, k, n):
    """torch's ``gelu(x @ W.T + b)`` in bf16: against TVM's build of the same lowered
    module (the products' summation order apart) and the float32 model (bfloat16's
    rounding apart); the weight is packed once at build time and read in place, one row
    (a classifier) and a last panel padded with zero columns included."""
    rng = np.random.default_rng(k)
    mod, w, bias = _linear_model(m, k, n, rng)
    low = jitbyoc.lower_precision(mod, "bf16")
    builds = build_both(low)
    assert not builds.report.fallbacks, builds.report
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref, got = builds.run(x)
    a, b = x.astype(BF16).astype(np.float64), w.T.astype(BF16).astype(np.float64)
    summed = 2 * k * U / (1 - k * U) * (np.abs(a) @ np.abs(b))  # two orders of float32 sums
    assert (np.abs(got - ref) <= 1.2 * summed + 4 * U * np.abs(ref) + 1e-6).all()  # gelu: Lipschitz 1.13
    exact = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert (np.abs(got - build_both(mod).run(x)[0]) <= 1.2 * (2 ** -8 + 2 ** -17) * exact + 1.2 * summed + 1e-5).all()
    (region,) = jitbyoc.inspect(low)
    (product,) = [s for s in region.kernel.stages if isinstance(s, MatMul)]
    nr = panel_width("bfloat16")  # 64 columns on vdpbf16ps, 32 on AMX tiles
    assert product.panels == nr and product.inputs[1].shape == (-(-n // nr), k // 2, nr, 2) if k % 2 == 0 \
        else not product.panels
    if k % 2 == 0:  # the weight's permute and the slice of the padded panel folded away
        assert not [s for s in region.kernel.stages if isinstance(s, (Permute, Slice))], region.kernel.stages


def test_lower_precision_casts_an_operand_once():
    """Three products of one input (attention's Q, K and V; an Inception module's
    branches) read one bfloat16 copy of it, not three."""
    rng = np.random.default_rng(11)
    ws = [rng.standard_normal((64, 48)).astype(np.float32) for _ in range(3)]
    mod = build_model({"x": ((16, 64), "float32")},
                      lambda bb, x: [bb.emit(R.matmul(x, relax.const(w))) for w in ws])
    low = jitbyoc.lower_precision(mod, "bf16")
    assert low.script().count("R.astype(x,") == 1
    x = rng.standard_normal((16, 64)).astype(np.float32)
    builds = build_both(low)
    for got, want in zip(*reversed(builds.run(x))):
        k = 64
        bound = 2 * k * U / (1 - k * U) * k * np.abs(x).max() * max(np.abs(w).max() for w in ws)
        assert np.abs(got - want).max() <= bound


def test_lower_precision_leaves_what_it_does_not_lower():
    """float64 products and products of a vector stay as they are; an unknown precision
    is refused by name. (Products of two float32 activations, attention's, are lowered:
    tests/test_bfloat16_attention.py.)"""
    mod = build_model({"q": ((8,), "float32"), "k": ((8, 4), "float32"), "d": ((4, 8), "float64")},
                      lambda bb, q, k, d: [bb.emit(R.matmul(q, k)),
                                           bb.emit(R.matmul(d, relax.const(np.ones((8, 2)), "float64")))])
    assert tvm_ffi.structural_equal(jitbyoc.lower_precision(mod), mod)
    with pytest.raises(ValueError, match="'fp8'"):
        jitbyoc.lower_precision(mod, "fp8")


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_a_bfloat16_product(tmp_path):
    """The C rendering widens the operands exactly and sums in float32, in order."""
    m, k, n = 9, 35, 20
    (region,) = jitbyoc.inspect(_product_model(m, k, n))
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    for fn in (c_fn, jit_fn):
        (got,) = call_region(fn, region.kernel, [x, w])
        _check_summed_in_float32(got, x, w)
    assert jit_function(region) is not None


@pytest.mark.parametrize("shape, kernel, stride, groups", [
    ((1, 64, 14, 14), 1, 1, 1), ((2, 32, 9, 9), 1, 2, 1), ((1, 48, 8, 8), 1, 1, 2), ((1, 3, 32, 32), 4, 4, 1)])
def test_lower_precision_of_pointwise_and_patch_convolutions(shape, kernel, stride, groups):
    """1x1 (strided, grouped) and patch convolutions run as bfloat16 products; a 3x3 one
    stays float32 (with the reason, where a bf16 3x3 is built by hand)."""
    rng = np.random.default_rng(shape[1])
    w = rng.standard_normal((40, shape[1] // groups, kernel, kernel)).astype(np.float32)
    mod = build_model({"x": (shape, "float32")}, lambda bb, x: bb.emit(R.nn.relu(R.add(
        R.nn.conv2d(x, relax.const(w), strides=stride, groups=groups), relax.const(np.float32(0.5))))))
    low = jitbyoc.lower_precision(mod)
    assert "bfloat16" in low.script()
    builds = build_both(low)
    assert not builds.report.fallbacks, builds.report
    x = rng.standard_normal(shape).astype(np.float32)
    ref, got = builds.run(x)
    k = shape[1] // groups * kernel * kernel
    scale = np.abs(x).max() * np.abs(w).max() * k
    assert np.abs(got - ref).max() <= 2 * k * U * scale


def _conv_bound(x, w, groups):
    """Twice float32's summation bound for the convolution of the bfloat16 roundings."""
    a, b = (np.abs(v.astype(BF16).astype(np.float64)) for v in (x, w))
    k = w[0].size
    return 2 * k * U / (1 - k * U) * k * a.max() * b.max() + 1e-6


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "avx2"])
@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation, groups", [
    ((1, 16, 14, 14), 32, 3, 1, 1, 1, 1), ((2, 8, 15, 13), 12, 3, 2, 1, 1, 1), ((1, 12, 12, 12), 20, 3, 1, 2, 2, 2),
    ((1, 6, 17, 17), 8, 5, 3, 2, 1, 1), ((1, 10, 9, 9), 8, 3, 1, 0, 1, 2), ((1, 64, 9, 9), 64, 3, 1, 1, 1, 1),
    ((1, 96, 14, 14), 128, 3, 1, 1, 1, 1)])  # Zen 4's plan: 5x5 vectors of 8 lanes (ymm)
@pytest.mark.parametrize("weight", ["constant", "input"])
def test_direct_convolution_in_bfloat16_pairs(target, shape, k, kernel, stride, pad, dilation, groups, weight):
    """The pixel engine on channel pairs: a constant weight packed in pair blocks at build
    time, a weight given as an input packed on each call (odd channels per group: a
    zero channel), strides 1-3, dilation, groups; against TVM's build of the same graph."""
    rng = np.random.default_rng(shape[1] * k + kernel)
    w = rng.standard_normal((k, shape[1] // groups, kernel, kernel)).astype(np.float32)
    conv = dict(strides=stride, padding=pad, dilation=dilation, groups=groups)
    if weight == "constant":
        model = build_model({"x": (shape, "float32")}, lambda bb, x: bb.emit(
            R.nn.relu(R.nn.conv2d(x, relax.const(w), **conv))))
        mod, args = jitbyoc.lower_precision(model), []
    else:
        mod, args = build_model({"x": (shape, "float32"), "w": (w.shape, "float32")}, lambda bb, x, wv: bb.emit(
            R.nn.relu(R.nn.conv2d(R.astype(x, "bfloat16"), R.astype(wv, "bfloat16"), out_dtype="float32",
                                  **conv)))), [w]
    assert "bfloat16" in mod.script()
    x = rng.standard_normal(shape).astype(np.float32)
    ref = build_both(mod).run(x, *args)[0] if target is None else None
    vm, rep = _build_for(mod, target or {"kind": "llvm"})
    assert not rep.fallbacks, rep
    got = vm["main"](*(tvm.runtime.tensor(a) for a in (x, *args))).numpy()
    if ref is None:
        ref = build_both(mod).run(x, *args)[0]
    assert np.abs(got - ref).max() <= _conv_bound(x, w, groups)


@pytest.mark.parametrize("cpu, lanes, instruction", [
    ("cooperlake", 16, "zmm"), ("cooperlake", 8, "ymm"), ("znver4", 8, "ymm"), ("skylake-avx512", 8, None)])
def test_pairs_summed_by_vdpbf16ps_at_every_vector_width(cpu, lanes, instruction):
    """A step of bfloat16 pairs (multiply_units) is one ``vdpbf16ps`` on 16 float32 lanes
    and on 8 (the VL form: a pixel engine's half-width plan), where the target has
    AVX512_BF16; without it, two exact widening multiply-adds and no vdpbf16ps."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    from jitbyoc.engines.gemm_micro import multiply_units
    from jitbyoc.engines.products import PRODUCTS
    from jitbyoc.toolchain import jit

    machine = machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    with isa.compiling_for(machine):
        acc, units = ir.VectorType(ir.FloatType(), lanes), ir.VectorType(ir.IntType(32), lanes)
        module = ir.Module(name="step")
        module.triple = machine.triple
        fn = ir.Function(module, ir.FunctionType(acc, [acc, units, units]), "step")
        b = ir.IRBuilder(fn.append_basic_block())
        b.ret(multiply_units(b, PRODUCTS["bfloat16"], fn.args[1], fn.args[2], fn.args[0]))
        asm = jit.target_machine(machine).emit_assembly(llvm.parse_assembly(str(module)))
    dots = [line for line in asm.splitlines() if "vdpbf16ps" in line]
    assert (len(dots), all(instruction in d for d in dots)) == ((1, True) if instruction else (0, True))


@pytest.mark.parametrize("setting", ["4", "2", "0"])
@pytest.mark.parametrize("c, k, hw", [(64, 64, 56), (64, 96, 28), (96, 64, 27), (64, 64, 14), (128, 32, 56)])
def test_every_3x3_is_lowered_whatever_float32_would_run_it_by(monkeypatch, setting, c, k, hw):
    """A 3x3 stride-1 convolution runs in bf16 where float32 would run it by Winograd's
    tiles (56x56, 28x28, 27x27 with 64+ channels used to stay float32): in the VM's slow
    phases the transforms' passes ran up to 2.2x their quiet time, and bf16's direct
    engine was level in the quiet rounds and faster in the slow ones (the note in
    jitbyoc/tvm/precision.py). On Zen 4 and, with AMX, Sapphire Rapids."""
    monkeypatch.setenv("JITBYOC_WINOGRAD", setting)
    w = np.ones((k, c, 3, 3), np.float32)
    mod = build_model({"x": ((1, c, hw, hw), "float32")}, lambda bb, x: bb.emit(
        R.nn.conv2d(x, relax.const(w), padding=1)))
    for cpu in ("znver4", "sapphirerapids"):
        with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))):
            low = jitbyoc.lower_precision(mod)
            assert "bfloat16" in low.script(), (cpu, hw)
            (region,) = jitbyoc.inspect(low)
            assert not any(getattr(st, "winograd", False) for st in region.kernel.stages)


def test_lower_precision_keeps_convolutions_float32_where_bf16_is_slower():
    """Depthwise (a pair would be half zeros) stays float32; the 3-channel stem, measured
    faster in bf16, is lowered (precision._narrower_is_faster), and so is a 7x7 map,
    on channel vectors of bfloat16 pairs (jitbyoc.engines.conv_channels) or, with AMX, a
    product on tiles (ConvGeometry.columns), and a grouped 7x7 one."""
    depthwise = np.ones((32, 1, 3, 3), np.float32)
    small = np.ones((512, 512, 3, 3), np.float32)
    for target in (BF16_CPU, {"kind": "llvm", "mcpu": "sapphirerapids"}):
        with isa.compiling_for(machine_for(tvm.target.Target(target))):
            mod = build_model({"x": ((1, 32, 16, 16), "float32")}, lambda bb, x: bb.emit(
                R.nn.conv2d(x, relax.const(depthwise), padding=1, groups=32)))
            assert "bfloat16" not in jitbyoc.lower_precision(mod).script()
            mod = build_model({"y": ((1, 512, 7, 7), "float32")}, lambda bb, y: bb.emit(
                R.nn.conv2d(y, relax.const(small), padding=1)))
            assert "bfloat16" in jitbyoc.lower_precision(mod).script()
            stem = build_model({"x": ((1, 3, 32, 32), "float32")}, lambda bb, x: bb.emit(
                R.nn.conv2d(x, relax.const(np.ones((8, 3, 7, 7), np.float32)), strides=2, padding=3)))
            assert "bfloat16" in jitbyoc.lower_precision(stem).script()
            # RegNetY's 7x7 grouped conv: float32 runs it on channel vectors, bf16 still faster
            grouped = build_model({"z": ((1, 784, 7, 7), "float32")}, lambda bb, z: bb.emit(
                R.nn.conv2d(z, relax.const(np.ones((784, 16, 3, 3), np.float32)), padding=1, groups=49)))
            assert "bfloat16" in jitbyoc.lower_precision(grouped).script()


def test_profile_measures_bf16_regions_against_the_vdpbf16ps_peak():
    """A bf16 region's %peak divides by its own instruction's measured peak (the
    vdpbf16ps loop, or its two-FMA form), not by the float32 FMA loop's."""
    rng = np.random.default_rng(5)
    mod, _, _ = _linear_model(64, 128, 128, rng)
    with jitbyoc.enabled():
        ex = tvm.compile(jitbyoc.lower_precision(mod), target="llvm")
    prof = jitbyoc.profile(ex, rng.standard_normal((64, 128)).astype(np.float32), repeat=2, warmup=1)
    (row,) = [r for r in prof.rows if r.owner == "jitbyoc"]
    assert set(prof.product_peaks) == {"bfloat16"} and "bfloat16" in str(prof)
    assert row.peak_share == pytest.approx(row.gflops / prof.product_peaks["bfloat16"])


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_a_bfloat16_convolution_with_packed_weights(tmp_path):
    """The C nest reads the weight in its packed pair blocks, widening exactly (the pixel
    engine's packing: a machine without AMX, where the conv is no product on tiles; its
    pairs on vdpbf16ps, or on AVX-512 without it where this CPU cannot run vdpbf16ps)."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((12, 8, 3, 3)).astype(np.float32)
    with isa.compiling_for(machine_for(tvm.target.Target(BF16_CPU if RUNS_BF16 else SKYLAKE))):
        mod = jitbyoc.lower_precision(build_model({"x": ((1, 8, 10, 10), "float32")}, lambda bb, x: bb.emit(
            R.nn.conv2d(x, relax.const(w), padding=1))))
        (region,) = [r for r in jitbyoc.inspect(mod) if any(getattr(s, "packed", False) for s in r.kernel.stages)]
        (conv,) = [s for s in region.kernel.stages if getattr(s, "packed", False)]
        c_fn, jit_fn = c_and_jit(region, tmp_path)
    x = rng.standard_normal((1, 8, 10, 10)).astype(np.float32)
    packed = pack(w.astype(BF16), conv.plan.j, 2)
    args = [x if tuple(b.shape) == x.shape else packed for b in region.kernel.inputs]
    assert [tuple(a.shape) for a in args] == [tuple(b.shape) for b in region.kernel.inputs]
    (got,), (want,) = call_region(c_fn, region.kernel, args), call_region(jit_fn, region.kernel, args)
    assert np.abs(got - want).max() <= _conv_bound(x, w, 1)
