"""Reduction kinds (``sum``, ``prod``, ``max``, ``min``): one table says what each starts
from and how it combines an accumulator with an element, in LLVM and in C.

Every kernel that folds (reductions, norms, fused attention's per-row folds) and both
renderers' ``reduce`` read :data:`FOLDS`; a new kind is a row here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .dtypes import dtype as lookup_dtype
from .llvmtypes import declare
from .ops import wrapping_c


@dataclass(frozen=True)
class Fold:
    """One reduction kind (a row of :data:`FOLDS`)."""
    identity: float  # what a fold starts from; an infinite one stands for an integer dtype's end
    op: str  # the op table's row that combines two values (explicit vector folds)
    llvm: Callable  # (b, d, acc, x) -> acc combined with x, reassociable so LLVM may vectorize
    c: Callable  # (d, acc, x) -> the same as a C expression


def _arith_llvm(float_op: str, int_op: str) -> Callable:
    def rule(b, d, acc, x):
        if d.is_float:
            return getattr(b, float_op)(acc, x, flags=("reassoc",))
        return getattr(b, int_op)(acc, x)
    return rule


def _extreme_llvm(cmp: str, intrinsic: str) -> Callable:
    """Float max/min by ``llvm.maximum``/``llvm.minimum``, which propagate a NaN."""
    def rule(b, d, acc, x):
        if d.is_float:
            fn = declare(b.module, f"llvm.{intrinsic}.f{d.bits}", d.ir, [d.ir, d.ir])
            return b.call(fn, [acc, x])
        compare = b.icmp_signed if d.signed else b.icmp_unsigned
        return b.select(compare(cmp, acc, x), acc, x)
    return rule


def _extreme_c(cmp: str) -> Callable:
    """The C twin of :func:`_extreme_llvm`: an accumulated NaN is kept (a NaN element
    fails the compare and is taken)."""
    def rule(d, acc, x):
        if d.is_float:
            return f"(({acc} != {acc} || {acc} {cmp} {x}) ? {acc} : {x})"
        return f"({acc} {cmp} {x} ? {acc} : {x})"
    return rule


FOLDS = {
    # integers wrap, as LLVM's add and mul do
    "sum": Fold(0, "add", _arith_llvm("fadd", "add"), wrapping_c("+")),
    "prod": Fold(1, "multiply", _arith_llvm("fmul", "mul"), wrapping_c("*")),
    "max": Fold(float("-inf"), "maximum", _extreme_llvm(">", "maximum"), _extreme_c(">")),
    "min": Fold(float("inf"), "minimum", _extreme_llvm("<", "minimum"), _extreme_c("<")),
}


def identity(kind: str, dt: str):
    """The value a ``kind`` fold of ``dt`` starts from: the table's, or for an integer
    max/min the end of the dtype's range (its lowest for max, highest for min)."""
    d, value = lookup_dtype(dt), FOLDS[kind].identity
    if d.is_float or math.isfinite(value):
        return value
    lo, hi = (-(1 << (d.bits - 1)), (1 << (d.bits - 1)) - 1) if d.signed else (0, (1 << d.bits) - 1)
    return lo if value < 0 else hi
