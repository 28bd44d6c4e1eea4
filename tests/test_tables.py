"""Functions of one byte as tables (:mod:`jitbyoc.tvm.tables`) and the lookups they run on
(:class:`jitbyoc.ir.kir.Lookup`: a take from a 1-D table as an elementwise value):
against TVM's build of the same graph, bit for bit, with every byte value in the input;
the lookup itself against numpy on every target kind (``vpermi2b`` on AVX512_VBMI,
``vpermps`` for tables of up to 16 words, one load per lane elsewhere), in loops, in a
product's epilogue, and as C."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.kernels.matmul import MatMul
from jitbyoc.render import isa
from jitbyoc.tvm.prepare import prepare
from jitbyoc.tvm.target import machine_for
from tests.conftest import assert_bits_equal, build_both, build_model, call_region, run
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit

R = relax.op
F32 = "float32"
QDQ = frozenset({"relax.quantize", "relax.dequantize"})
# an Intel CPU name whose features Zen 4 and 5 and Sapphire Rapids all have (znver4 code
# needs SSE4A, which Intel CPUs lack): the tests run what they build on any of them
VBMI_CPU, SKYLAKE, HASWELL = ({"kind": "llvm", "mcpu": cpu} for cpu in ("icelake-server", "skylake-avx512", "haswell"))


def _q(v, scale, zp, dt="uint8"):
    return R.quantize(v, relax.const(scale, F32), relax.const(zp, dt), axis=-1, out_dtype=dt)


def _dq(v, scale, zp, dt="uint8"):
    return R.dequantize(v, relax.const(scale, F32), relax.const(zp, dt), axis=-1, out_dtype=F32)


def gelu_qdq(dt: str, shape=(3, 7, 40)):
    """GELU as onnxruntime's quantizer leaves ``torch.onnx.export``'s Div, Erf, Add, Mul,
    Mul: each op's result quantized and dequantized again."""
    zp = 0 if dt == "int8" else 128

    def body(bb, x):
        d = bb.emit(_dq(x, 0.05, zp, dt))
        a = bb.emit(_q(R.divide(d, relax.const(1.4142135, F32)), 0.04, zp, dt))
        e = bb.emit(_q(R.erf(bb.emit(_dq(a, 0.04, zp, dt))), 0.008, zp, dt))
        p = bb.emit(_q(R.add(bb.emit(_dq(e, 0.008, zp, dt)), relax.const(1.0, F32)), 0.008, zp // 2, dt))
        m = bb.emit(_q(R.multiply(d, bb.emit(_dq(p, 0.008, zp // 2, dt))), 0.06, zp, dt))
        return bb.emit(_q(R.multiply(bb.emit(_dq(m, 0.06, zp, dt)), relax.const(0.5, F32)), 0.03, zp, dt))

    return build_model({"x": (shape, dt)}, body)


def every_byte(dt: str, shape, seed: int = 0) -> np.ndarray:
    info = np.iinfo(dt)
    values = np.arange(info.min, info.max + 1).astype(dt)
    rest = np.random.default_rng(seed).integers(info.min, info.max + 1, int(np.prod(shape)) - 256).astype(dt)
    return np.concatenate([values, rest]).reshape(shape)


def _calls(mod) -> list[str]:
    """The ops of ``mod``'s main that make tensors of more than 256 elements (a tuple's
    first: a batch norm's)."""
    def first(ty):
        return ty.fields[0] if isinstance(ty, relax.TupleType) else ty

    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")
            and np.prod([int(d) for d in first(b.var.ty).shape.values]) > 256]


@pytest.mark.parametrize("dt", ["uint8", "int8"])
def test_a_byte_chain_is_one_table_bit_for_bit_with_tvm(dt):
    mod = gelu_qdq(dt)
    calls = _calls(prepare(mod, QDQ))
    # the chain runs on the 256 bytes; the full-size tensor is looked up once
    shift = ["relax.subtract"] if dt == "int8" else []
    assert calls == ["relax.astype", *shift, "relax.take"], calls
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    x = every_byte(dt, (3, 7, 40))
    assert np.array_equal(run(builds.jit, x), run(builds.tvm, x))


def _bias_add_then_relu(bb, x):
    """The chain reads a per-channel constant: the result is no function of the byte alone."""
    bias = relax.const(np.linspace(-1, 1, 40).astype(F32))
    d = bb.emit(R.add(bb.emit(_dq(x, 0.05, 128)), bias))
    return bb.emit(_q(R.nn.relu(bb.emit(_dq(bb.emit(_q(R.erf(d), 0.01, 128)), 0.01, 128))), 0.01, 0))


@pytest.mark.parametrize("body, why", [
    (_bias_add_then_relu, "a per-channel operand"),
    (lambda bb, x: bb.emit(_q(R.nn.relu(bb.emit(_dq(x, 0.05, 128))), 0.02, 0)), "one cheap op"),
    (lambda bb, x: bb.emit(_q(R.multiply(bb.emit(_dq(x, 0.05, 128)), bb.emit(_dq(R.flip(x, 1), 0.05, 128))),
                              0.1, 0)), "two byte tensors"),
])
def test_what_is_no_function_of_one_byte_stays_arithmetic(body, why):
    mod = build_model({"x": ((2, 40), "uint8")}, body)
    assert "relax.take" not in _calls(prepare(mod, QDQ)), why
    builds = build_both(mod)
    x = every_byte("uint8", (2, 200))[:, :40]
    assert np.array_equal(run(builds.jit, x), run(builds.tvm, x))


def _lookup_model(table: np.ndarray, shape, mode: str, index_dtype: str = "int32"):
    return build_model({"i": (shape, index_dtype)},
                       lambda bb, i: bb.emit(R.take(relax.const(table), i, axis=0, mode=mode)))


def _looked_up(mod, target, table: np.ndarray, index: np.ndarray, mode: str) -> None:
    """Assert jitbyoc's build of ``mod`` (a take of ``table``) for ``target`` gives numpy's
    lookup of ``index`` in ``mode``: clamped (and from -n counted from the end, "fast"), or
    wrapped Python-style ("wrap")."""
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(target)), tvm.cpu()), index)
    n, wide = len(table), index.astype(np.int64)
    if mode == "fast":
        wide = np.where(wide < 0, wide + n, wide)
    assert np.array_equal(got, table[np.mod(wide, n) if mode == "wrap" else np.clip(wide, 0, n - 1)])


@pytest.mark.parametrize("target", [VBMI_CPU, SKYLAKE, HASWELL], ids=["vbmi", "avx512", "avx2"])
@pytest.mark.parametrize("table, mode", [
    (np.arange(256)[::-1].astype("uint8"), "clip"),
    (np.random.default_rng(1).integers(-128, 128, 256).astype("int8"), "fast"),
    (np.linspace(-3, 3, 37).astype(F32), "fast"),
    (np.arange(5, dtype="int64") * 7, "clip"),
    (np.linspace(-8, 7, 16).astype(F32), "wrap"),  # int4's nibble values (jitbyoc.quantize_weights)
    (np.linspace(-8, 7, 16).astype(F32), "clip"),
    (np.arange(8, dtype="int32") * -3, "wrap"),
    (np.arange(11, dtype="int32") * 5, "fast"),
])
def test_a_1d_take_is_an_elementwise_lookup(target, table, mode):
    """Out-of-range indices clamp (and from -n count from the end, in mode "fast"), as
    :class:`~jitbyoc.kernels.slicing.Take` does, or wrap (mode "wrap", a table of 2^k: a
    mask); 1-D tables take no stage of their own. A table of up to 16 32-bit words is
    looked up by register permutes (AVX-512: one per vector; AVX2: two and a blend)."""
    n, shape = len(table), (5, 67)
    index = np.random.default_rng(n).integers(-n - 3, n + 3, shape).astype("int32")
    mod = _lookup_model(table, shape, mode)
    with isa.compiling_for(machine_for(tvm.target.Target(target))):
        (region,) = jitbyoc.inspect(mod)
        asm = region.asm
    assert not any(type(s).__name__ == "Take" for s in region.kernel.stages)
    permutes = len(re.findall(r"vperm[it]2b", asm))
    assert (permutes > 0) == (target is VBMI_CPU and table.dtype.itemsize == 1 and n == 256), permutes
    if table.dtype.itemsize == 4 and n <= 16:
        assert re.search(r"vperm(d|ps)\s", asm)
    assert ("zmm" in asm) == (target is not HASWELL)
    _looked_up(mod, target, table, index, mode)


@pytest.mark.parametrize("target", [SKYLAKE, HASWELL], ids=["avx512", "avx2"])
@pytest.mark.parametrize("index_dtype", ["int8", "uint8", "int16", "int64"])
@pytest.mark.parametrize("n, mode", [(16, "wrap"), (16, "clip"), (5, "clip")])
def test_a_table_of_words_takes_indices_of_any_width(target, index_dtype, n, mode):
    """A table of up to 16 words looked up by vectors of 8 to 64 indices (the fused
    loop's vector holds 64 bytes of the index): register permutes, lane for lane."""
    table, shape = (np.arange(n) * 3 - 7).astype(F32), (5, 67)
    info = np.iinfo(index_dtype)
    index = np.random.default_rng(n).integers(max(info.min, -40), min(info.max, 300), shape).astype(index_dtype)
    _looked_up(_lookup_model(table, shape, mode, index_dtype), target, table, index, mode)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 16), table_dtype=st.sampled_from([F32, "int32"]),
       index_dtype=st.sampled_from(["int8", "uint8", "int16", "int32", "int64"]),
       shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), mode=st.sampled_from(["clip", "fast", "wrap"]),
       target=st.sampled_from([SKYLAKE, HASWELL]), seed=st.integers(0, 2 ** 16))
def test_random_lookups_in_small_tables(n, table_dtype, index_dtype, shape, mode, target, seed):
    """Random tables of 1 to 16 words, indices of any integer width (out of range too),
    shapes and modes: numpy's take, on AVX-512 and AVX2."""
    rng = np.random.default_rng(seed)
    table = rng.integers(-1000, 1000, n).astype(table_dtype)
    info = np.iinfo(index_dtype)
    index = rng.integers(max(info.min, -3 * n - 5), min(info.max, 3 * n + 5) + 1, shape).astype(index_dtype)
    _looked_up(_lookup_model(table, tuple(shape), mode, index_dtype), target, table, index, mode)


def test_a_lookup_runs_in_a_products_epilogue():
    """A float product whose result indexes a table of floats: the lookup is the
    product's epilogue, applied to each block of the result (no loop of its own)."""
    table = np.linspace(0, 1, 256).astype(F32) ** 2
    mod = build_model({"x": ((33, 20), F32), "w": ((20, 50), F32)}, lambda bb, x, w: bb.emit(R.take(
        relax.const(table), bb.emit(R.astype(R.clip(bb.emit(R.matmul(x, w)), 0, 255), "int32")), axis=0,
        mode="clip")))
    (region,) = jitbyoc.inspect(mod)
    (product,) = [s for s in region.kernel.stages if isinstance(s, MatMul)]
    assert any(isinstance(n, kir.Lookup) for n in kir.walk([product.epilogue]))
    rng = np.random.default_rng(0)
    x, w = rng.uniform(0, 16, (33, 20)).astype(F32), rng.uniform(0, 1, (20, 50)).astype(F32)
    builds = build_both(mod)
    assert np.array_equal(run(builds.jit, x, w), run(builds.tvm, x, w))


def test_a_lookup_is_not_hoisted_as_a_broadcast():
    """A lookup varies as its index does: ``sigmoid(table[i])`` over the whole tensor is
    computed per element, not once per broadcast row (jitbyoc.ir.hoist)."""
    table = np.linspace(-4, 4, 16).astype(F32)
    mod = build_model({"i": ((6, 9), "int32"), "b": ((1, 9), F32)}, lambda bb, i, b: bb.emit(R.add(
        R.sigmoid(bb.emit(R.take(relax.const(table), i, axis=0, mode="clip"))), R.sigmoid(b))))
    rng = np.random.default_rng(0)
    i, b = rng.integers(0, 16, (6, 9)).astype("int32"), rng.standard_normal((1, 9)).astype(F32)
    builds = build_both(mod)
    assert np.allclose(run(builds.jit, i, b), run(builds.tvm, i, b), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_c_rendering_looks_up_as_the_jit_does(tmp_path):
    """In a loop of its own (bytes in a byte table) and in a product's epilogue (floats)."""
    mod = build_model({"t": ((256,), "uint8"), "x": ((4, 96), "uint8"), "f": ((256,), F32),
                       "a": ((9, 20), F32), "w": ((20, 30), F32)},
                      lambda bb, t, x, f, a, w: [
                          bb.emit(R.take(t, bb.emit(R.astype(x, "int32")), axis=0, mode="clip")),
                          bb.emit(R.take(f, bb.emit(R.astype(R.clip(bb.emit(R.matmul(a, w)), 0, 255), "int32")),
                                         axis=0, mode="fast"))])
    rng = np.random.default_rng(0)
    arrays = {"t": rng.integers(0, 256, 256).astype("uint8"), "x": every_byte("uint8", (4, 96)),
              "f": rng.standard_normal(256).astype(F32), "a": rng.uniform(0, 16, (9, 20)).astype(F32),
              "w": rng.uniform(0, 1, (20, 30)).astype(F32)}
    for region in jitbyoc.inspect(mod):
        assert all(type(s).__name__ != "Take" for s in region.kernel.stages)
        c_fn, jit_fn = c_and_jit(region, tmp_path)
        ins = [arrays[n] for n in region.arg_names[:len(region.kernel.inputs)]]
        for got, want in zip(call_region(c_fn, region.kernel, ins), call_region(jit_fn, region.kernel, ins)):
            assert_bits_equal(got, want, f"{region.symbol}: C vs JIT")
