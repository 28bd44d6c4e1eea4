"""Functions of one byte as 256-entry tables: a chain of elementwise ops from one uint8
or int8 tensor to a ``quantize`` is looked up, not computed.

onnxruntime's QDQ graphs wrap every op of an activation in its own quantize/dequantize
pair. GELU, as ``torch.onnx.export`` writes it, becomes::

    y = quantize(dequantize(quantize(dequantize(q) * 0.5)) * dequantize(quantize(
        dequantize(quantize(erf(dequantize(quantize(dequantize(q) / 1.414)))) + 1)))

seven divisions and an ``erf`` per element, and the result is a function of the byte
``q`` alone. Such a chain ``f`` becomes ``take(f(arange), q)``: the same ops on the 256
values a byte can hold, then one lookup per element (what TFLite's int8 activations and
onnxruntime's ``QLinearLookupBase`` do). The table is computed by the same ops on every
call (256 elements), so the result is the chain's own, bit for bit, on any backend.

A chain qualifies when every op in it is an elementwise op of :data:`jitbyoc.ir.ops.OPS`
(or a per-tensor quantize/dequantize) whose other operands are one-element constants, its
only variable input is the one byte tensor, and it does more than one cheap op: a
single ``relu`` or rescale between two quantized tensors stays arithmetic.
"""

from __future__ import annotations

import functools

import numpy as np
from tvm import relax
from tvm.ir import Op

from ..ir.ops import OPS
from ..ir.relax_types import dims
from .channel_tables import BYTES, CHEAP, channel_table_lookup
from .constants import constant
from .inference import bound_value

QUANTIZE, DEQUANTIZE, TAKE = (Op.get(f"relax.{name}") for name in ("quantize", "dequantize", "take"))
ELEMENTWISE = frozenset(row.relax for row in OPS.values() if row.relax) | {"relax.quantize", "relax.dequantize"}


def _scalar(expr, lookup, depth: int = 4) -> bool:
    """Whether ``expr`` is one element computed from constants alone (a constant, or a
    rank-0 ``dequantize`` of one: a QDQ graph's scale factors)."""
    shape = dims(getattr(expr, "ty", None))
    if shape is None or any(d != 1 for d in shape):
        return False
    value = bound_value(expr, lookup)
    if constant(value) is not None:
        return True
    return depth > 0 and isinstance(value, relax.Call) and isinstance(value.op, Op) \
        and value.op.name in ELEMENTWISE and all(_scalar(a, lookup, depth - 1) for a in value.args)


def _chain(expr, lookup, shape, nodes: dict):
    """The one byte tensor ``expr`` (of ``shape``) is a function of, through elementwise
    ops with one-element constant operands, each recorded in ``nodes``; ``expr`` itself
    when it is a byte tensor made otherwise; None when it is neither."""
    if dims(expr.ty) != shape:
        return None
    call, inner = bound_value(expr, lookup), {}
    leaf = _through(expr, call, lookup, shape, inner) if isinstance(call, relax.Call) else None
    if leaf is not None:
        nodes.update(inner)
        return leaf
    return expr if str(getattr(expr.ty, "dtype", "")) in BYTES else None


def _through(expr, call: relax.Call, lookup, shape, nodes: dict):
    """:func:`_chain` of the operands of ``call`` (bound to ``expr``) that are not
    one-element constants: the one byte tensor behind them all, or None."""
    name = call.op.name if isinstance(call.op, Op) else ""
    if call.op.same_as(TAKE):
        operands = call.args[1:] if _a_table(call) else None
    elif name in ("relax.quantize", "relax.dequantize"):
        operands = call.args[:1] if all(_scalar(a, lookup) for a in call.args[1:]) else None
    else:
        operands = call.args if name in ELEMENTWISE else None
    found = set()
    for arg in operands or ():
        if not _scalar(arg, lookup):
            found.add(_chain(arg, lookup, shape, nodes))
    if operands is None or len(found) != 1 or None in found:
        return None
    nodes[expr] = call
    return found.pop()


def _a_table(take: relax.Call) -> bool:
    """Whether ``take`` looks a byte up in a table made here (so the chain goes on through
    it: a table of a table is a table)."""
    return take.attrs.axis is not None and int(take.attrs.axis) == 0 and dims(take.args[0].ty) == [256]


def table_lookup(call: relax.Call, lookup, emit):
    """``call`` (a quantize) as a lookup in a table of its byte (:func:`byte_table_lookup`)
    or of its byte and channel (:func:`.channel_tables.channel_table_lookup`), or None."""
    found = byte_table_lookup(call, lookup, emit)
    return found if found is not None else channel_table_lookup(call, lookup, emit)


def byte_table_lookup(call: relax.Call, lookup, emit):
    """``take(f(arange), q)`` for ``call``, a per-tensor ``quantize`` to a byte of a chain
    ``f(q)`` that qualifies (module doc); None otherwise."""
    to = str(call.attrs.out_dtype)
    if to not in BYTES or not all(_scalar(a, lookup) for a in call.args[1:]):
        return None
    data = call.args[0]
    shape = dims(data.ty)
    nodes: dict = {}
    leaf = None if shape is None else _chain(data, lookup, shape, nodes)
    if leaf is None or dims(leaf.ty) != shape or not _worth_a_table(nodes.values()):
        return None
    first = int(np.iinfo(str(leaf.ty.dtype)).min)
    memo = {leaf: _every_byte(str(leaf.ty.dtype))}
    table = emit(_on_every_byte(call, nodes, memo, emit))
    index = relax.op.astype(leaf, "int32")
    if first:
        index = relax.op.subtract(emit(index), relax.const(first, "int32"))
    return relax.op.take(table, emit(index), axis=0, mode="clip")


@functools.cache
def _every_byte(dtype: str) -> relax.Constant:
    """The 256 values of ``dtype`` (uint8 or int8) in order: one constant, shared."""
    first = int(np.iinfo(dtype).min)
    return relax.const(np.arange(first, first + 256).astype(dtype))


def _worth_a_table(calls) -> bool:
    names = [c.op.name for c in calls]
    return "relax.quantize" in names or any(n not in CHEAP for n in names)


def _on_every_byte(call: relax.Call, nodes: dict, memo: dict, emit) -> relax.Call:
    """``call`` with the chain's byte tensor replaced (through ``memo``) by the 256 bytes."""
    def rebuilt(expr):
        if expr not in memo:
            inner = nodes.get(expr)
            memo[expr] = expr if inner is None else emit(_on_every_byte(inner, nodes, memo, emit))
        return memo[expr]

    args = [rebuilt(a) for a in call.args]
    if call.op.same_as(QUANTIZE) or call.op.same_as(DEQUANTIZE):  # per tensor: any axis
        make = relax.op.quantize if call.op.same_as(QUANTIZE) else relax.op.dequantize
        return make(*args, axis=-1, out_dtype=str(call.attrs.out_dtype))
    return relax.Call(call.op, args, call.attrs, call.ty_args)
