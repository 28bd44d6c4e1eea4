"""The LLVM types every renderer, rule and engine shares, and :func:`declare`.

A leaf module (llvmlite only), so the op table, the renderers and the engines all take
these from one place.
"""

from __future__ import annotations

from llvmlite import ir

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
PTR = ir.PointerType()


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's builder does not spell: only the operand type
    of the dot-product intrinsics (``<32 x bfloat>``), reached by a bitcast of bits."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


BFLOAT = _BFloat()


def declare(module: ir.Module, name: str, ret, args, var_arg: bool = False) -> ir.Function:
    """The function ``name`` of ``module``, declared ``ret(args...)`` on first use."""
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args, var_arg), name)
