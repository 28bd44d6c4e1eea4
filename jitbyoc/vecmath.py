"""Vectorizable transcendental functions, written once over an emitter.

LLVM lowers ``llvm.exp.*`` to scalar ``expf`` calls, which stop the loop vectorizer, and
C's libm differs between machines. So exp, log, tanh, erf and friends are expanded here
into table ops (add, mul, floor, select, bitcast, shifts) that both renderers emit the
same way. ``e.op(name, dtype, *values, **attrs)`` emits a row of :mod:`jitbyoc.ops`;
``e.const(value, dtype)`` a literal. No fused multiply-add is used, so the C and LLVM
renderings round identically.

Error bounds against the exact function, checked by ``tests/test_vecmath.py`` on dense
grids: exp, log <= 2 ulp; tanh, sigmoid, erf <= 4 ulp away from zeros of the result
(absolute error <= 4 ulp of 1 near them); gelu, silu <= 8 ulp; power <= 64 ulp
(``exp(y*log|x|)`` amplifies the error of log by ``|y*log x|``). Results that would be
subnormal in exp may be flushed: ``exp(x)`` for ``x < -87.3`` (float32) is within
1.2e-38 of the exact value.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from functools import lru_cache

import numpy as np

getcontext().prec = 50
_LN2 = Decimal(2).ln()

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
    """coeffs[0] + x*(coeffs[1] + x*(...))."""
    acc = e.const(coeffs[-1], dt)
    for c in reversed(coeffs[:-1]):
        acc = e.op("add", dt, e.op("multiply", dt, acc, x), e.const(c, dt))
    return acc


def _isnan(e, dt, x):
    return e.op("not_equal", dt, x, x)


def _pow2(e, dt, n):
    """2**n as a float of dtype ``dt``, for an integer n in the normal exponent range."""
    it, mant, bias, *_ = _F[dt]
    bits = e.op("shl", it, e.op("add", it, n, e.const(bias, it)), e.const(mant, it))
    return e.op("bitcast", it, bits)


def _exp_parts(e, dt, x):
    """(n, p) with exp(x) = 2**n * (1 + p) and p = expm1(r), |r| <= ln2/2."""
    it, _, _, lo, hi, deg = _F[dt]
    x = e.op("select", dt, _isnan(e, dt, x), e.const(0, dt), x)
    x = e.op("minimum", dt, e.op("maximum", dt, x, e.const(lo, dt)), e.const(hi, dt))
    ln2_hi, ln2_lo = _split_ln2(dt)
    t = e.op("floor", dt, e.op("add", dt, e.op("multiply", dt, x, e.const(1 / math.log(2), dt)),
                               e.const(0.5, dt)))
    r = e.op("subtract", dt, e.op("subtract", dt, x, e.op("multiply", dt, t, e.const(ln2_hi, dt))),
             e.op("multiply", dt, t, e.const(ln2_lo, dt)))
    p = e.op("multiply", dt, r, _horner(e, dt, r, [1 / math.factorial(k) for k in range(1, deg + 1)]))
    return e.op("astype", dt, t, to=it), p


def _ldexp(e, dt, y, n):
    """y * 2**n, split in two factors so both stay normal over the clamped range."""
    it = _F[dt][0]
    n1 = e.op("shr", it, n, e.const(1, it))
    n2 = e.op("subtract", it, n, n1)
    return e.op("multiply", dt, e.op("multiply", dt, y, _pow2(e, dt, n1)), _pow2(e, dt, n2))


def exp(e, dt, x):
    n, p = _exp_parts(e, dt, x)
    y = _ldexp(e, dt, e.op("add", dt, p, e.const(1, dt)), n)
    return e.op("select", dt, _isnan(e, dt, x), x, y)


def expm1(e, dt, x):
    n, p = _exp_parts(e, dt, x)
    y = e.op("add", dt, _ldexp(e, dt, p, n),
             e.op("subtract", dt, _ldexp(e, dt, e.const(1, dt), n), e.const(1, dt)))
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


def _copysign(e, dt, x, y):
    """|y| with the sign of x (y >= 0)."""
    return e.op("select", dt, e.op("less", dt, x, e.const(0, dt)), e.op("negative", dt, y), y)


def tanh(e, dt, x):
    ax = e.op("minimum", dt, e.op("abs", dt, x), e.const(10.0 if dt == "float32" else 20.0, dt))
    u = expm1(e, dt, e.op("add", dt, ax, ax))
    t = e.op("divide", dt, u, e.op("add", dt, u, e.const(2, dt)))
    return _copysign(e, dt, x, t)


def sigmoid(e, dt, x):
    one = e.const(1, dt)
    return e.op("divide", dt, one, e.op("add", dt, one, exp(e, dt, e.op("negative", dt, x))))


def silu(e, dt, x):
    return e.op("multiply", dt, x, sigmoid(e, dt, x))


@lru_cache(maxsize=None)
def erf_coefficients(dt: str) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Taylor coefficients of erf(x)/x in x**2 on |x| < 1, and Chebyshev coefficients of
    erfc(x)*exp(x**2) on [1, cut]; past ``cut`` erf rounds to +-1 in ``dt``."""
    eps = float(np.finfo(dt).eps)
    cut = 4.0 if dt == "float32" else 6.0
    taylor, n = [], 0
    while True:
        c = 2 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1))
        taylor.append(c)
        if abs(c) < eps / 8:
            break
        n += 1

    def scaled_erfc(t):
        x = (t * (cut - 1) + (cut + 1)) / 2
        return np.array([math.erfc(v) * math.exp(v * v) for v in np.atleast_1d(x)])

    grid = np.linspace(-1, 1, 2001)
    exact = scaled_erfc(grid)
    for deg in range(4, 60):
        cheb = np.polynomial.chebyshev.chebinterpolate(scaled_erfc, deg)
        if np.max(np.abs(np.polynomial.chebyshev.chebval(grid, cheb) - exact) / exact) < eps / 4:
            break
    return tuple(taylor), tuple(float(c) for c in cheb), cut


def _clenshaw(e, dt, t, cheb):
    b1, b2 = e.const(0, dt), e.const(0, dt)
    t2 = e.op("add", dt, t, t)
    for c in reversed(cheb[1:]):
        b1, b2 = e.op("add", dt, e.op("subtract", dt, e.op("multiply", dt, t2, b1), b2),
                      e.const(c, dt)), b1
    return e.op("add", dt, e.op("subtract", dt, e.op("multiply", dt, t, b1), b2), e.const(cheb[0], dt))


def erf(e, dt, x):
    taylor, cheb, cut = erf_coefficients(dt)
    small = e.op("multiply", dt, x, _horner(e, dt, e.op("multiply", dt, x, x), list(taylor)))
    ax = e.op("minimum", dt, e.op("abs", dt, x), e.const(cut, dt))
    t = e.op("divide", dt, e.op("subtract", dt, e.op("add", dt, ax, ax), e.const(cut + 1, dt)),
             e.const(cut - 1, dt))
    tail = e.op("multiply", dt, exp(e, dt, e.op("negative", dt, e.op("multiply", dt, ax, ax))),
                _clenshaw(e, dt, t, cheb))
    large = _copysign(e, dt, x, e.op("subtract", dt, e.const(1, dt), tail))
    return e.op("select", dt, e.op("less", dt, e.op("abs", dt, x), e.const(1, dt)), small, large)


def gelu(e, dt, x):
    half = e.const(0.5, dt)
    er = erf(e, dt, e.op("multiply", dt, x, e.const(math.sqrt(0.5), dt)))
    return e.op("multiply", dt, x, e.op("add", dt, half, e.op("multiply", dt, er, half)))


def gelu_tanh(e, dt, x):
    x3 = e.op("multiply", dt, e.op("multiply", dt, x, x), x)
    inner = e.op("multiply", dt, e.const(math.sqrt(2 / math.pi), dt),
                 e.op("add", dt, x, e.op("multiply", dt, e.const(0.044715, dt), x3)))
    one = e.const(1, dt)
    return e.op("multiply", dt, e.op("multiply", dt, e.const(0.5, dt), x),
                e.op("add", dt, one, tanh(e, dt, inner)))


def power(e, dt, x, y):
    """x**y as exp(y*log|x|), with C's pow rules for negative x, zeros and y == 0."""
    mag = exp(e, dt, e.op("multiply", dt, y, log(e, dt, e.op("abs", dt, x))))
    y_int = e.op("equal", dt, e.op("floor", dt, y), y)
    half = e.op("multiply", dt, y, e.const(0.5, dt))
    y_odd = e.op("logical_and", "bool", y_int, e.op("not_equal", dt, e.op("floor", dt, half), half))
    neg = e.op("less", dt, x, e.const(0, dt))
    signed = e.op("select", dt, y_odd, e.op("negative", dt, mag), mag)
    r = e.op("select", dt, neg, e.op("select", dt, y_int, signed, e.const(math.nan, dt)), mag)
    return e.op("select", dt, e.op("equal", dt, y, e.const(0, dt)), e.const(1, dt), r)
