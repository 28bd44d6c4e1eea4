"""``round(x / s)`` with a divisor the same for every element of a loop (a quantize's
per-tensor scale), exactly as the division rounds, without dividing in the common case.

A float32 ``quantize`` is ``clip(round(x / scale) + zp)`` (TVM's legalization). On a CPU
with two 512-bit ports a division costs what eight other vector instructions do
(``vdivps``: about 8 cycles a vector on the AMX Xeon, against 0.5 for a multiply), and a
quantized ResNet-50 residual epilogue has three: the divider bounded the loop.

The row ``round_quotient`` computes ``q = x * y`` with ``y = 1/s`` rounded (one division
per loop, which LLVM hoists where ``s`` does not change in the loop), and ``n = round(q)``.
``q`` is within ``|q| * 2**-22`` of ``x / s`` rounded, whenever ``s`` and ``y`` are normal
numbers (``2**-126 <= |s| <= 2**125``): ``y`` and the product each round once, by at most
``2**-24`` relative, and ``x / s`` rounded moves another ``2**-24``. So ``n`` is what
``round(x / s)`` gives unless ``q`` lies that close to a half-integer, where the rounding of
the true quotient decides: a vector with such a lane (``|q - n| + |q| * 2**-21 >= 0.5``, or
not a number: ``x`` or ``q`` infinite or NaN) takes the division after all, on all its
lanes. Elsewhere (``s`` zero, subnormal, huge, infinite or NaN) every vector divides.
With ``|q|`` below a few hundred, a lane divides with probability about ``|q| * 2**-20``.
The result equals ``round(x / s)`` for every ``x`` and ``s`` (``tests/test_quotients.py``
checks ties, near-ties, zeros of both signs, infinities, NaN and extreme scales against
numpy). C renders the division itself.

The rows ``round_product`` and ``round_clamped_product`` are the same roundings of ``x *
(1 / s)``, with no test: a product's requantization (:func:`reordered`), where ``x`` is
already a float sum taken in another order than TVM's build takes it (an int8 product
standing for the float product of dequantized operands), as onnxruntime's and oneDNN's
int8 kernels requantize with one multiplier. Against ``round(x / s)`` the result moves by
at most one step, and only where ``x / s`` lies within ``|x / s| * 2**-22`` of a
half-integer (``s`` normal); both renderers compute the same product.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from . import kir
from .llvmtypes import I1, declare

MARGIN = 2.0 ** -21  # twice q's bound relative to |q|: the fma's own rounding stays inside it
NORMAL = (2.0 ** -126, 2.0 ** 125)  # |s| where s and 1/s are normal float32 numbers


def reference(x, s):
    """numpy's ``round(x / s)``, half to even (what ``nearbyint`` gives)."""
    with np.errstate(all="ignore"):
        return np.round(np.divide(x, s))


def quantized(x, scale, zp, to: str):
    """``clip(round(x / scale) + zp)`` in float32 (float32 ``x`` and ``scale``), then the
    cast to ``to``: TVM's legalized ``quantize`` in numpy."""
    info = np.iinfo(to)
    rounded = reference(x, scale) + zp.astype(np.float32)
    return np.clip(rounded, np.float32(info.min), np.float32(info.max)).astype(to)


def _call(b, name: str, dt, *xs):
    suffix = f"{f'v{dt.lanes}' if dt.lanes > 1 else ''}f{dt.bits}"
    return b.call(declare(b.module, f"llvm.{name}.{suffix}", dt.ir, [dt.ir] * len(xs)), xs)


def _const(dt, value: float):
    return ir.Constant(dt.ir, value)


def _any(b, lanes: ir.Value, dt) -> ir.Value:
    if dt.lanes == 1:
        return lanes
    fn = declare(b.module, f"llvm.vector.reduce.or.v{dt.lanes}i1", I1, [ir.VectorType(I1, dt.lanes)])
    return b.call(fn, [lanes])


def round_quotient_llvm(b: ir.IRBuilder, dt, x, s):
    """``nearbyint(x / s)`` of float32 scalars or vectors (see the module docstring); other
    dtypes divide."""
    if dt.bits != 32:
        return _call(b, "nearbyint", dt, b.fdiv(x, s))
    q = _times_reciprocal(b, dt, x, s)
    n = _call(b, "nearbyint", dt, q)
    weight = b.select(_normal(b, dt, s), _const(dt, MARGIN), _const(dt, math.inf))  # inf: every lane divides
    slack = _call(b, "fma", dt, _call(b, "fabs", dt, q), weight, _call(b, "fabs", dt, b.fsub(q, n)))
    clear = b.fcmp_ordered("<", slack, _const(dt, 0.5))  # false for NaN: 0 * inf, or q not finite
    return _unless_unclear(b, dt, clear, n, lambda: _call(b, "nearbyint", dt, b.fdiv(x, s)))


def clamped_reference(x, s, lo, hi):
    """numpy's ``round(clamp(x / s, lo, hi))``: the clamp is ``max(min(v, hi), lo)`` with
    TVM's selects (NaN gives ``hi``)."""
    with np.errstate(all="ignore"):
        return _clamped_round(np.divide(x, s), lo, hi)


def _clamped_round(v, lo, hi):
    """``round(max(min(v, hi), lo))`` with TVM's selects, in numpy."""
    v = np.where(v < hi, v, hi)
    return np.round(np.where(v > lo, v, lo)).astype(v.dtype)


def clamped_c(x, s, lo, hi, value=lambda x, s: f"({x} / {s})") -> str:
    """C's ``clamp(x / s, lo, hi)`` with the selects of :func:`clamped_reference` (or of
    another ``value(x, s)``)."""
    v = value(x, s)
    low = f"({v} < {hi} ? {v} : {hi})"
    return f"({low} > {lo} ? {low} : {lo})"


def round_clamped_quotient_llvm(b: ir.IRBuilder, dt, x, s, lo, hi):
    """``nearbyint(clamp(x / s, lo, hi))`` (:func:`clamped_reference`) of float32 scalars
    or vectors, ``lo <= hi`` integers; other dtypes divide.

    A quantize to 8 or 16 bits clamps its quotient to the integers its zero point can
    reach (``lo - zp, hi - zp``) before rounding, where TVM clips after adding ``zp``: the
    same result, and every ``q`` the test sees is at most ``B = max(|lo|, |hi|)`` in size,
    so the test is ``|c - round(c)| < 0.5 - B * 2**-21`` against a bound the loop does not
    change, two instructions fewer than the general row's (and the dequantize that reads
    the byte back needs no clamp of its own). Why it is exact: where ``q`` is inside the
    bounds it is within ``B * 2**-22`` of ``x / s`` rounded (the module docstring), so
    both clamp to values that round alike; where ``q`` is past a bound, ``x / s`` rounded
    is past it too or within ``B * 2**-22`` of it, and both round to the bound. A NaN
    clamps to ``hi`` either way and takes no division. ``B > 2**20`` or ``s`` outside the
    normal range: every vector divides."""
    if dt.bits != 32:
        return _call(b, "nearbyint", dt, _clamp(b, b.fdiv(x, s), lo, hi))
    c = _clamp(b, _times_reciprocal(b, dt, x, s), lo, hi)
    n = _call(b, "nearbyint", dt, c)
    size = _call(b, "maxnum", dt, _call(b, "fabs", dt, lo), _call(b, "fabs", dt, hi))
    usable = b.and_(_normal(b, dt, s), b.fcmp_ordered("<=", size, _const(dt, 2.0 ** 20)))
    threshold = b.select(usable, b.fsub(_const(dt, 0.5), b.fmul(size, _const(dt, MARGIN))), _const(dt, -1.0))
    clear = b.fcmp_ordered("<", _call(b, "fabs", dt, b.fsub(c, n)), threshold)
    return _unless_unclear(b, dt, clear, n,
                           lambda: _call(b, "nearbyint", dt, _clamp(b, b.fdiv(x, s), lo, hi)))


def product_reference(x, s):
    """numpy's ``round(x * (1 / s))`` in float32, half to even."""
    with np.errstate(all="ignore"):
        return np.round(_product(x, s))


def clamped_product_reference(x, s, lo, hi):
    """numpy's ``round(clamp(x * (1 / s), lo, hi))`` (the clamp of :func:`clamped_reference`)."""
    with np.errstate(all="ignore"):
        return _clamped_round(_product(x, s), lo, hi)


def _product(x, s):
    """``x * (1 / s)`` in float32, each step rounded."""
    return np.multiply(x, np.divide(np.float32(1), s, dtype=np.float32), dtype=np.float32)


def product_c(x, s) -> str:
    return f"({x} * (1.0f / {s}))"


def round_product_llvm(b: ir.IRBuilder, dt, x, s):
    """``nearbyint(x * (1 / s))`` of float32 scalars or vectors (``1 / s`` hoisted where
    ``s`` does not change in the loop)."""
    return _call(b, "nearbyint", dt, _times_reciprocal(b, dt, x, s))


def round_clamped_product_llvm(b: ir.IRBuilder, dt, x, s, lo, hi):
    """``nearbyint(clamp(x * (1 / s), lo, hi))`` with :func:`clamped_c`'s selects."""
    return _call(b, "nearbyint", dt, _clamp(b, _times_reciprocal(b, dt, x, s), lo, hi))


def _times_reciprocal(b, dt, x, s):
    """``x * (1 / s)``: one division a loop where ``s`` does not change in it."""
    return b.fmul(x, b.fdiv(_const(dt, 1.0), s))


def _clamp(b, v, lo, hi):
    """``max(min(v, hi), lo)`` with TVM's selects (NaN gives ``hi``)."""
    v = b.select(b.fcmp_ordered("<", v, hi), v, hi)
    return b.select(b.fcmp_ordered(">", v, lo), v, lo)


# the source name of the span that marks an integer product standing for a float product
# of dequantized operands (:func:`jitbyoc.tvm.quantized.reordered_sums`): the lowering
# rounds the requantizations in its epilogue as products (:func:`reordered`)
REORDERED = "jitbyoc_reordered_sums"
# a quotient row -> its product row (:func:`reordered`)
PRODUCT_ROWS = {"round_quotient": "round_product", "round_clamped_quotient": "round_clamped_product"}


def marks_reordered(span) -> bool:
    """Whether a Relax call's ``span`` is the :data:`REORDERED` mark."""
    return span is not None and span.source_name.name == REORDERED


def reordered(roots: list) -> list:
    """``roots`` (an epilogue of a product whose sums stand for a float sum taken in
    another order) with every exactly rounded quotient rounded as a product instead."""
    return kir.renamed(roots, PRODUCT_ROWS)


def _normal(b, dt, s):
    """Whether ``s`` and ``1 / s`` are normal numbers (false for NaN)."""
    size = _call(b, "fabs", dt, s)
    return b.and_(b.fcmp_ordered(">=", size, _const(dt, NORMAL[0])),
                  b.fcmp_ordered("<=", size, _const(dt, NORMAL[1])))


def _unless_unclear(b, dt, clear, fast_value, exact):
    """``fast_value``, or ``exact()`` computed in a branch LLVM is told is unlikely where
    any lane is not ``clear``."""
    fast = b.block
    with b.if_then(_any(b, b.not_(clear), dt), likely=False):
        slow_value = exact()
        slow = b.block
    result = b.phi(dt.ir)
    result.add_incoming(fast_value, fast)
    result.add_incoming(slow_value, slow)
    return result
