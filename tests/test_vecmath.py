"""Accuracy of every vecmath expansion against the exact function, through the JIT.

Each expansion row of the op table is compiled as a one-op kernel and run on dense grids
(plus random points, tiny and subnormal inputs, the overflow edges and both sides of every
branch switch); its results must lie within the row's documented ``ulp`` bound (the bounds
in vecmath's docstring) of the exact values. float32 results are checked against float64
numpy/math references, float64 results against mpmath at 120 bits, as (hi, lo) pairs of
doubles.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import tvm

from jitbyoc.toolchain.region import Region
from jitbyoc.ir import fitting, vecmath
from jitbyoc.ir.ops import OPS
from jitbyoc.lower import Names
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import (
    SQRT_2_PI,
    assert_within_ulp,
    call_region,
    documented_ulp,
    jit_function,
    one_op_kernel,
    ulp_error,
)

mpmath.mp.prec = 120

_erf = np.vectorize(math.erf, otypes=[np.float64])
_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def _np_gelu_tanh(x):
    u = SQRT_2_PI * (x + 0.044715 * x ** 3)
    return x / (1 + np.exp(-2 * u))  # 0.5*x*(1 + tanh(u)) without cancellation


def _mp_gelu_tanh(x):
    u = mpmath.sqrt(2 / mpmath.pi) * (x + mpmath.mpf("0.044715") * x ** 3)
    return x / (1 + mpmath.exp(-2 * u))


# row -> (float64 reference for float32 results, mpmath reference for float64 results)
EXACT = {
    "exp": (np.exp, mpmath.exp),
    "expm1": (np.expm1, mpmath.expm1),
    "log": (np.log, mpmath.log),
    "tanh": (np.tanh, mpmath.tanh),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), lambda x: 1 / (1 + mpmath.exp(-x))),
    "silu": (lambda x: x / (1 + np.exp(-x)), lambda x: x / (1 + mpmath.exp(-x))),
    "erf": (_erf, mpmath.erf),
    "gelu": (lambda x: x / 2 * _erfc(-x / math.sqrt(2)), lambda x: x / 2 * mpmath.erfc(-x / mpmath.sqrt(2))),
    "gelu_tanh": (_np_gelu_tanh, _mp_gelu_tanh),
    "power": (np.power, mpmath.power),
}
EXACT["gelu_bf16"] = EXACT["gelu"]

EXPANSIONS = sorted(name for name, row in OPS.items()
                    if row.expand is not None and row.expand.__module__ == vecmath.__name__)

# grid ends per row: (float32, float64); past them results overflow or underflow anyway
RANGES = {
    "exp": ((-110, 90), (-750, 712)),
    "expm1": ((-110, 90), (-750, 712)),
    "tanh": ((-20, 20), (-40, 40)),
    "sigmoid": ((-120, 120), (-800, 800)),
    "silu": ((-120, 120), (-800, 800)),
    "erf": ((-8, 8), (-8, 8)),
    "gelu": ((-16, 16), (-40, 40)),
    "gelu_bf16": ((-16, 16), (-40, 40)),
    "gelu_tanh": ((-14, 14), (-30, 30)),
}


def _tiny_inputs(dt: str) -> np.ndarray:
    fi = np.finfo(dt)
    mags = np.array([fi.smallest_subnormal, fi.smallest_subnormal * 7, fi.tiny / 3, fi.tiny,
                     fi.tiny * 5, 1e-30, 1e-12, fi.eps / 3, fi.eps], dt)
    return np.concatenate([mags, -mags, np.array([0.0, -0.0], dt)])


def _branch_edges(name: str, dt: str) -> np.ndarray:
    """Both sides of every input where the expansion switches branch or caps its input
    (erf's polynomial/erfc split and cap, gelu's cap): a dense window and the nearest
    floats, for both signs."""
    edges = [edge for (use, d), (_, lo, hi, _) in fitting.ERFCX.items() if use == name and d == dt
             for edge in (lo, hi) if edge > 0]
    edges += [fitting.GELU_BF16_CLAMP] if (name, dt) == ("gelu_bf16", "float32") else []
    pts = []
    for edge in edges:
        near = np.array([edge], dt)
        for _ in range(4):
            near = np.concatenate([near, np.nextafter(near, np.array(np.inf, dt)),
                                   np.nextafter(near, np.array(-np.inf, dt))])
        pts += [np.linspace(edge * (1 - 1e-3), edge * (1 + 1e-3), 64), near]
    x = np.unique(np.concatenate(pts).astype(dt)) if pts else np.zeros(0, dt)
    return np.concatenate([x, -x])


def grid(name: str, dt: str, n: int) -> np.ndarray:
    """Dense grid + random points over the row's range, small inputs, tiny inputs, both
    sides of branch switches."""
    rng = np.random.default_rng(7)
    if name == "log":
        fi = np.finfo(dt)
        lo, hi = math.log2(fi.smallest_subnormal), math.log2(fi.max) - 1e-6
        x = np.concatenate([np.exp2(np.linspace(lo, hi, n)), np.exp2(rng.uniform(lo, hi, n)),
                            rng.uniform(0.5, 2, n), np.linspace(0.7, 1.4, n)])
    else:
        lo, hi = RANGES[name][dt == "float64"]
        x = np.concatenate([np.linspace(lo, hi, n), rng.uniform(lo, hi, n),
                            np.linspace(-1, 1, n), rng.uniform(-1, 1, n) * 10.0 ** rng.uniform(-8, 0, n)])
    tiny = _tiny_inputs(dt)
    return np.concatenate([x.astype(dt), tiny[tiny > 0] if name == "log" else tiny, _branch_edges(name, dt)])


def exact(name: str, dt: str, *xs):
    """Exact results: float64 for float32 results; (hi, lo) doubles for float64 ones."""
    f32_ref, mp_ref = EXACT[name]
    if dt == "float32":
        with np.errstate(all="ignore"):
            return f32_ref(*(x.astype(np.float64) for x in xs))
    values = [mp_ref(*(mpmath.mpf(float(v)) for v in vs)) for vs in zip(*xs)]
    hi = np.array([float(v) for v in values])
    with np.errstate(invalid="ignore"):
        lo = np.array([float(v - h) if math.isfinite(h) else 0.0 for v, h in zip(values, hi)])
    return hi, lo


# the expansions' Horner steps are fused multiply-adds on machines that have them (this
# one), and a multiply and an add on baseline x86-64: both must meet the bounds
MACHINES = {"fused": isa.host(), "unfused": machine_for(tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))}


def _region(kernel) -> Region:
    """A region running ``kernel`` alone, its buffers named after the kernel's params."""
    return Region(kernel.name + "_use", kernel, Names(tuple(b.name for b in kernel.params), ()))


@pytest.fixture(scope="module", params=sorted(MACHINES))
def kernels(request):
    cache, machine = {}, MACHINES[request.param]
    assert isa.has_fma(machine) == (request.param == "fused"), "this test needs a CPU with FMA"

    def get(name, dt):
        if (name, dt) not in cache:
            with isa.compiling_for(machine):
                k = one_op_kernel(name, dt)
                fn = jit_function(_region(k))
            cache[name, dt] = lambda *xs, fn=fn, k=k: call_region(fn, k, xs)
        return cache[name, dt]
    return get


@pytest.mark.parametrize("fused", [True, False])
def test_series_use_fused_multiply_adds_where_the_machine_has_them(fused):
    """One rounding and one instruction a Horner step where the machine fuses (gelu
    1.24 -> 0.73 ns an element, silu 0.61 -> 0.42 on Zen 4, one thread); two ops on
    baseline x86-64, where ``llvm.fma`` would be a libm call per element."""
    with isa.compiling_for(MACHINES["fused" if fused else "unfused"]):
        ir = _region(one_op_kernel("gelu", "float32")).llvm_ir
    assert ("llvm.fma." in ir) == fused


AVX2 = machine_for(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))


@pytest.mark.skipif(not isa.host().has("avx512f"), reason="runs the AVX-512 build on this machine")
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("name", ["exp", "expm1", "erf", "gelu"])
def test_the_power_of_two_scaling_is_one_instruction_on_avx512_with_the_same_results(name, dt):
    """exp's ``y * 2**n`` is ``llvm.ldexp`` on AVX-512 (``vscalefps``: two instructions a
    vector with n's conversion) and two exact factors elsewhere (nine): one rounding each,
    so the builds agree bit for bit, subnormal and overflowing results included. gelu and
    erf take it through ``exp(-x*x/2)``."""
    x = grid(name, dt, 20000 if dt == "float32" else 2000)
    got = {}
    for key, machine in (("avx512", isa.host()), ("avx2", AVX2)):
        with isa.compiling_for(machine):
            k = one_op_kernel(name, dt)
            region = _region(k)
            assert ("llvm.ldexp" in region.llvm_ir) == (key == "avx512"), key
            got[key] = call_region(jit_function(region), k, [x])[0]
    np.testing.assert_array_equal(got["avx512"], got["avx2"])


def test_every_expansion_has_a_reference():
    assert set(EXPANSIONS) <= set(EXACT), f"add an exact reference for {set(EXPANSIONS) - set(EXACT)}"
    assert all(OPS[name].ulp > 0 for name in EXPANSIONS)


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("name", [n for n in EXPANSIONS if OPS[n].arity == 1])
def test_unary_within_documented_ulp(kernels, name, dt):
    x = grid(name, dt, 20000 if dt == "float32" else 2000)
    got = kernels(name, dt)(x)[0]
    want = exact(name, dt, x)
    report_worst(name, dt, got, want, x)
    assert_within_ulp(got, want, dt, _bound(name, dt, x, want), x=x, what=f"{name} {dt}")


def _bound(name: str, dt: str, x, want) -> np.ndarray:
    """The row's documented bound in ulps of the result; gelu_bf16's in float32, a
    fraction of |x| (vecmath.GELU_BF16_BOUND), in ulps of each result."""
    if (name, dt) != ("gelu_bf16", "float32"):
        return documented_ulp(name, x)
    spacing = np.spacing(np.maximum(np.abs(want), np.finfo(dt).tiny).astype(dt)).astype(np.float64)
    return np.maximum(OPS[name].ulp, vecmath.GELU_BF16_BOUND * np.abs(x.astype(np.float64)) / spacing)


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_fma_row_rounds_once(kernels, dt):
    """The ``fma`` row the expansions use is ``x*y + z`` rounded once, on either machine
    (a libm call where the machine has no FMA): bit for bit its reference, which is exact.
    Products near -z, where rounding the product first loses everything, included."""
    rng = np.random.default_rng(11)
    x, y = (rng.standard_normal(4000).astype(dt) for _ in range(2))
    z = np.concatenate([rng.standard_normal(2000), -(x[2000:].astype(np.float64) * y[2000:])]).astype(dt)
    got = kernels("fma", dt)(x, y, z)[0]
    want = OPS["fma"].ref(x, y, z)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(want[2000:]) > 1000  # the cancelling half keeps the product's low bits


def report_worst(name, dt, got, want, x):
    """Print the worst error outside the flushed range (shown with ``pytest -s``)."""
    hi = want[0] if isinstance(want, tuple) else want
    keep = np.abs(hi) >= np.finfo(dt).tiny * np.maximum(1, np.abs(x.astype(np.float64)))
    print(f"\n{name} {dt}: max {float(np.max(ulp_error(got, want, dt)[keep])):.2f} ulp "
          f"(row bound {OPS[name].ulp})")


def _power_inputs(dt: str, n: int):
    rng = np.random.default_rng(3)
    # positive bases over many decades, exponents keeping |y*log2 x| below the range
    x = 2.0 ** rng.uniform(-20, 20, n)
    y = rng.uniform(-6, 6, n)
    # negative bases with integer exponents; small powers of two and integers (exact results)
    xn = -rng.uniform(0.1, 10, n // 4)
    yn = rng.integers(-8, 9, n // 4).astype(float)
    xi = rng.integers(1, 10, n // 4).astype(float)
    yi = rng.integers(0, 8, n // 4).astype(float)
    return (np.concatenate([x, xn, xi]).astype(dt), np.concatenate([y, yn, yi]).astype(dt))


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_power_within_documented_ulp(kernels, dt):
    x, y = _power_inputs(dt, 20000 if dt == "float32" else 2000)
    got = kernels("power", dt)(x, y)[0]
    want = exact("power", dt, x, y)
    report_worst("power", dt, got, want, x)
    assert_within_ulp(got, want, dt, documented_ulp("power", x, y), x=x, what=f"power {dt}")
    small = np.abs(y * np.log(np.abs(x.astype(np.float64)))) <= 31
    assert_within_ulp(got[small], (want[0][small], want[1][small]) if dt == "float64" else want[small],
                      dt, OPS["power"].ulp, what=f"power {dt}, |y ln x| <= 31")


INF, NAN = math.inf, math.nan

# the limits and IEEE conventions each expansion promises at special inputs
SPECIAL = {
    "exp": [(0.0, 1.0), (-0.0, 1.0), (INF, INF), (-INF, 0.0), (NAN, NAN)],
    "expm1": [(0.0, 0.0), (-0.0, -0.0), (INF, INF), (-INF, -1.0), (NAN, NAN)],
    "log": [(0.0, -INF), (-0.0, -INF), (1.0, 0.0), (INF, INF), (-1.0, NAN), (-INF, NAN), (NAN, NAN)],
    "tanh": [(0.0, 0.0), (-0.0, -0.0), (INF, 1.0), (-INF, -1.0), (NAN, NAN)],
    "sigmoid": [(0.0, 0.5), (INF, 1.0), (-INF, 0.0), (NAN, NAN)],
    "silu": [(0.0, 0.0), (INF, INF), (-INF, -0.0), (NAN, NAN)],
    "erf": [(0.0, 0.0), (-0.0, -0.0), (INF, 1.0), (-INF, -1.0), (NAN, NAN)],
    "gelu": [(0.0, 0.0), (INF, INF), (-INF, -0.0), (NAN, NAN)],
    "gelu_bf16": [(0.0, 0.0), (INF, INF), (-INF, -0.0), (NAN, NAN)],
    "gelu_tanh": [(0.0, 0.0), (INF, INF), (-INF, -0.0), (NAN, NAN)],
}


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("name", [n for n in EXPANSIONS if OPS[n].arity == 1])
def test_special_values(kernels, name, dt):
    assert name in SPECIAL, f"add the special values of {name}"
    x = np.array([a for a, _ in SPECIAL[name]], dt)
    want = np.array([b for _, b in SPECIAL[name]], dt)
    got = kernels(name, dt)(x)[0]
    # the sign of a zero result counts too
    np.testing.assert_array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]),
                                  err_msg=f"{name} {dt}: sign of zero results for x={x[want == 0]}")
    np.testing.assert_array_equal(got, want, err_msg=f"{name} {dt} at x={x}")


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_power_special_values_follow_c(kernels, dt):
    """C's pow (numpy's) on signed zeros, infinities, NaN and the unit bases: -0.0 and -inf
    to a non-integer power are not NaN, pow(1, y) and pow(-1, +-inf) are 1."""
    z, i = 0.0, INF
    pairs = [(-z, 0.5), (-z, 2.5), (-z, -0.5), (-z, 3.0), (-z, -3.0), (-z, 2.0), (z, -1.5),
             (-i, 0.5), (-i, -0.5), (-i, 3.0), (-i, -3.0), (-i, 2.0), (i, -2.5),
             (1.0, NAN), (1.0, i), (1.0, -i), (-1.0, i), (-1.0, -i), (NAN, 0.0),
             (-2.0, 0.5), (-2.0, -1.0), (-2.0, i), (-0.5, i), (0.5, -i), (2.0, NAN), (NAN, 2.0)]
    x, y = (np.array(v, dt) for v in zip(*pairs))
    with np.errstate(all="ignore"):
        want = np.power(x, y)
    got = kernels("power", dt)(x, y)[0]
    np.testing.assert_array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]))
    np.testing.assert_array_equal(got, want, err_msg=f"power {dt} at {pairs}")


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_exp_overflow_edges(kernels, dt):
    """Around the largest finite result and the smallest normal one: exact overflow to
    inf, no premature overflow, and subnormal results within the flush allowance."""
    fi = np.finfo(dt)
    top, bottom = math.log(float(fi.max)), math.log(float(fi.tiny))
    x = np.concatenate([np.linspace(top - 0.01, top + 0.01, 401),
                        np.linspace(bottom - 0.5, bottom + 0.5, 401)]).astype(dt)
    got = kernels("exp", dt)(x)[0]
    want = exact("exp", dt, x)
    assert_within_ulp(got, want, dt, OPS["exp"].ulp, x=x, what=f"exp edges {dt}")
    assert np.all(np.isinf(got[x > top])) and np.all(np.isfinite(got[x < top]))


# C's pow: negative bases with integer exponents, signed zeros, y == 0
POW_SPECIAL = [(-2.0, 3.0), (-2.0, 2.0), (-2.0, -3.0), (-0.5, 0.5), (-8.0, 1 / 3), (0.0, 2.0),
               (0.0, 3.0), (-0.0, 3.0), (-0.0, 2.0), (0.0, -1.0), (-0.0, -1.0), (-0.0, -2.0),
               (0.0, 0.0), (NAN, 0.0), (INF, 0.0), (3.0, -0.0), (1.0, 5.5), (NAN, 1.0), (2.0, NAN)]


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_power_special_values(kernels, dt):
    x = np.array([a for a, _ in POW_SPECIAL], dt)
    y = np.array([b for _, b in POW_SPECIAL], dt)
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), y.astype(np.float64))  # C99 pow
    got = kernels("power", dt)(x, y)[0]
    assert_within_ulp(got, want.astype(dt).astype(np.float64), dt, OPS["power"].ulp,
                      what=f"power special {dt}")
    zero = want == 0
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]),
                                  err_msg=f"sign of pow({x[zero]}, {y[zero]})")


class _Counter:
    """An emitter that counts the table ops an expansion emits."""

    fused = False  # the op counts below are of the two-op (multiply, add) Horner steps

    def __init__(self):
        self.ops = 0

    def op(self, name, dt, *values, **attrs):
        self.ops += 1
        return object()

    def const(self, value, dt):
        return object()


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_sigmoid_needs_no_fix_ups_of_exp(dt):
    """sigmoid clamps its exp's argument so 2**n is one factor (or inf): none of exp's
    NaN, underflow and two-factor scaling steps (45 ops for float32, 33 now; each op is a
    vector instruction of every SiLU and tanh-GELU). The accuracy is the tests above."""
    count = _Counter()
    vecmath.sigmoid(count, dt, object())
    taylor = 7 if dt == "float32" else 13
    assert count.ops <= 21 + 2 * (taylor - 1), count.ops  # Horner: a multiply and an add a term
