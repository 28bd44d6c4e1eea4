"""``round_quotient`` (jitbyoc/ir/quotients.py): ``round(x / s)`` for a divisor the loop
does not change, without a division in the common case, equal to the division's result
for every input: ties and near-ties of every size, zeros of both signs, infinities, NaN
and scales at and past the ends of the normal range. Against numpy, through the JIT (on
vectors and on the scalar tail), and through C; and a quantize built on it against TVM.
The same for ``round_clamped_quotient``, ``round(clamp(x / s, lo, hi))``, with the bounds
of 8- and 16-bit quantizes and bounds too wide for its test. And the product rows
(``round_product``, ``round_clamped_product``: ``x * (1 / s)`` untested, a requantization
after reordered sums) against numpy and C, and within one step of the division."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.ir.ops import op_def
from jitbyoc.lower import Names
from jitbyoc.toolchain.region import Region
from tests.conftest import assert_bits_equal, build_both, build_model, call_region, jit_function, run
from tests.test_c_renderer import CC, compile_c

SCALES = [0.0173, 1 / 3, 0.1, 2.5, 1e-3, 7.0e4, 2.0 ** -126, 2.0 ** -125, 2.0 ** 125, 2.0 ** 126,
          2.0 ** -127, 1e-45, 3e38, 0.0, -0.0, np.inf, -np.inf, np.nan, -0.0173, -2.5]


def _kernel(row: str = "round_quotient") -> kir.Kernel:
    """x (a symbolic length: the C rendering names sizes sym0, sym1, ...) and scalars: s,
    and for the clamped row lo and hi."""
    scalars = op_def(row).arity - 1
    x = kir.Buffer("in0", ("sym0",), "float32")
    params = [x] + [kir.Buffer(f"in{k}", (), "float32") for k in range(1, scalars + 1)]
    out = kir.Buffer("out0", ("sym0",), "float32")
    node = kir.Op(row, tuple(kir.Load(b) for b in params), "float32", "float32")
    return kir.Kernel(f"test_{row}", params, [out], [kir.Elementwise(("sym0",), ((out, node),))])


def _region(row: str = "round_quotient") -> Region:
    k = _kernel(row)
    return Region(k.name + "_use", k, Names(tuple(b.name for b in k.params), ()))


def _inputs(s: float, rng) -> np.ndarray:
    """Quotients at and one or two ulps beside every half-integer and integer up to 2**24
    in size (near 0, near the 8-bit range, and where ulps grow past 0.5), random values,
    zeros, infinities, NaN, the largest and the subnormal floats; as x = q * s."""
    f32 = np.float32
    halves = np.concatenate([np.arange(-300, 300) + 0.5, np.arange(-300, 300),
                             [2.0 ** k + 0.5 for k in range(1, 23)], [2.0 ** k for k in range(1, 26)]])
    q = np.concatenate([halves, -halves]).astype(f32)
    near = [q, np.nextafter(q, f32(np.inf)), np.nextafter(q, f32(-np.inf)),
            np.nextafter(np.nextafter(q, f32(np.inf)), f32(np.inf))]
    with np.errstate(all="ignore"):
        xs = [(v * f32(s)).astype(f32) for v in near]
        xs += [np.nextafter(x, f32(np.inf)) for x in xs] + [np.nextafter(x, f32(-np.inf)) for x in xs]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45, 1.2e-38],
                        dtype=f32)
    noise = (rng.standard_normal(4000) * rng.choice([1e-3, 1, 300, 1e6], 4000)).astype(f32)
    return np.concatenate(xs + [specials, noise])


def _expected(x: np.ndarray, s: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.round(x / np.float32(s)).astype(np.float32)


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit (-0.0 is not 0.0), NaN for NaN (which NaN a division makes is the
    CPU's choice, not the quotient's)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), what
    if not nan.all():
        assert_bits_equal(got[~nan], want[~nan], what)


@pytest.fixture(scope="module")
def jit_round_quotient():
    fn, k = jit_function(_region()), _kernel()
    return lambda x, s: call_region(fn, k, [x, np.array(s, np.float32)])[0]


@pytest.mark.parametrize("s", SCALES)
def test_round_quotient_equals_rounded_division(jit_round_quotient, s):
    x = _inputs(s, np.random.default_rng(0))
    for length in (x.size, 13):  # vectors and a masked tail; scalar lanes
        got, want = jit_round_quotient(x[:length], s), _expected(x[:length], s)
        _assert_same(got, want, f"round(x / {s!r})")


@pytest.mark.parametrize("row", ["round_quotient", "round_clamped_quotient"])
def test_the_rows_take_the_division_only_off_the_fast_path(row):
    """The LLVM rule divides in a branch LLVM is told is unlikely; the common path
    multiplies by the reciprocal (the row is not a division with extra steps)."""
    ir = str(_region(row).llvm_ir)
    assert ir.count("fdiv") >= 2 and "llvm.vector.reduce.or" in ir and '!"branch_weights"' in ir


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("row, bounds", [("round_quotient", ()), ("round_clamped_quotient", (0, 255)),
                                         ("round_clamped_quotient", (-7, 248)), ("round_product", ()),
                                         ("round_clamped_product", (0, 255)), ("round_clamped_product", (-7, 248))])
def test_the_rows_in_c_equal_the_jit(row, bounds, tmp_path):
    region = _region(row)
    c = tvm.runtime.load_module(compile_c(region.c_source, tmp_path))[region.symbol]
    jit = jit_function(region)
    for s in (0.0173, 2.0 ** -127, np.nan):
        args = [_inputs(s, np.random.default_rng(1))] + [np.array(v, np.float32) for v in (s, *bounds)]
        _assert_same(call_region(c, region.kernel, args)[0], call_region(jit, region.kernel, args)[0],
                     f"C vs JIT, {row}, s={s!r}")


@pytest.mark.parametrize("scale", [0.0173, 0.25, 3.0])
def test_quantize_to_bytes_equals_tvm(scale):
    """A float32 quantize with a per-tensor scale, on values landing on, beside and
    between its rounding boundaries, and far outside the byte's range."""
    x = _inputs(scale, np.random.default_rng(2)).reshape(1, -1)
    x = x[:, np.isfinite(x[0])]

    def body(bb, v):
        q = bb.emit(relax.op.quantize(v, relax.const(scale, "float32"), relax.const(7, "uint8"),
                                      axis=-1, out_dtype="uint8"))
        return bb.emit(relax.op.dequantize(q, relax.const(scale, "float32"), relax.const(7, "uint8"),
                                           axis=-1, out_dtype="float32"))

    mod = build_model({"x": (x.shape, "float32")}, body)
    builds = build_both(mod)
    assert_bits_equal(run(builds.jit, x), run(builds.tvm, x), f"quantize, scale {scale}")


BOUNDS = [(0, 255), (-128, 127), (-7, 248), (-255, 0), (-65535, 0), (-32768, 32767), (3, 5),
          (-2 ** 21, 2 ** 21)]  # the last: every vector divides


def _clamped_expected(x, s, lo, hi):
    """numpy: the division, then TVM's clip (NaN -> hi), then rounding half to even."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        v = x / f32(s)
    return np.round(np.fmax(np.fmin(v, f32(hi)), f32(lo))).astype(f32)


def _clamped_args(s, lo, hi):
    return [np.array(v, np.float32) for v in (s, lo, hi)]


@pytest.fixture(scope="module")
def jit_clamped():
    fn, k = jit_function(_region("round_clamped_quotient")), _kernel("round_clamped_quotient")
    return lambda x, s, lo, hi: call_region(fn, k, [x, *_clamped_args(s, lo, hi)])[0]


@pytest.mark.parametrize("lo, hi", BOUNDS)
@pytest.mark.parametrize("s", SCALES)
def test_round_clamped_quotient_equals_the_clamped_rounded_division(jit_clamped, s, lo, hi):
    """Quotients at, beside and between the half-integers, past both bounds, NaN and
    infinities (the near-ties are taken around the bounds too)."""
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):
        x = np.concatenate([_inputs(s, rng), (_inputs(1.0, rng)[:2000] + np.float32(lo)) * np.float32(s)])
    for length in (x.size, 13):
        got, want = jit_clamped(x[:length], s, lo, hi), _clamped_expected(x[:length], s, lo, hi)
        _assert_same(got, want, f"round(clamp(x / {s!r}, {lo}, {hi}))")


@pytest.mark.parametrize("to, zp, per_channel", [("uint8", 7, False), ("int8", -3, False), ("uint16", 40000, False),
                                                 ("int16", -1200, False), ("uint8", 7, True), ("int8", 5, True)])
def test_quantize_then_dequantize_equals_tvm(to, zp, per_channel):
    """8- and 16-bit quantizes, one scale or one per channel, read back by a dequantize
    with the same zero point and by one with another: the clamp before rounding and the
    dequantize's shortcut give TVM's values bit for bit."""
    rng = np.random.default_rng(5)
    scale = np.float32(0.0173) if not per_channel else rng.uniform(0.01, 0.03, 6).astype(np.float32)
    x = (rng.standard_normal((6, 4000)) * rng.choice([0.1, 3, 60, 3000], (6, 4000))).astype(np.float32)
    x[:, :6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38]

    def body(bb, v):
        s, z = relax.const(scale, "float32"), relax.const(np.full(np.shape(scale), zp, to))
        q = bb.emit(relax.op.quantize(v, s, z, axis=0, out_dtype=to))
        same = bb.emit(relax.op.dequantize(q, s, z, axis=0, out_dtype="float32"))
        other = bb.emit(relax.op.dequantize(q, s, relax.const(np.full(np.shape(scale), zp + 1, to)), axis=0,
                                            out_dtype="float32"))
        return bb.emit(relax.Tuple([q, same, other]))

    builds = build_both(build_model({"x": (x.shape, "float32")}, body))
    for got, want in zip(run(builds.jit, x), run(builds.tvm, x)):
        assert_bits_equal(got, want, f"quantize to {to}, zero point {zp}")


def test_a_dequantized_quantize_needs_no_clamp_of_its_own():
    """In one loop, a dequantize with the quantize's own zero point reads the clamped
    rounding itself: the kernel's value is ``(rounded + 0) * scale`` (the add makes -0
    +0), with no add of the zero point and subtract back, and no second clamp."""
    def body(bb, v):
        s, z = relax.const(np.float32(0.05)), relax.const(np.uint8(9))
        q = bb.emit(relax.op.quantize(v, s, z, axis=-1, out_dtype="uint8"))
        return bb.emit(relax.op.dequantize(q, s, z, axis=-1, out_dtype="float32"))

    (region,) = jitbyoc.inspect(build_model({"x": ((4, 64), "float32")}, body))
    ((_, value),) = region.kernel.stages[-1].stores
    plus_zero = value.args[0]
    assert value.op == "multiply" and plus_zero.op == "add" and plus_zero.args[1].value == 0
    assert plus_zero.args[0].op == "round_clamped_quotient"


@settings(max_examples=40, deadline=None)
@given(st.floats(2.0 ** -30, 2.0 ** 30, width=32), st.sampled_from(["uint8", "int8", "uint16", "int16"]),
       st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 32 - 1))
def test_round_clamped_quotient_with_a_quantize_s_bounds_equals_numpy(jit_clamped, s, to, zp_seed, seed):
    """Random scales over sixty binades, zero points of every 8- and 16-bit type, and
    quotients at, one ulp beside and between the half-integers across the type's range:
    the row against the clamped rounded division."""
    info = np.iinfo(to)
    zp = int(np.random.default_rng(zp_seed).integers(info.min, int(info.max) + 1))
    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = (rng.integers(int(info.min) - 3, int(info.max) + 4, 3000) - zp + rng.choice([0, 0.5, 0.25], 3000)).astype(f32)
    with np.errstate(all="ignore"):
        x = (q * f32(s)).astype(f32)
        x = np.concatenate([x, np.nextafter(x, f32(np.inf)), np.nextafter(x, f32(-np.inf))])
    lo, hi = info.min - zp, info.max - zp
    _assert_same(jit_clamped(x, s, lo, hi), _clamped_expected(x, s, lo, hi),
                 f"round(clamp(x / {s!r}, {lo}, {hi}))")


# ---- the product rows: a requantization after reordered sums ---------------------------------

PRODUCT_ROWS = [("round_product", ()), ("round_clamped_product", (0, 255)), ("round_clamped_product", (-7, 248))]


@pytest.mark.parametrize("row, bounds", PRODUCT_ROWS)
def test_the_product_rows_equal_their_numpy_reference(row, bounds):
    """``round(x * (1 / s))`` (clamped), untested: the JIT on vectors and a masked tail
    against the row's numpy reference, bit for bit, NaN and infinities included."""
    region = _region(row)
    fn, reference = jit_function(region), op_def(row).ref
    for s in (0.0173, 1 / 3, 2.5, 2.0 ** -127, np.inf, np.nan):
        x = _inputs(s, np.random.default_rng(4))
        params = [np.array(v, np.float32) for v in (s, *bounds)]
        for length in (x.size, 13):
            want = reference(x[:length], *params).astype(np.float32)
            _assert_same(call_region(fn, region.kernel, [x[:length], *params])[0], want, f"{row}, s={s!r}")
    assert "llvm.vector.reduce.or" not in str(region.llvm_ir)  # no exactness test


@pytest.mark.parametrize("row, bounds", PRODUCT_ROWS)
def test_a_product_row_is_within_one_step_of_the_division_and_only_at_near_ties(row, bounds):
    """The bound the rows are used under (``jitbyoc/ir/quotients.py``): where the
    rounded product and the rounded quotient differ, by one step at most, ``x / s`` (in
    float64) lies within ``|x / s| * 2**-22`` of a half-integer (quotients below 2**22,
    every quantize's range)."""
    region = _region(row)
    fn, differing = jit_function(region), 0
    for s in (0.0173, 1 / 3, 0.1, 2.5, 7.0e4, 2.0 ** -126):
        x = _inputs(s, np.random.default_rng(5))
        x = x[np.abs(x.astype(np.float64) / s) < 2.0 ** 22]  # past it, float32's own steps exceed one
        params = [np.array(v, np.float32) for v in (s, *bounds)]
        got = call_region(fn, region.kernel, [x, *params])[0]
        want = (_clamped_expected(x, s, *bounds) if bounds else _expected(x, s))
        apart = got != want
        assert np.abs(got - want).max() <= 1, f"{row}, s={s!r}"
        q = x[apart].astype(np.float64) / np.float64(np.float32(s))
        assert (np.abs(np.abs(q - np.floor(q)) - 0.5) <= np.abs(q) * 2.0 ** -22).all(), f"{row}, s={s!r}"
        differing += int(apart.sum())
    assert differing  # the inputs hold near-ties where the two roundings part
