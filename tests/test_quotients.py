"""``round_quotient`` (jitbyoc/ir/quotients.py): ``round(x / s)`` for a divisor the loop
does not change, without a division in the common case, equal to the division's result
for every input: ties and near-ties of every size, zeros of both signs, infinities, NaN
and scales at and past the ends of the normal range. Against numpy, through the JIT (on
vectors and on the scalar tail), and through C; and a quantize built on it against TVM."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from jitbyoc.ir import kir
from jitbyoc.lower import Names
from jitbyoc.toolchain.region import Region
from tests.conftest import assert_bits_equal, build_both, build_model, call_region, jit_function, run
from tests.test_c_renderer import CC, compile_c

SCALES = [0.0173, 1 / 3, 0.1, 2.5, 1e-3, 7.0e4, 2.0 ** -126, 2.0 ** -125, 2.0 ** 125, 2.0 ** 126,
          2.0 ** -127, 1e-45, 3e38, 0.0, -0.0, np.inf, -np.inf, np.nan, -0.0173, -2.5]


def _kernel() -> kir.Kernel:
    """x (a symbolic length: the C rendering names sizes sym0, sym1, ...) and a scalar s."""
    x, s = kir.Buffer("in0", ("sym0",), "float32"), kir.Buffer("in1", (), "float32")
    out = kir.Buffer("out0", ("sym0",), "float32")
    node = kir.Op("round_quotient", (kir.Load(x), kir.Load(s)), "float32", "float32")
    return kir.Kernel("test_round_quotient", [x, s], [out], [kir.Elementwise(("sym0",), ((out, node),))])


def _region() -> Region:
    k = _kernel()
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


def test_round_quotient_takes_the_division_only_off_the_fast_path():
    """The LLVM rule divides in a branch LLVM is told is unlikely; the common path
    multiplies by the reciprocal (the row is not a division with extra steps)."""
    ir = str(_region().llvm_ir)
    assert ir.count("fdiv") >= 2 and "llvm.vector.reduce.or" in ir and '!"branch_weights"' in ir


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_round_quotient_in_c_equals_the_jit(jit_round_quotient, tmp_path):
    region = _region()
    c = tvm.runtime.load_module(compile_c(region.c_source, tmp_path))[region.symbol]
    for s in (0.0173, 2.0 ** -127, np.nan):
        x = _inputs(s, np.random.default_rng(1))
        _assert_same(call_region(c, region.kernel, [x, np.array(s, np.float32)])[0],
                     jit_round_quotient(x, s), f"C vs JIT, s={s!r}")


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
