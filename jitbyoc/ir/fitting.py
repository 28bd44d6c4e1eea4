"""Polynomial approximations fitted at import time, in 90-digit decimal arithmetic: the
coefficients :mod:`jitbyoc.ir.vecmath` evaluates for erf and gelu (Chebyshev
interpolation of the exact function, truncated where the dropped terms are below an
eighth of an ulp, then turned into a power series for Horner's rule), and one rational
function, gelu_bf16's erf, fitted by least squares in float64 (its bound is 2**-19, far
above float64's rounding). Nothing here emits code; every function is deterministic and
cached.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal, localcontext
from functools import lru_cache

import numpy as np

_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640629")
_TINY = Decimal("1e-88")  # relative size of the last series term kept at 90 digits


def scaled_erfc(x: Decimal) -> Decimal:
    """erfc(x) * exp(x**2) for x >= 0, to about 70 digits (call in a 90-digit context).

    ``math.erfc(x) * math.exp(x * x)`` is off by up to 15 ulp (``x * x`` is rounded before
    ``exp`` amplifies it). Up to 6 this sums erf's series of positive terms,
    ``erf(x) = 2/sqrt(pi) exp(-x**2) sum(2**n x**(2n+1) / (1*3*...*(2n+1)))`` (losing 17
    digits to ``exp(x**2) - 2/sqrt(pi) sum`` is harmless at 90); past 6 it evaluates the
    continued fraction ``1/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))``.
    """
    if x > 6:
        acc = x
        for k in range(400, 0, -1):
            acc = x + Decimal(k) / 2 / acc
        return 1 / (_PI.sqrt() * acc)
    x2 = x * x
    term = total = x
    k = 1
    while term > total * _TINY:
        term = term * 2 * x2 / (2 * k + 1)
        total += term
        k += 1
    return x2.exp() - 2 / _PI.sqrt() * total


def _cos(x: Decimal) -> Decimal:
    x2, term, total, k = x * x, Decimal(1), Decimal(1), 0
    while abs(term) > _TINY:
        k += 2
        term = -term * x2 / (k * (k - 1))
        total += term
    return total


def chebyshev(f, lo: float, hi: float, n: int = 64) -> list[Decimal]:
    """Chebyshev coefficients of ``f`` (Decimal -> Decimal) on [lo, hi], interpolated at
    ``n`` nodes in 90-digit decimal arithmetic, so none is lost to rounding."""
    with localcontext(Context(prec=90)):
        ts = [_cos(_PI * (j + Decimal("0.5")) / n) for j in range(n)]
        fs = [f((t * Decimal(hi - lo) + Decimal(hi + lo)) / 2) for t in ts]
        prev, cur = [Decimal(1)] * n, list(ts)
        coeffs = [sum(fs) / n]
        for _ in range(1, n):
            coeffs.append(2 * sum(v * t for v, t in zip(fs, cur)) / n)
            prev, cur = cur, [2 * t * c - p for t, c, p in zip(ts, cur, prev)]
        return coeffs


def _power_series(cheb: list[Decimal], lo: float, hi: float) -> list[Decimal]:
    """The coefficients in x of ``sum(c_k T_k(u))``, u = (2x - lo - hi)/(hi - lo): Horner's
    rule then costs 2 ops a term where Clenshaw's recurrence costs 3."""
    with localcontext(Context(prec=90)):
        span = Decimal(hi - lo) / 2
        u0, u1 = -Decimal(hi + lo) / 2 / span, 1 / span  # u = u0 + u1*x
        out = [cheb[0]] + [Decimal(0)] * (len(cheb) - 1)
        t_prev, t_cur = [Decimal(1)], [u0, u1]  # T_0, T_1 as polynomials in x
        for c in cheb[1:]:
            for i, v in enumerate(t_cur):
                out[i] += c * v
            t_next = [2 * u0 * v for v in t_cur] + [Decimal(0)]  # T_{k+1} = 2u T_k - T_{k-1}
            for i, v in enumerate(t_cur):
                t_next[i + 1] += 2 * u1 * v
            for i, v in enumerate(t_prev):
                t_next[i] -= v
            t_prev, t_cur = t_cur, t_next
        return out


def _fit(f, lo: float, hi: float, dt: str, floor: Decimal, n: int) -> tuple[float, ...]:
    """Power-series coefficients (in x) of the shortest truncation of f's Chebyshev
    interpolant on [lo, hi] (n nodes) whose dropped terms add up to less than ``floor``."""
    cheb = chebyshev(f, lo, hi, n)
    keep = next((k for k in range(2, n) if sum(abs(c) for c in cheb[k:]) < floor), None)
    if keep is None:
        raise ValueError(f"{n} Chebyshev nodes are too few for {dt}")
    return tuple(_rounded(float(c), dt) for c in _power_series(cheb[:keep], lo, hi))


def _rounded(v: float, dt: str) -> float:
    return float(np.array(v, dt))


# erfc(a)*exp(a*a), a = s*x (erf: s = 1; gelu: s = 1/sqrt2 and x gelu's input), is
# w*G(u) for x in [lo, hi], w = c/(x + k) and u = p - w, which maps [lo, hi] onto [-1, 1]:
# w carries the function's 1/x decay, so G(u), a polynomial, varies little and Horner's
# rule does not cancel (a polynomial in x or 1/x would need far more terms, or cancel).
# k trades terms for accuracy: the rounding of x + k reaches the result amplified by
# |d ln erfcx(s*x)/dx| * (x + k), 0.8*k near x = 0, so a small k is more accurate and a
# large one needs fewer terms (gelu float32: 15 terms at k = 1, 12 at 2, 11 at 3).
# lo: erf's polynomial takes over below. hi: erf has rounded to 1 (erfc(hi) < eps/4);
# gelu's exact result is below tiny*|x| and, for -inf, exp(-hi*hi/2) rounds to 0.
ERFCX = {  # (use, dtype) -> (s**2, lo, hi, k)
    ("erf", "float32"): (1, 0.625, 4.0, 2.0),
    ("erf", "float64"): (1, 0.875, 6.0, 3.0),
    ("gelu", "float32"): (0.5, 0.0, 14.5, 2.0),
    ("gelu", "float64"): (0.5, 0.0, 38.75, 3.0),
}


@lru_cache(maxsize=None)
def erfcx_coefficients(use: str, dt: str) -> tuple[tuple[float, ...], float, float, float]:
    """(power series of G in u, p, c, k) for ``ERFCX[use, dt]``; p, c and k are rounded
    to ``dt`` first and G fits the map they make, so only evaluation rounds. gelu's G
    includes the 1/2 of erfc(-x/sqrt2)/2."""
    s2, lo, hi, k = ERFCX[use, dt]
    k = _rounded(k, dt)
    p = _rounded((hi + lo + 2 * k) / (hi - lo), dt)
    c = _rounded((p + 1) * (lo + k), dt)
    eps = Decimal(float(np.finfo(dt).eps))
    with localcontext(Context(prec=90)):
        s, half = Decimal(s2).sqrt(), Decimal("0.5") if use == "gelu" else Decimal(1)
        dp, dc, dk = Decimal(p), Decimal(c), Decimal(k)
        f = lambda u: half * scaled_erfc(s * (dc / (dp - u) - dk)) / (dp - u)
        floor = eps / 8 * min(f(Decimal(-1)), f(Decimal(1)))
    return _fit(f, -1.0, 1.0, dt, floor, 24 if dt == "float32" else 48), p, c, k


@lru_cache(maxsize=None)
def erf_coefficients(dt: str) -> tuple[float, ...]:
    """Power series in x*x of erf(x)/x for |x| below lo of ``ERFCX['erf', dt]``."""
    lo = ERFCX["erf", dt][1]
    eps = Decimal(float(np.finfo(dt).eps))

    def f(w):  # erf(x)/x = 2/sqrt(pi) sum (-w)**n / (n! (2n+1)), w = x*x
        term, total, n = Decimal(1), Decimal(1), 0
        while abs(term) > _TINY:
            n += 1
            term = -term * w / n
            total += term / (2 * n + 1)
        return 2 / _PI.sqrt() * total
    with localcontext(Context(prec=90)):
        floor = eps / 8 * f(Decimal(lo * lo))
    return _fit(f, 0.0, lo * lo, dt, floor, 16 if dt == "float32" else 24)


# gelu for a result rounded to bfloat16 (vecmath.gelu_bf16): erf(x/sqrt2) = x*P(x*x)/Q(x*x)
# for |x| <= GELU_BF16_CLAMP, P and Q of degree 4; past the clamp erf is +-1 (erfc(5/sqrt2)/2
# = 2.9e-7). At the clamp the ratio is 1 + 2**-22, so clamped to 1 it is exactly 1 there.
GELU_BF16_CLAMP = 5.0
_RATIONAL_DEGREES = (4, 4)


@lru_cache(maxsize=None)
def gelu_bf16_coefficients() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(P, Q) in powers of w = x*x, Q[0] = 1: the rational fit of erf(x/sqrt2)/x on
    [0, clamp], by linearized least squares (each round weights the residual P - f*Q by
    x/Q of the round before, Loeb's iteration toward the error in erf; 600 Chebyshev nodes
    in w, float64 numpy: the fit is good to 2**-20 of |x| in gelu, far above float64's
    rounding), with the value at the clamp held at 1 + 2**-22."""
    n, (dp, dq), top = 600, _RATIONAL_DEGREES, GELU_BF16_CLAMP
    span = top * top
    t = (1 - np.cos(np.pi * (np.arange(n) + 0.5) / n)) / 2  # w / span
    x = np.sqrt(t * span)
    f = np.array([math.erf(v / math.sqrt(2)) / v for v in x])
    q_before, over = np.ones(n), 1 + 2.0 ** -22
    tie = np.concatenate([top * np.ones(dp + 1), -over * np.ones(dq)])  # top*P(span) = over*Q(span)
    for _ in range(12):
        weight = np.maximum(x, 0.05) / q_before
        powers_p = np.vander(t, dp + 1, increasing=True)
        powers_q = np.vander(t, dq + 1, increasing=True)[:, 1:]
        rows = np.hstack([powers_p, -f[:, None] * powers_q])
        system = np.vstack([rows * weight[:, None], 1e4 * tie])
        sol = np.linalg.lstsq(system, np.append(f * weight, 1e4 * over), rcond=None)[0]
        q = np.concatenate([[1.0], sol[dp + 1:]])
        q_before = np.polynomial.polynomial.polyval(t, q)
    scale = span ** -np.arange(max(dp, dq) + 1)
    return tuple(float(v) for v in sol[:dp + 1] * scale[:dp + 1]), tuple(float(v) for v in q * scale[:dq + 1])
