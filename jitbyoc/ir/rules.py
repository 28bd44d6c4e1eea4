"""The rule registry: one :class:`Rule` per Relax op jitbyoc can take.

A rule says whether a Relax call can be taken (``check``: the reason it cannot, or None)
and how it becomes kernel IR (``build``), as JAX's lowering registry does for its
primitives. Elementwise rows of :data:`jitbyoc.ir.ops.OPS` with a ``relax`` name generate
their rules here; each kernel file in ``jitbyoc/kernels/`` registers its own with
:func:`register`. Patterns (:mod:`jitbyoc.tvm.patterns`), the lowering
(:mod:`jitbyoc.lower`) and the offload report all read this one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm.ir.prim import FloatImm, IntImm

from . import kir
from .dtypes import DTYPES
from .ops import OPS, OpDef
from .relax_types import broadcast_problem, dims, tensor_problem


@dataclass(frozen=True)
class Rule:
    relax: str  # the Relax op name
    arity: int  # the least operand count the pattern matches (optional trailing ones match too)
    check: Callable  # (call) -> str | None: why jitbyoc leaves the call to TVM
    # Kernels: (lowering, call, out) -> a KernelStage or a list of them, where ``out`` is
    # the result's Buffer (a tuple of Buffers for a tuple result, as split makes); a
    # builder may return the value itself instead (a kir node or a tuple of nodes, e.g. a
    # Load of a view), and ``out`` is dropped. Elementwise rules: (lowering, call, result
    # type) -> a kir.Op.
    build: Callable
    anchor: bool = False  # a heavy kernel: a region holds at most one (jitbyoc.tvm.merge)
    elementwise: bool = False  # builds an expression, never a stage or a buffer
    # its place in the composite patterns anchor (+ bias) (+ activation): "anchor", "bias",
    # "activation" or "" (jitbyoc.tvm.patterns generates them from these)
    composite: str = ""


RULES: dict[str, Rule] = {}
# Kernel-level rewrites run after lowering and epilogue fusion, in order: (kernel) -> None.
REWRITES: list[Callable] = []


def add(rule: Rule) -> Rule:
    if rule.relax in RULES:
        raise ValueError(f"jitbyoc: two rules for {rule.relax}")
    RULES[rule.relax] = rule
    return rule


def register(relax: str, arity: int, check: Callable, anchor: bool = False, composite: str = ""):
    """Decorator for the builder of a kernel's rule for Relax op ``relax``."""
    def wrap(build):
        add(Rule(relax, arity, check, build, anchor=anchor, composite=composite))
        return build
    return wrap


def rewrite(fn: Callable) -> Callable:
    """Decorator: run ``fn(kernel)`` on every lowered kernel."""
    REWRITES.append(fn)
    return fn


def anchor_ops() -> frozenset:
    return frozenset(name for name, rule in RULES.items() if rule.anchor)


def composite_ops(place: str) -> list[str]:
    """The Relax ops whose rules take ``place`` ("anchor", "bias", "activation") in the
    composite patterns, in registration order."""
    return [name for name, rule in RULES.items() if rule.composite == place]


def why_not(call) -> str | None:
    """Why jitbyoc leaves a Relax call to TVM, or None if it takes it."""
    op = getattr(call.op, "name", None)
    rule = RULES.get(op)
    if rule is None:
        return f"no jitbyoc rule for {op or type(call.op).__name__}"
    try:
        return rule.check(call)
    except Exception as err:  # a malformed call is TVM's to handle, never a crash here
        return f"{op}: not analysable ({type(err).__name__}: {err})"


# ---- elementwise rules, generated from the op table -----------------------------------------

def _elementwise_check(row: OpDef) -> Callable:
    def check(call) -> str | None:
        op = call.op.name
        if not all(isinstance(a, (FloatImm, IntImm)) for a in call.args[row.arity:]):
            return f"{op}: {', '.join(row.scalars)} not constants"
        operands = call.args[:row.arity]
        data = operands[1:] if row.condition else operands
        if row.condition and str(getattr(operands[0].ty, "dtype", "")) != "bool":
            return f"{op}: the condition is not bool"
        for k, arg in enumerate(operands):
            problem = tensor_problem(arg.ty, DTYPES if row.condition and k == 0 else row.dtypes)
            if problem:
                return f"{op}: {problem}"
        mixed = {str(a.ty.dtype) for a in data}
        if len(mixed) > 1:  # Relax lets comparisons mix dtypes; the rules take one
            return f"{op}: operands have different dtypes {sorted(mixed)}"
        problem = tensor_problem(call.ty, DTYPES)
        if problem:
            return f"{op} result: {problem}"
        for arg in operands:
            problem = broadcast_problem(dims(arg.ty), dims(call.ty))
            if problem:
                return f"{op}: {problem}"
        return None
    return check


def _elementwise_build(name: str, row: OpDef) -> Callable:
    def build(fe, call, out_ty) -> kir.Op:
        args = tuple(fe.value(a) for a in call.args[:row.arity])
        in_dtype = args[-1].dtype if row.condition else args[0].dtype
        return kir.Op(name, args, in_dtype, str(out_ty.dtype), tuple(sorted(row.relax_attrs(call).items())))
    return build


for _name, _row in OPS.items():
    if _row.relax:
        add(Rule(_row.relax, _row.arity + len(_row.scalars), _elementwise_check(_row),
                 _elementwise_build(_name, _row), elementwise=True, composite=_row.composite))
