"""Functions of one byte and its channel as tables (:mod:`jitbyoc.tvm.channel_tables`): a
QDQ graph's batch norm between two quantizes becomes a lookup in 256 entries a channel,
bit for bit with TVM's build of the same graph on every byte of every channel; what does
not qualify stays arithmetic; and the lookup of a row (:attr:`jitbyoc.ir.kir.Lookup.rows`:
``vpermi2b`` on the row's 256 bytes where the row is one across a vector) against numpy,
rows in range or not, on every target kind."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.render import isa
from jitbyoc.tvm.prepare import prepare
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_both, build_model, call_region, run
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit
from tests.test_int8 import _ints
from tests.test_tables import HASWELL, QDQ, SKYLAKE, VBMI_CPU, _calls, _lookup_model, _looked_up

R = relax.op
F32 = "float32"


def _bytes_per_channel(dt: str, shape, seed: int = 0) -> np.ndarray:
    """An (N, C, H, W) input whose every channel holds each of the 256 byte values."""
    info = np.iinfo(dt)
    rng = np.random.default_rng(seed)
    x = rng.integers(info.min, info.max + 1, shape).astype(dt)
    x[0, :].reshape(shape[1], -1)[:, :256] = np.arange(info.min, info.max + 1).astype(dt)
    return x


def _const(v, dt=None):
    return relax.const(np.asarray(v, dtype=dt) if dt else v)


def _batch_norm_between_quantizes(dt: str, c: int, var=None, per_channel_out=False, seed=0):
    """``quantize(batch_norm(dequantize(x)))`` as onnxruntime leaves a BatchNormalization
    it did not fold: gamma and beta dequantized from int8 and int32 constants."""
    return build_model({"x": ((2, c, 16, 17), dt)},
                       lambda bb, x: _normed(bb, x, dt, c, var, per_channel_out, np.random.default_rng(seed)))


def _normed(bb, x, dt: str, c: int, var=None, per_channel_out=False, rng=None):
    """:func:`_batch_norm_between_quantizes`'s chain on ``x``, emitted."""
    zp = 0 if dt == "int8" else 128
    gamma, beta = _ints(rng, (c,), "int8"), rng.integers(-3000, 3000, c).astype(np.int32)
    mean = rng.standard_normal(c).astype(np.float32)
    var = rng.uniform(0.2, 3, c).astype(np.float32) if var is None else var
    out_scale = rng.uniform(0.01, 0.05, c).astype(np.float32) if per_channel_out else np.float32(0.03)
    out_zp = np.full(c, 7, "uint8") if per_channel_out else np.uint8(7)
    d = bb.emit(R.dequantize(x, _const(np.float32(0.04)), _const(zp, dt), axis=1))
    g = bb.emit(R.dequantize(_const(gamma), _const(np.float32(0.02)), _const(0, "int8")))
    b = bb.emit(R.dequantize(_const(beta), _const(np.float32(5e-4)), _const(0, "int32")))
    normed = bb.emit(R.nn.batch_norm(d, g, b, _const(mean), _const(var), axis=1, epsilon=1e-5, training=False))
    y = bb.emit(relax.TupleGetItem(normed, 0))
    return bb.emit(R.quantize(y, _const(out_scale), _const(out_zp), axis=1, out_dtype="uint8"))


@pytest.mark.parametrize("dt", ["uint8", "int8"])
@pytest.mark.parametrize("per_channel_out", [False, True])
def test_a_batch_norm_between_quantizes_is_one_table_bit_for_bit_with_tvm(dt, per_channel_out):
    mod = _batch_norm_between_quantizes(dt, 5, per_channel_out=per_channel_out)
    bits = ["relax.astype"] if dt == "int8" else []  # an int8 byte's index is its bits as uint8
    assert _calls(prepare(mod, QDQ)) == [*bits, "relax.astype", "relax.add", "relax.take"]
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    x = _bytes_per_channel(dt, (2, 5, 16, 17))
    ref, got = builds.run(x)
    assert np.array_equal(ref, got)


def test_tables_compose_down_a_chain_of_quantized_layers():
    """DenseNet-121's QDQ copy (Caffe's BatchNorm then Scale): batch norm, quantize, then
    a per-channel multiply and add, each quantized again: the first table is looked up
    by the next chain's, and the whole chain is one lookup of the first byte."""
    rng = np.random.default_rng(9)
    scale, shift = _ints(rng, (6, 1, 1), "int8"), _ints(rng, (6, 1, 1), "int8")

    def body(bb, x):
        q = _normed(bb, x, "uint8", 6, rng=rng)
        for k, (const, op) in enumerate(((scale, R.multiply), (shift, R.add))):
            c = bb.emit(R.dequantize(_const(const), _const(np.float32(0.05)), _const(0, "int8")))
            d = bb.emit(R.dequantize(q, _const(np.float32(0.03)), _const(np.uint8(7)), axis=1))
            q = bb.emit(R.quantize(bb.emit(op(d, c)), _const(np.float32(0.04 + k / 100)), _const(np.uint8(20)),
                                   axis=1, out_dtype="uint8"))
        return q
    mod = build_model({"x": ((2, 6, 16, 17), "uint8")}, body)
    assert _calls(prepare(mod, QDQ)) == ["relax.astype", "relax.add", "relax.take"]
    ref, got = build_both(mod).run(_bytes_per_channel("uint8", (2, 6, 16, 17)))
    assert np.array_equal(ref, got)


def test_a_chain_with_per_channel_operands_is_a_table():
    """A per-channel dequantize, a bias added and a division by a per-channel constant
    (broadcast as ``(C, 1, 1)``), then a per-tensor quantize."""
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((6, 1, 1)).astype(np.float32)
    divisor = rng.uniform(0.5, 2, (1, 6, 1, 1)).astype(np.float32)

    def body(bb, x):
        d = bb.emit(R.dequantize(x, _const(rng.uniform(0.01, 0.1, 6).astype(np.float32)),
                                 _const(np.full(6, 100, "uint8")), axis=1))
        y = bb.emit(R.divide(bb.emit(R.add(d, _const(bias))), _const(divisor)))
        return bb.emit(R.quantize(y, _const(np.float32(0.05)), _const(np.uint8(60)), axis=1, out_dtype="uint8"))
    mod = build_model({"x": ((1, 6, 20, 13), "uint8")}, body)
    assert "relax.take" in _calls(prepare(mod, QDQ))
    ref, got = build_both(mod).run(_bytes_per_channel("uint8", (1, 6, 20, 13)))
    assert np.array_equal(ref, got)


def _bias_on_the_last_axis(bb, x):
    d = bb.emit(R.dequantize(x, _const(np.float32(0.05)), _const(np.uint8(128))))
    y = bb.emit(R.divide(bb.emit(R.add(d, _const(np.linspace(-1, 1, 40).astype(np.float32)))), _const(np.float32(3))))
    return bb.emit(R.quantize(y, _const(np.float32(0.01)), _const(np.uint8(0)), out_dtype="uint8"))


@pytest.mark.parametrize("mod, why", [
    (build_model({"x": ((2, 3, 40), "uint8")}, _bias_on_the_last_axis), "channels along the vector"),
    (_batch_norm_between_quantizes("uint8", 4, var=np.array([1, -2, 1, 1], np.float32)), "a NaN for some byte"),
])
def test_what_does_not_qualify_stays_arithmetic(mod, why):
    assert "relax.take" not in _calls(prepare(mod, QDQ)), why
    shape = [int(d) for d in mod["main"].params[0].ty.shape.values]
    x = np.random.default_rng(1).integers(0, 256, shape).astype("uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


@pytest.mark.parametrize("target", [SKYLAKE, HASWELL], ids=["avx512", "avx2"])
def test_without_vbmi_the_chain_stays_arithmetic(target):
    """A lookup is a load per lane there, slower than the batch norm's arithmetic."""
    mod = _batch_norm_between_quantizes("uint8", 5)
    with isa.compiling_for(machine_for(tvm.target.Target(target))):
        assert "relax.take" not in _calls(prepare(mod, QDQ))
    with isa.compiling_for(machine_for(tvm.target.Target(VBMI_CPU))):
        assert "relax.take" in _calls(prepare(mod, QDQ))


@pytest.mark.parametrize("dt, zp", [("uint8", 3), ("int8", -3)])
def test_the_table_is_looked_up_in_a_convolutions_epilogue(dt, zp):
    """conv, quantize, dequantize, batch norm (gamma dequantized from int8, as
    onnxruntime's quantizer writes it), quantize: one region whose convolution looks the
    bytes up in its epilogue (a lookup by rows: an int8 byte by its bits as uint8),
    equal to TVM's build."""
    rng = np.random.default_rng(5)
    w, gamma = _ints(rng, (16, 8, 3, 3), "int8"), _ints(rng, (16,), "int8")
    mean, var = rng.standard_normal(16).astype(np.float32), rng.uniform(0.5, 2, 16).astype(np.float32)

    def body(bb, x):
        acc = bb.emit(R.nn.conv2d(x, relax.const(w), padding=1, out_dtype="int32"))
        y = bb.emit(R.multiply(R.astype(acc, F32), _const(np.float32(2e-4))))
        q = bb.emit(R.quantize(y, _const(np.float32(0.05)), _const(zp, dt), axis=1, out_dtype=dt))
        d = bb.emit(R.dequantize(q, _const(np.float32(0.05)), _const(zp, dt), axis=1))
        g = bb.emit(R.dequantize(_const(gamma), _const(np.float32(0.02)), _const(0, "int8")))
        normed = bb.emit(R.nn.batch_norm(d, g, _const(rng.standard_normal(16).astype(np.float32)),
                                         _const(mean), _const(var), axis=1, training=False))
        y2 = bb.emit(relax.TupleGetItem(normed, 0))
        return bb.emit(R.quantize(y2, _const(np.float32(0.03)), _const(np.uint8(9)), axis=1, out_dtype="uint8"))
    mod = build_model({"x": ((1, 8, 19, 21), "uint8")}, body)
    (region,) = jitbyoc.inspect(mod)
    (conv,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    lookups = [n for _, e in conv.epilogue_stores() for n in kir.walk([e]) if isinstance(n, kir.Lookup)]
    assert len(lookups) == 1 and lookups[0].rows, conv.epilogue_stores()
    x = _ints(rng, (1, 8, 19, 21), "uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


@pytest.mark.parametrize("target", [VBMI_CPU, SKYLAKE, HASWELL], ids=["vbmi", "avx512", "avx2"])
def test_a_lookup_by_rows_in_and_out_of_range(target):
    """``take(T, astype(x) + rows)``, ``rows`` one value a channel: at multiples of 256, at
    other offsets, past the table's end and below 0 (clamped as ``take`` clamps)."""
    n = 1024
    table = np.random.default_rng(2).integers(0, 256, n).astype("uint8")
    rows = np.array([0, 256, 768, 513, 900, -40, 3000], np.int32).reshape(1, 7, 1, 1)
    mod = build_model({"x": ((1, 7, 9, 37), "uint8")}, lambda bb, x: bb.emit(R.take(
        relax.const(table), bb.emit(R.add(bb.emit(R.astype(x, "int32")), relax.const(rows))), axis=0, mode="clip")))
    x = _bytes_per_channel("uint8", (1, 7, 9, 37))
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(target)), tvm.cpu()), x)
    assert np.array_equal(got, table[np.clip(x.astype(np.int64) + rows, 0, n - 1)])


def _step_cases():
    """(name, Relax call maker over (x, *params), x, params): each step the tables
    evaluate, on operands that reach rounding edges (quotients at half steps, tiny
    variances)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 6, 5, 7)).astype(np.float32) * 4
    x[0, :, 0, :6] = (np.arange(6) + 0.5) * np.float32(0.05)  # ties of the quantize below
    q8 = rng.integers(-128, 128, (2, 6, 5, 7)).astype(np.int8)
    ch = lambda lo, hi: rng.uniform(lo, hi, 6).astype(np.float32)  # noqa: E731
    return [
        ("batch_norm", lambda v, g, b, m, s: relax.TupleGetItem(R.nn.batch_norm(v, g, b, m, s, axis=1, epsilon=1e-5,
                                                                             training=False), 0),
         x, [ch(-2, 2), ch(-1, 1), ch(-1, 1), ch(1e-6, 1e-3)]),
        ("batch_norm without scale", lambda v, g, b, m, s: relax.TupleGetItem(R.nn.batch_norm(
            v, g, b, m, s, axis=1, epsilon=1e-3, scale=False, training=False), 0), x, [ch(1, 2), ch(-1, 1), ch(-1, 1), ch(0.5, 2)]),
        ("dequantize per channel", lambda v, s, z: R.dequantize(v, s, z, axis=1), q8, [ch(1e-3, 1), np.arange(6).astype(np.int8)]),
        ("dequantize int32", lambda v, s, z: R.dequantize(v, s, z), rng.integers(-2**30, 2**30, (3, 6, 4), dtype=np.int32),
         [np.float32(1e-7), np.int32(5)]),
        ("quantize", lambda v, s, z: R.quantize(v, s, z, out_dtype="uint8"), x, [np.float32(0.05), np.uint8(128)]),
        ("quantize per channel", lambda v, s, z: R.quantize(v, s, z, axis=1, out_dtype="int8"), x,
         [ch(0.01, 0.1), np.arange(-3, 3).astype(np.int8)]),
        ("divide", lambda v, d: R.divide(v, d), x, [ch(0.1, 3).reshape(6, 1, 1)]),
        ("relu", lambda v: R.nn.relu(v), x, []),
    ]


@pytest.mark.parametrize("case", _step_cases(), ids=lambda c: c[0])
def test_each_step_evaluates_as_tvm_computes_it(case):
    """The build-time evaluation of each step (:func:`channel_tables._apply`) against
    TVM's build of the op, bit for bit: the tables are the chain's bits only if every
    step's are."""
    from jitbyoc.tvm.channel_tables import _apply
    from tests.conftest import build_tvm

    _, make, x, params = case
    mod = build_model({"x": (x.shape, str(x.dtype))}, lambda bb, v: bb.emit(make(v, *map(_const, params))))
    want = run(build_tvm(mod), x)
    call = make(relax.Var("x", relax.TensorType(x.shape, str(x.dtype))), *map(_const, params))
    call = call.tuple_value if isinstance(call, relax.TupleGetItem) else call
    got = _apply(call, [x, *(np.asarray(p) for p in params)])
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_c_rendering_looks_rows_up_as_the_jit_does(tmp_path):
    mod = build_model({"t": ((1024,), "uint8"), "x": ((1, 7, 9, 37), "uint8"), "r": ((1, 7, 1, 1), "int32")},
                      lambda bb, t, x, r: bb.emit(R.take(t, bb.emit(R.add(bb.emit(R.astype(x, "int32")), r)),
                                                         axis=0, mode="clip")))
    arrays = {"t": np.random.default_rng(4).integers(0, 256, 1024).astype("uint8"),
              "x": _bytes_per_channel("uint8", (1, 7, 9, 37)),
              "r": np.array([0, 256, 768, 513, 900, -40, 3000], np.int32).reshape(1, 7, 1, 1)}
    want = arrays["t"][np.clip(arrays["x"].astype(np.int64) + arrays["r"], 0, 1023)]
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    ins = [arrays[n] for n in region.arg_names[:len(region.kernel.inputs)]]
    for fn in (c_fn, jit_fn):
        (got,) = call_region(fn, region.kernel, ins)
        assert np.array_equal(got, want)


def test_a_byte_cast_to_int8_is_no_row_index():
    """``astype(x, "int8") + rows`` wraps bytes of 128 and up below 0: the whole index
    is widened and clamped as ``take`` clamps it, no row read."""
    table = np.random.default_rng(6).integers(0, 256, 512).astype("uint8")
    rows = np.array([0, 50, 100], np.int8).reshape(1, 3, 1, 1)
    mod = build_model({"x": ((1, 3, 16, 16), "uint8")}, lambda bb, x: bb.emit(R.take(
        relax.const(table), bb.emit(R.add(bb.emit(R.astype(x, "int8")), relax.const(rows))), axis=0, mode="clip")))
    x = _bytes_per_channel("uint8", (1, 3, 16, 16))
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(VBMI_CPU)), tvm.cpu()), x)
    assert np.array_equal(got, table[np.clip(x.astype(np.int8) + rows, 0, 511)])


@pytest.mark.parametrize("mode", ["clip", "fast", "wrap"])
def test_int8_indices_into_a_table_longer_than_they_reach(mode):
    """The bounds of a table of 512 do not fit an int8 index: it is widened before it is
    clamped, wrapped or counted from the end (the bounds had wrapped to -1: every
    lookup read entry 0, or read before the table)."""
    table = np.random.default_rng(7).integers(0, 256, 512).astype("uint8")
    index = np.arange(-128, 128, dtype=np.int8).reshape(16, 16)
    _looked_up(_lookup_model(table, (16, 16), mode, "int8"), VBMI_CPU, table, index, mode)


@settings(max_examples=12, deadline=None)
@given(c=st.integers(1, 9), leaf=st.sampled_from(["uint8", "int8"]), out=st.sampled_from(["uint8", "int8"]),
       per_channel=st.booleans(), then=st.sampled_from([None, "add", "multiply", "divide"]),
       hw=st.tuples(st.integers(1, 9), st.integers(1, 40)), seed=st.integers(0, 2 ** 16))
def test_random_chains_of_a_channel_bit_for_bit_with_tvm(c, leaf, out, per_channel, then, hw, seed):
    """Random batch norms (gamma and beta dequantized from int8 and int32 as the QDQ
    graphs have them, variances down to 1e-6, scales and zero points per tensor or per
    channel), an optional per-channel op after, any byte types: TVM's bits."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(leaf)
    stats = [rng.uniform(-1, 1, c), 10.0 ** rng.uniform(-6, 1, c)]
    gamma, beta = _ints(rng, (c,), "int8"), rng.integers(-5000, 5000, c).astype(np.int32)
    scale = rng.uniform(1e-3, 0.2, c) if per_channel else rng.uniform(1e-3, 0.2)
    zp = rng.integers(np.iinfo(out).min, np.iinfo(out).max + 1, c if per_channel else ())

    def body(bb, x):
        d = bb.emit(R.dequantize(x, _const(np.float32(rng.uniform(1e-3, 0.1))),
                                 _const(rng.integers(info.min, info.max + 1), leaf), axis=1))
        g = bb.emit(R.dequantize(_const(gamma), _const(np.float32(rng.uniform(1e-3, 0.05))), _const(0, "int8")))
        b = bb.emit(R.dequantize(_const(beta), _const(np.float32(rng.uniform(1e-5, 1e-3))), _const(0, "int32")))
        normed = bb.emit(R.nn.batch_norm(d, g, b, *(_const(s.astype(np.float32)) for s in stats), axis=1,
                                         epsilon=float(rng.uniform(1e-6, 1e-3)), training=False))
        y = bb.emit(relax.TupleGetItem(normed, 0))
        if then:
            y = bb.emit(getattr(R, then)(y, _const(rng.uniform(0.5, 2, (c, 1, 1)).astype(np.float32))))
        return bb.emit(R.quantize(y, _const(np.float32(scale) if not per_channel else scale.astype(np.float32)),
                                  _const(np.asarray(zp).astype(out)), axis=1, out_dtype=out))
    shape = (1, c, hw[0], hw[1] + 256 // hw[0])
    mod = build_model({"x": (shape, leaf)}, body)
    with isa.compiling_for(machine_for(tvm.target.Target(VBMI_CPU))):
        assert "relax.take" in _calls(prepare(mod, QDQ))
    ref, got = build_both(mod).run(_bytes_per_channel(leaf, shape, seed))
    assert np.array_equal(ref, got)


def test_a_chain_goes_through_a_lookup_only_by_an_index_that_holds_bytes():
    """``take(T, astype(x, "int8") + c)`` wraps bytes of 128 and up: the chain after it
    takes the lookup's result as its byte, not ``x`` (whose table would read T unwrapped)."""
    table = np.random.default_rng(8).integers(0, 256, 512).astype("uint8")

    def body(bb, x):
        t = bb.emit(R.take(relax.const(table), bb.emit(R.add(bb.emit(R.astype(x, "int8")), _const(np.int8(100)))),
                           axis=0, mode="clip"))
        return _normed(bb, t, "uint8", 4, rng=np.random.default_rng(2))
    mod = build_model({"x": ((1, 4, 16, 16), "uint8")}, body)
    ref, got = build_both(mod).run(_bytes_per_channel("uint8", (1, 4, 16, 16)))
    assert np.array_equal(ref, got)
