"""Vectorizable transcendental functions, written once over an emitter.

LLVM lowers ``llvm.exp.*`` to scalar ``expf`` calls, which stop the loop vectorizer, and
C's libm differs between machines. So exp, log, tanh, erf and friends are expanded here
into table ops (add, mul, floor, select, bitcast, shifts) that both renderers emit the
same way. ``e.op(name, dtype, *values, **attrs)`` emits a row of :mod:`jitbyoc.ir.ops`;
``e.const(value, dtype)`` a literal. Where the machine fuses multiply-adds (``e.fused``:
x86 FMA3, AArch64), Horner steps and exp's argument reduction are the ``fma`` row, one
rounding and one instruction (``llvm.fma`` in LLVM, C's ``fma``): float32 gelu 1.24 ->
0.73 ns an element, silu 0.61 -> 0.42, tanh 0.88 -> 0.58 (Zen 4, one thread). Elsewhere
(baseline x86-64, where ``llvm.fma`` is a libm call per element) they are a multiply and
an add. Either way the C and LLVM renderings of one machine round identically; a C
export for an FMA machine compiled without its FMA flags calls libm's ``fma``: the same
results, slower.

Error bounds against the exact function, in ulps of the result, checked by
``tests/test_vecmath.py`` on dense grids for float32 and float64: exp, log <= 2;
expm1 <= 3; tanh, sigmoid, erf <= 4; gelu, silu <= 8; gelu_bf16 (for results rounded to
bfloat16) within 2**-19 * |x|, in float32. Two bounds grow with the input:
gelu_tanh <= max(8, 3*|2u|), so 8 for x >= -1.5 (exp amplifies the rounding of its
argument ``2u = 2*sqrt(2/pi)*(x + 0.044715*x**3)``); power <= 2*(1 + |y*ln|x||), so
64 while ``|y*ln|x|| <= 31`` (exp amplifies the error of log). Where exp's result would
be subnormal (x < -87.3 in float32, -708.4 in float64) it may be flushed to zero, so any
result smaller than ``tiny * max(1, |x|)`` (tiny: the smallest normal number) is only
within that much of the exact value.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal

import numpy as np

from .fitting import ERFCX, GELU_BF16_CLAMP, erf_coefficients, erfcx_coefficients, gelu_bf16_coefficients

_LN2 = Decimal(2).ln(Context(prec=50))

# per float dtype: (int dtype, mantissa bits, exponent bias, exp clamp lo, hi, taylor degree)
_F = {
    "float32": ("int32", 23, 127, -104.0, 89.0, 7),
    "float64": ("int64", 52, 1023, -746.0, 710.0, 13),
}


def _split_ln2(dt: str) -> tuple[float, float]:
    """ln2 as hi + lo, hi with few enough bits that ``n * hi`` is exact for every n used."""
    if dt == "float32":
        hi = float(np.frombuffer((np.array(float(_LN2), np.float32).view(np.uint32)
                                  & np.uint32(0xFFFFF000)).tobytes(), np.float32)[0])
    else:
        hi = float(np.frombuffer((np.array(float(_LN2)).view(np.uint64)
                                  & np.uint64(0xFFFFFFFFFFE00000)).tobytes(), np.float64)[0])
    return hi, float(_LN2 - Decimal(hi))


def _horner(e, dt, x, coeffs):
    """coeffs[0] + x*(coeffs[1] + x*(...)): fused multiply-adds where the machine has them
    (``e.fused``), else a multiply and an add a step."""
    acc = e.const(coeffs[-1], dt)
    for c in reversed(coeffs[:-1]):
        acc = _multiply_add(e, dt, acc, x, e.const(c, dt))
    return acc


def _multiply_add(e, dt, x, y, z):
    """x*y + z: the ``fma`` row (one rounding) where the machine fuses, else two ops."""
    if e.fused:
        return e.op("fma", dt, x, y, z)
    return e.op("add", dt, e.op("multiply", dt, x, y), z)


def _isnan(e, dt, x):
    return e.op("not_equal", dt, x, x)


def _pow2(e, dt, n):
    """2**n as a float of dtype ``dt``, for an integer n in the normal exponent range."""
    it, mant, bias, *_ = _F[dt]
    bits = e.op("shl", it, e.op("add", it, n, e.const(bias, it)), e.const(mant, it))
    return e.op("bitcast", it, bits)


def _exp_parts(e, dt, x):
    """(n, p) with exp(x) = 2**n * (1 + p) and p = expm1(r), |r| <= ln2/2."""
    lo, hi = _F[dt][3:5]
    x = e.op("select", dt, _isnan(e, dt, x), e.const(0, dt), x)
    x = e.op("minimum", dt, e.op("maximum", dt, x, e.const(lo, dt)), e.const(hi, dt))
    return _exp_reduced(e, dt, x)


def _exp_reduced(e, dt, x, s=None):
    """(n, p) with exp(x + s) = 2**n * (1 + p), p = expm1(r), for x in exp's clamped range.
    ``x - n*ln2_hi`` is exact, so a small ``s`` added after it is the only rounding of the
    argument: x + s itself is never rounded (exp would amplify that by |x + s|)."""
    it, deg = _F[dt][0], _F[dt][5]
    ln2_hi, ln2_lo = _split_ln2(dt)
    xs = x if s is None else e.op("add", dt, x, s)  # only chooses n
    t = e.op("floor", dt, _multiply_add(e, dt, xs, e.const(1 / math.log(2), dt), e.const(0.5, dt)))
    # x - t*ln2_hi is exact, fused or not; t*ln2_lo then rounds once fused, twice not
    r = _multiply_add(e, dt, t, e.const(-ln2_lo, dt), _multiply_add(e, dt, t, e.const(-ln2_hi, dt), x))
    if s is not None:
        r = e.op("add", dt, r, s)
    p = e.op("multiply", dt, r, _horner(e, dt, r, [1 / math.factorial(k) for k in range(1, deg + 1)]))
    return e.op("astype", dt, t, to=it), p


def _ldexp(e, dt, y, n):
    """y * 2**n, in one instruction where the emitter has one (``e.ldexp``: AVX-512's
    vscalef), else split in two factors so both stay normal over the clamped range: one
    rounding either way, so the same result."""
    native = getattr(e, "ldexp", None)
    scaled = native(dt, y, n) if native is not None else None
    if scaled is not None:
        return scaled
    it = _F[dt][0]
    n1 = e.op("shr", it, n, e.const(1, it))
    n2 = e.op("subtract", it, n, n1)
    return e.op("multiply", dt, e.op("multiply", dt, y, _pow2(e, dt, n1)), _pow2(e, dt, n2))


def exp(e, dt, x):
    """Below the clamp ``lo`` exp rounds to 0: those lanes compute exp(0) and are then set
    to 0, because computing exp(lo) underflows, and an underflowing multiply costs a
    microcode assist on AMD cores (masked attention scores are -inf or -1e9: the fused
    attention's softmax ran 17 % slower with the clamp)."""
    dead = e.op("less", dt, x, e.const(_F[dt][3], dt))
    n, p = _exp_parts(e, dt, e.op("select", dt, dead, e.const(0, dt), x))
    y = _ldexp(e, dt, e.op("add", dt, p, e.const(1, dt)), n)
    y = e.op("select", dt, dead, e.const(0, dt), y)
    return e.op("select", dt, _isnan(e, dt, x), x, y)


def expm1(e, dt, x):
    """2**n * (p - (2**-n - 1)): one rounding before the exact scaling, no overflow of
    2**n on the way to a finite result, and -0 stays -0. Past 2**-(mant+3) the -1 (or
    the p) no longer shows in the result, so n is clamped there."""
    it, mant = _F[dt][:2]
    n, p = _exp_parts(e, dt, x)
    n = e.op("maximum", it, n, e.const(-(mant + 3), it))
    d = e.op("subtract", dt, _pow2(e, dt, e.op("negative", it, e.op("minimum", it, n, e.const(mant + 3, it)))),
             e.const(1, dt))
    y = _ldexp(e, dt, e.op("subtract", dt, p, d), n)
    return e.op("select", dt, _isnan(e, dt, x), x, y)


def log(e, dt, x):
    it, mant, bias, *_ = _F[dt]
    tiny = float(np.finfo(dt).tiny)
    sub = e.op("less", dt, x, e.const(tiny, dt))
    xs = e.op("select", dt, sub, e.op("multiply", dt, x, e.const(2.0 ** mant, dt)), x)
    bits = e.op("bitcast", dt, xs)
    ex = e.op("subtract", it, e.op("shr", it, bits, e.const(mant, it)), e.const(bias, it))
    ex = e.op("subtract", it, ex, e.op("select", it, sub, e.const(mant, it), e.const(0, it)))
    m = e.op("bitcast", it, e.op("bitor", it, e.op("bitand", it, bits, e.const((1 << mant) - 1, it)),
                                 e.const(bias << mant, it)))
    big = e.op("greater", dt, m, e.const(math.sqrt(2), dt))
    m = e.op("select", dt, big, e.op("multiply", dt, m, e.const(0.5, dt)), m)
    ex = e.op("add", it, ex, e.op("select", it, big, e.const(1, it), e.const(0, it)))
    s = e.op("divide", dt, e.op("subtract", dt, m, e.const(1, dt)), e.op("add", dt, m, e.const(1, dt)))
    z = e.op("multiply", dt, s, s)
    terms = 5 if dt == "float32" else 12
    series = _horner(e, dt, z, [1 / (2 * k + 1) for k in range(1, terms)])
    s2 = e.op("add", dt, s, s)
    logm = e.op("add", dt, s2, e.op("multiply", dt, e.op("multiply", dt, s2, z), series))
    fe = e.op("astype", it, ex, to=dt)
    ln2_hi, ln2_lo = _split_ln2(dt)
    y = e.op("add", dt, e.op("multiply", dt, fe, e.const(ln2_hi, dt)),
             e.op("add", dt, logm, e.op("multiply", dt, fe, e.const(ln2_lo, dt))))
    y = e.op("select", dt, e.op("equal", dt, x, e.const(math.inf, dt)), x, y)
    y = e.op("select", dt, e.op("equal", dt, x, e.const(0, dt)), e.const(-math.inf, dt), y)
    bad = e.op("logical_or", "bool", e.op("less", dt, x, e.const(0, dt)), _isnan(e, dt, x))
    return e.op("select", dt, bad, e.const(math.nan, dt), y)


def _signbit(e, dt, x):
    """True for negative x, -0.0 included."""
    it = _F[dt][0]
    return e.op("less", it, e.op("bitcast", dt, x), e.const(0, it))


def _copysign(e, dt, x, y):
    """|y| with the sign of x (y >= 0)."""
    return e.op("select", dt, _signbit(e, dt, x), e.op("negative", dt, y), y)


def tanh(e, dt, x):
    # the cap goes first: minimum(c, NaN) is NaN, so NaN propagates
    ax = e.op("minimum", dt, e.const(10.0 if dt == "float32" else 20.0, dt), e.op("abs", dt, x))
    u = expm1(e, dt, e.op("add", dt, ax, ax))
    t = e.op("divide", dt, u, e.op("add", dt, u, e.const(2, dt)))
    return _copysign(e, dt, x, t)


# exp's argument range in sigmoid: 2**n stays one factor (2**-126 .. 2**127, then 2**128
# = inf for arguments past ln(FLT_MAX), where the sigmoid is 0 to within the flush allowance)
_SIGMOID = {"float32": (-87.0, 89.0), "float64": (-708.0, 710.0)}


def sigmoid(e, dt, x):
    """1 / (1 + exp(-x)) with an exp of its own: the argument is clamped to where 2**n is
    one normal factor (or inf: a sigmoid of 0), so none of exp's fix-ups for underflow,
    NaN and the far range are needed: 33 table ops, not 45 (EfficientNet's SiLUs). The
    clamp's maximum is a select that takes the bound for NaN; NaN comes back at the end."""
    lo, hi = _SIGMOID[dt]
    t = e.op("minimum", dt, e.op("maximum", dt, e.op("negative", dt, x), e.const(lo, dt)), e.const(hi, dt))
    n, p = _exp_reduced(e, dt, t)
    y = e.op("multiply", dt, e.op("add", dt, p, e.const(1, dt)), _pow2(e, dt, n))
    s = e.op("divide", dt, e.const(1, dt), e.op("add", dt, e.const(1, dt), y))
    return e.op("select", dt, _isnan(e, dt, x), x, s)


def _finite(e, dt, x):
    """x with -inf replaced by the most negative finite number, so that a factor x times
    a sigmoid that has gone to 0 gives -0 (the limit), not NaN."""
    return e.op("maximum", dt, x, e.const(-float(np.finfo(dt).max), dt))


def silu(e, dt, x):
    return e.op("multiply", dt, _finite(e, dt, x), sigmoid(e, dt, x))


def _erfcx(e, dt, use, ax):
    """erfc(s*ax)*exp((s*ax)**2) (times 1/2 for gelu) for ax in [lo, hi] of ``ERFCX``:
    one divide, then Horner's rule."""
    coeffs, p, c, k = erfcx_coefficients(use, dt)
    w = e.op("divide", dt, e.const(c, dt), e.op("add", dt, ax, e.const(k, dt)))
    u = e.op("subtract", dt, e.const(p, dt), w)
    return e.op("multiply", dt, w, _horner(e, dt, u, list(coeffs)))


def _times_exp_neg_square(e, dt, y, x, scale):
    """y * exp(-scale*x*x) (scale 1 or 1/2) for |x| <= 2**60 and scale*x*x below
    2*(bias - 1)*ln2, where _ldexp's factors stay normal (results past the subnormal range
    round to 0). x*x is split into hi*hi (exact: hi keeps half the significand) +
    lo*(x + hi), and only the small second part joins after exp's exact reduction:
    rounding x*x itself would be amplified by exp to x*x ulp. One exp, where two (of
    hi*hi and of the rest) would cost twice. y*(1 + p) is y + y*p, which keeps p's low
    bits that rounding 1 + p drops."""
    it, mant = _F[dt][:2]
    drop = mant + 1 - (mant + 1) // 2
    hi = e.op("bitcast", it, e.op("bitand", it, e.op("bitcast", dt, x), e.const(-1 << drop, it)))
    lo = e.op("subtract", dt, x, hi)
    m = e.const(-scale, dt)
    n, p = _exp_reduced(e, dt, e.op("multiply", dt, e.op("multiply", dt, hi, hi), m),
                        e.op("multiply", dt, e.op("multiply", dt, lo, e.op("add", dt, x, hi)), m))
    return _ldexp(e, dt, _multiply_add(e, dt, y, p, y), n)


def erf(e, dt, x):
    """x*P(x*x) below lo, else +-(1 - exp(-x*x) * erfcx(|x|)), |x| capped at hi."""
    s2, lo, hi, _ = ERFCX["erf", dt]
    small = e.op("multiply", dt, x, _horner(e, dt, e.op("multiply", dt, x, x), list(erf_coefficients(dt))))
    a = e.op("abs", dt, x)
    ax = e.op("minimum", dt, a, e.const(hi, dt))  # inf -> hi, where erf is +-1
    tail = _times_exp_neg_square(e, dt, _erfcx(e, dt, "erf", ax), ax, s2)
    large = _copysign(e, dt, x, e.op("subtract", dt, e.const(1, dt), tail))
    # NaN fails the test and takes the polynomial, which keeps it NaN
    return e.op("select", dt, e.op("greater_equal", dt, a, e.const(lo, dt)), large, small)


def gelu(e, dt, x):
    """x * erfc(-x/sqrt2)/2, as x*(1 - q) for x > 0 and x*q otherwise, with
    q = erfc(|x|/sqrt2)/2 = exp(-x*x/2) * erfcx(|x|/sqrt2)/2 <= 1/2: one exp (its argument
    kept exact) and one series for every x, and no cancellation (1 - q >= 1/2)."""
    s2, _, hi, _ = ERFCX["gelu", dt]
    ax = e.op("minimum", dt, e.op("abs", dt, x), e.const(hi, dt))  # NaN, inf -> hi: q = 0
    q = _times_exp_neg_square(e, dt, _erfcx(e, dt, "gelu", ax), ax, s2)
    phi = e.op("select", dt, e.op("greater", dt, x, e.const(0, dt)),
               e.op("subtract", dt, e.const(1, dt), q), q)
    # -inf -> -hi, whose q is 0, so the result is -0; NaN stays NaN
    return e.op("multiply", dt, e.op("maximum", dt, e.const(-hi, dt), x), phi)


GELU_BF16_BOUND = 2.0 ** -19  # gelu_bf16's error, a fraction of |x| (tests/test_vecmath.py)


def gelu_bf16(e, dt, x):
    """gelu for a result rounded to bfloat16 (the op table's ``bf16_row`` of gelu): within
    :data:`GELU_BF16_BOUND` times |x| of the exact value. bfloat16 keeps 8 bits and gelu's
    slope is at most 1.13, so the rounding of the input itself (a product's sum) moves the
    result 2**10 times more. An error bounded by |x|, not by the result: in the tail (x <
    -3, gelu below 1e-3 |x|) the result may be off by several bfloat16 steps, and it is
    -0 below -GELU_BF16_CLAMP, as in oneDNN's and XNNPACK's gelu. x/2 * (1 + erf(x/sqrt2))
    with erf a rational function of x*x (fitting.gelu_bf16_coefficients) clamped to +-1:
    18 operations a vector where gelu's exp and series take 44. BERT-base's gelu in bf16
    (AMX Xeon): 2.0 of the model's 27 ms; standalone 393K values 132 -> 72 us.
    float64 takes gelu itself."""
    if dt != "float32":
        return gelu(e, dt, x)
    p, q = gelu_bf16_coefficients()
    top = e.const(GELU_BF16_CLAMP, dt)
    low = e.op("maximum", dt, e.const(-GELU_BF16_CLAMP, dt), x)  # NaN stays NaN: -top > NaN fails
    xc = e.op("minimum", dt, top, low)
    w = e.op("multiply", dt, xc, xc)
    numerator = e.op("multiply", dt, xc, _horner(e, dt, w, list(p)))
    ratio = e.op("divide", dt, numerator, _horner(e, dt, w, list(q)))
    one = e.const(1, dt)
    erf_ = e.op("minimum", dt, one, e.op("maximum", dt, e.const(-1, dt), ratio))
    # -inf and x <= -top: (-top/2) * 0 = -0, as gelu gives -0 for -inf
    return e.op("multiply", dt, e.op("multiply", dt, e.const(0.5, dt), low), e.op("add", dt, one, erf_))


def gelu_tanh(e, dt, x):
    """0.5*x*(1 + tanh(u)) computed as x * sigmoid(2u): for x << 0 the sum 1 + tanh(u)
    cancels to nothing, the sigmoid does not."""
    x3 = e.op("multiply", dt, e.op("multiply", dt, x, x), x)
    inner = e.op("multiply", dt, e.const(2 * math.sqrt(2 / math.pi), dt),
                 e.op("add", dt, x, e.op("multiply", dt, e.const(0.044715, dt), x3)))
    return e.op("multiply", dt, _finite(e, dt, x), sigmoid(e, dt, inner))


# exponents a literal may have that power computes with multiplies and square roots
# (LRN's 0.75, norms' 0.5 and -0.5, gelu_new's 3)
BY_ROOTS = frozenset({-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0})
BY_ROOTS_ULP = 4.5  # -0.75: a root (1), its root (1.5), their product (1), one over it (1)


def power(e, dt, x, y):
    """x**y as exp(y*log|x|), with C's pow rules for negative x, zeros and y == 0, and
    exact results for y in (2, 1, -1) (``x*x``, ``x``, ``1/x``), which is what C's correctly
    rounded pow returns for them, specials included. An exponent known when the code is
    made (a literal: the region's scalar constant) and in :data:`BY_ROOTS` takes
    :func:`power_by_roots` instead."""
    known = e.known(y)
    if known is not None and float(known) in BY_ROOTS:
        return power_by_roots(e, dt, x, float(known))
    mag = exp(e, dt, e.op("multiply", dt, y, log(e, dt, e.op("abs", dt, x))))
    y_int = e.op("equal", dt, e.op("floor", dt, y), y)
    half = e.op("multiply", dt, y, e.const(0.5, dt))
    y_odd = e.op("logical_and", "bool", y_int, e.op("not_equal", dt, e.op("floor", dt, half), half))
    # an odd integer power keeps the sign (-0.0 and -inf included); a finite negative base
    # to a non-integer power is NaN, but -0.0 and -inf are not negative numbers there:
    # pow(-0, 0.5) = 0, pow(-inf, 0.5) = inf
    r = e.op("select", dt, e.op("logical_and", "bool", _signbit(e, dt, x), y_odd), e.op("negative", dt, mag), mag)
    finite_neg = e.op("logical_and", "bool", e.op("less", dt, x, e.const(0, dt)),
                      e.op("greater", dt, x, e.const(-math.inf, dt)))
    r = e.op("select", dt, e.op("logical_and", "bool", finite_neg, e.op("logical_not", "bool", y_int)),
             e.const(math.nan, dt), r)
    # pow(1, y) = 1 for every y, NaN included, and pow(-1, +-inf) = 1 (exp(y*0) is NaN there)
    one = e.const(1, dt)
    unit = e.op("logical_or", "bool", e.op("equal", dt, x, one), e.op("logical_and", "bool", e.op(
        "equal", dt, x, e.const(-1, dt)), e.op("equal", dt, e.op("abs", dt, y), e.const(math.inf, dt))))
    r = e.op("select", dt, unit, one, r)
    # exponents models use most, where C's pow is exact and exp(y*log|x|) is not
    for k, exact in ((2, e.op("multiply", dt, x, x)), (1, x), (-1, e.op("divide", dt, e.const(1, dt), x))):
        r = e.op("select", dt, e.op("equal", dt, y, e.const(k, dt)), exact, r)
    return e.op("select", dt, e.op("equal", dt, y, e.const(0, dt)), e.const(1, dt), r)


def power_by_roots(e, dt, x, y: float):
    """x**y for a literal ``y`` in :data:`BY_ROOTS`: whole powers by multiplying, quarters
    by one or two square roots, a negative exponent as one division: within
    :data:`BY_ROOTS_ULP` (each correctly rounded step adds at most one ulp, the root of a
    root half its root's once more), where exp(log) takes 2*(1 + |y*ln|x||).
    Fractional exponents see -0 and -inf as +0 and +inf (C's pow: pow(-0, 0.5) = 0,
    pow(-inf, 0.75) = inf); other negative bases give sqrt's NaN."""
    if y == 0:
        return e.const(1, dt)  # pow(x, 0) = 1 for every x, NaN included
    whole, quarters = divmod(abs(y), 1.0)
    if quarters:
        unsigned = e.op("logical_or", "bool", e.op("equal", dt, x, e.const(0, dt)),
                        e.op("equal", dt, x, e.const(-math.inf, dt)))
        x = e.op("select", dt, unsigned, e.op("abs", dt, x), x)
    root = e.op("sqrt", dt, x) if quarters else None
    fourth = e.op("sqrt", dt, root) if quarters in (0.25, 0.75) else None
    factors = [x] * int(whole) + [f for f in (root if quarters != 0.25 else None, fourth) if f is not None]
    r = factors[0]
    for f in factors[1:]:
        r = e.op("multiply", dt, r, f)
    return e.op("divide", dt, e.const(1, dt), r) if y < 0 else r
