"""Calls a frontend emitted as tensor expressions, lifted back to the Relax ops they are.

TVM's ONNX frontend writes ``Clip`` as ``bb.emit_te(topi.maximum, x, lo)`` then
``topi.minimum``, and ``Pad`` and ``Conv``'s ``auto_pad`` as ``topi.nn.pad``: a
``call_tir`` of a PrimFunc, which no rule can take, so each ReLU6 of an ONNX MobileNet
ended its convolution's region and ran as two more passes over the tensor in TVM. A
``call_tir`` whose PrimFunc is named after a row of :data:`LIFTS` becomes that row's op
where legalizing the op on the same operands gives a structurally equal PrimFunc: TVM
would run that very PrimFunc for the op, so the values are the same by construction. An
op's parameters the call does not carry are read off the PrimFunc and then checked the
same way: a scalar it holds as an immediate (``Clip`` before opset 11: ``topi.maximum(x,
0.0)``; a pad's value), a pad's widths from the offsets it reads its input at.
``Clip``'s bounds, ``where(isnan(c), -inf, c)`` of a constant ``c``
(:func:`sanitized_constant`), are constants here, as a runtime's session folds them.
"""

from __future__ import annotations

import re

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir import Op
from tvm.ir.expr import TensorLoad

from ..memo import LRU
from .constants import constant as _constant

CALL_TIR = Op.get("relax.call_tir")
TRIGGERS = frozenset({"relax.call_tir"})
ISNAN, WHERE = Op.get("relax.isnan"), Op.get("relax.where")


def lifted_call(call: relax.Call, mod: tvm.IRModule, lookup):
    """``call`` (a ``call_tir``) as the Relax op its PrimFunc computes, or None."""
    callee, args = call.args[0], call.args[1]
    candidates = LIFTS.get(re.sub(r"\d+$", "", getattr(callee, "name_hint", "")))
    prim = mod.functions.get(callee) if isinstance(callee, tvm.ir.GlobalVar) else None
    if candidates is None or len(call.args) != 2 or not isinstance(args, relax.Tuple) \
            or not isinstance(prim, tirx.PrimFunc):
        return None
    operands = list(args.fields)
    if not all(isinstance(a.ty, relax.TensorType) for a in operands):
        return None
    for key, make in candidates(prim, operands, call.ty):
        if tvm_ffi.structural_equal(_legalized(key, make, operands), prim, map_free_vars=True):
            return make(*(sanitized_constant(a, lookup) or a for a in operands))
    return None


def _binary(op):
    """Candidates for a binary op: on the call's two operands, or on its one and each
    immediate of the PrimFunc as a scalar constant (which the legalization writes
    into its PrimFunc)."""
    def candidates(prim, operands, _ty):
        if len(operands) == 2:
            yield (op,), op
        elif len(operands) == 1:
            dtype = str(operands[0].ty.dtype)
            for value in _immediates(prim, dtype):
                yield (op, value), lambda a, v=value, d=dtype: op(a, relax.const(np.array(v, d), d))
    return candidates


def _padded(prim, operands, ty):
    """Candidates for a constant pad (``Conv``'s ``auto_pad`` and ONNX's ``Pad``): the
    widths before each axis read off the offsets the PrimFunc reads its input at, those
    after from the shapes, the value one of its immediates."""
    if len(operands) != 1:
        return
    before, sizes = _read_offsets(prim), [_static(operands[0].ty.shape), _static(getattr(ty, "shape", None))]
    if before is None or None in sizes or len(before) != len(sizes[0]):
        return
    widths = [w for b, n, m in zip(before, *sizes) for w in (b, m - n - b)]
    if min(widths) < 0:
        return
    for value in _immediates(prim, str(operands[0].ty.dtype)):
        yield ("pad", tuple(widths), value), lambda a, v=value: relax.op.nn.pad(a, widths, pad_value=v)


LIFTS = {"maximum": _binary(relax.op.maximum), "minimum": _binary(relax.op.minimum),  # Clip
         "pad": _padded}  # a PrimFunc's name (its TOPI function's) -> its candidate ops


def _immediates(prim: tirx.PrimFunc, dtype: str) -> list:
    """The immediates of ``dtype`` in ``prim``'s body, in order."""
    found: list = []
    tvm_ffi.structural_walk(prim.body, ((tirx.FloatImm, tirx.IntImm), found.append))
    return sorted({f.value for f in found if str(f.ty.dtype) == dtype})


def _read_offsets(prim: tirx.PrimFunc) -> list[int] | None:
    """``c`` for each index ``v - c`` (or ``v``) the first read of ``prim``'s first
    parameter uses; None if an index is anything else."""
    loads: list = []
    tvm_ffi.structural_walk(prim.body, ((TensorLoad,), loads.append))
    load = next((x for x in loads if prim.params and x.source.same_as(prim.params[0])), None)
    if load is None:
        return None
    offsets = [0 if isinstance(i, tirx.Var) else int(i.b.value) if isinstance(i, tirx.Sub)
               and isinstance(i.a, tirx.Var) and isinstance(i.b, tirx.IntImm) else None for i in load.indices]
    return None if None in offsets else offsets


def _static(shape) -> list[int] | None:
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(v, tirx.IntImm) for v in values):
        return None
    return [int(v.value) for v in values]


def _legalized(key: tuple, make, operands: list) -> tirx.PrimFunc | None:
    """The PrimFunc TVM's legalization gives ``make(*operands)`` (operands as parameters
    of their types); ``key`` says what ``make`` makes."""
    key = (*key, tuple(str(a.ty) for a in operands))
    prim = _LEGALIZED.get(key, _MISSING)
    if prim is _MISSING:
        params = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(operands)]
        bb = relax.BlockBuilder()
        try:
            with bb.function("f", params):
                bb.emit_func_output(bb.emit(make(*params)))
            prims = [f for f in relax.transform.LegalizeOps()(bb.get()).functions.values()
                     if isinstance(f, tirx.PrimFunc)]
        except Exception:  # noqa: BLE001 - a candidate TVM rejects is not the call's op
            prims = []
        prim = prims[0] if len(prims) == 1 else None
        _LEGALIZED.put(key, prim)
    return prim


_LEGALIZED = LRU(256)  # (what, operand types) -> its PrimFunc (pure)
_MISSING = object()


def sanitized_constant(expr, lookup):
    """``expr`` as a constant where it is (a variable bound to) ``where(isnan(c), k, c)``
    of scalar constants ``c`` and ``k``, as ``Clip`` bounds reach Relax; else None."""
    call = lookup(expr) if isinstance(expr, relax.Var) else None
    if not (isinstance(call, relax.Call) and call.op.same_as(WHERE)):
        return None
    test = lookup(call.args[0]) if isinstance(call.args[0], relax.Var) else call.args[0]
    if not (isinstance(test, relax.Call) and test.op.same_as(ISNAN)):
        return None
    c, k = _constant(test.args[0]), _constant(call.args[1])
    otherwise = c if call.args[2].same_as(test.args[0]) else _constant(call.args[2])
    if c is None or k is None or otherwise is None or c.ndim or k.ndim \
            or not np.array_equal(otherwise, c, equal_nan=True):
        return None
    return relax.const(np.where(np.isnan(c), k, c).astype(c.dtype), str(c.dtype))


def without_lifted(mod: tvm.IRModule, functions: dict) -> dict:
    """``functions`` (``mod``'s, rewritten) without the private PrimFuncs ``mod``'s Relax
    functions called that none of theirs calls any more: the calls lifted were their
    only use, and TVM would compile them for nothing."""
    called = _called(mod.functions.values())
    still = _called(functions.values())
    return {gv: f for gv, f in functions.items()
            if not (isinstance(f, tirx.PrimFunc) and gv in called and gv not in still
                    and "global_symbol" not in (f.attrs or {}))}


def _called(functions) -> set:
    """The global variables the Relax functions among ``functions`` refer to."""
    found: set = set()
    for func in functions:
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func.body, lambda e: found.add(e) if isinstance(e, tvm.ir.GlobalVar) else None)
    return found
