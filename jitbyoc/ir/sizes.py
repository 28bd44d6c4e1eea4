"""Compound symbolic sizes: ``s + 1``, ``s * 2``, ``min(s, 4)``, ``s // 2``...

A dim that is an expression of symbolic sizes becomes a *derived size* of its region: a
name of its own (``sym3``) with a definition over the region's plain sizes, a tree of
``(op, a, b)`` tuples whose leaves are ints and size names. The entry binds the plain
sizes from the argument shapes, computes each derived one from them, and checks every
dim against it, like any size; kernels only ever see names. One table says what each
operator means in Python (checks and folding), C and LLVM.

Division and remainder are TVM's floor forms; only by a positive constant (a symbolic
divisor could be 0 at run time), anything else stays with TVM.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from tvm.ir import prim

from .llvmtypes import I64


class SizeOp(NamedTuple):
    python: object  # (a, b) -> int
    c: object  # (a, b) -> C expression text (operands already rendered)
    llvm: object  # (builder, a, b) -> i64 value
    shown: str  # the user's view, format with {a} {b}


def _floordiv_c(a: str, b: str) -> str:  # b is a positive constant
    return f"(({a}) >= 0 ? ({a}) / {b} : -((-({a}) + {b} - 1) / {b}))"


def _floor_parts(b: ir.IRBuilder, x, y) -> tuple:
    """Division by a positive constant ``y``: the truncated quotient and remainder, and
    whether the remainder is negative (the floor is then one further down)."""
    q, r = b.sdiv(x, y), b.srem(x, y)
    return q, r, b.icmp_signed("<", r, I64(0))


def _floordiv_llvm(b: ir.IRBuilder, x, y):
    q, _, down = _floor_parts(b, x, y)
    return b.select(down, b.sub(q, I64(1)), q)


def _floormod_llvm(b: ir.IRBuilder, x, y):
    _, r, down = _floor_parts(b, x, y)
    return b.select(down, b.add(r, y), r)


def _instruction_llvm(name: str):
    return lambda b, x, y: getattr(b, name)(x, y)


def _pick_llvm(cmp: str):
    """min (``<``) or max (``>``): the operand that wins the signed compare."""
    return lambda b, x, y: b.select(b.icmp_signed(cmp, x, y), x, y)


SIZE_OPS: dict[str, SizeOp] = {
    "add": SizeOp(lambda a, b: a + b, lambda a, b: f"({a} + {b})", _instruction_llvm("add"), "{a} + {b}"),
    "sub": SizeOp(lambda a, b: a - b, lambda a, b: f"({a} - {b})", _instruction_llvm("sub"), "{a} - {b}"),
    "mul": SizeOp(lambda a, b: a * b, lambda a, b: f"({a} * {b})", _instruction_llvm("mul"), "{a} * {b}"),
    "min": SizeOp(min, lambda a, b: f"(({a}) < ({b}) ? ({a}) : ({b}))", _pick_llvm("<"), "min({a}, {b})"),
    "max": SizeOp(max, lambda a, b: f"(({a}) > ({b}) ? ({a}) : ({b}))", _pick_llvm(">"), "max({a}, {b})"),
    "floordiv": SizeOp(lambda a, b: a // b, _floordiv_c, _floordiv_llvm, "{a} // {b}"),
    "floormod": SizeOp(lambda a, b: a % b, lambda a, b: f"(({a}) - {_floordiv_c(a, b)} * {b})",
                       _floormod_llvm, "{a} % {b}"),
}
_PRIM_OPS = {prim.Add: "add", prim.Sub: "sub", prim.Mul: "mul", prim.Min: "min", prim.Max: "max",
             prim.FloorDiv: "floordiv", prim.FloorMod: "floormod"}


_COMMUTATIVE = frozenset({"add", "mul", "min", "max"})


def _order(tree) -> tuple:
    """Operands of a commutative op in one order: sizes, then trees, then constants."""
    return (0 if isinstance(tree, str) else 2 if isinstance(tree, int) else 1, repr(tree))


def from_prim(expr, leaf):
    """``expr`` (a TVM PrimExpr) as a tree, its variables mapped by ``leaf`` (to an int,
    a name or a tree); None if it holds anything else. Constant parts are folded."""
    if isinstance(expr, prim.IntImm):
        return int(expr)
    op = _PRIM_OPS.get(type(expr))
    if op is None:
        return leaf(expr)
    a, b = from_prim(expr.a, leaf), from_prim(expr.b, leaf)
    if a is None or b is None:
        return None
    if op in ("floordiv", "floormod") and not (isinstance(b, int) and b > 0):
        return None  # a divisor that could be 0 at run time
    if op in _COMMUTATIVE and _order(b) < _order(a):  # 4 * n and n * 4: one size (Swin's dims)
        a, b = b, a
    return SIZE_OPS[op].python(a, b) if isinstance(a, int) and isinstance(b, int) else (op, a, b)


def names_in(tree) -> set[str]:
    if isinstance(tree, tuple):
        return names_in(tree[1]) | names_in(tree[2])
    return {tree} if isinstance(tree, str) else set()


def evaluate(tree, env: dict[str, int]) -> int:
    if isinstance(tree, tuple):
        return SIZE_OPS[tree[0]].python(evaluate(tree[1], env), evaluate(tree[2], env))
    return env[tree] if isinstance(tree, str) else tree


def shown(tree, names: dict[str, str]) -> str:
    """The tree as the user reads it, sizes by their names."""
    if isinstance(tree, tuple):
        return "(" + SIZE_OPS[tree[0]].shown.format(a=shown(tree[1], names), b=shown(tree[2], names)) + ")"
    return names.get(tree, tree) if isinstance(tree, str) else str(tree)


def emit_c(tree) -> str:
    if not isinstance(tree, tuple):
        return str(tree) if isinstance(tree, str) else f"INT64_C({tree})"
    return SIZE_OPS[tree[0]].c(emit_c(tree[1]), emit_c(tree[2]))


def emit_llvm(b: ir.IRBuilder, tree, syms: dict) -> ir.Value:
    if not isinstance(tree, tuple):
        return syms[tree] if isinstance(tree, str) else I64(tree)
    return SIZE_OPS[tree[0]].llvm(b, emit_llvm(b, tree[1], syms), emit_llvm(b, tree[2], syms))
