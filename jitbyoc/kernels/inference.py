"""Ops that are elementwise expressions at inference: ``nn.prelu``, ``nn.dropout``,
``quantize`` and ``dequantize``.

prelu is ``x > 0 ? x : alpha[c] * x`` with ``alpha`` broadcast along ``axis`` (TVM's
``topi.nn.prelu``; a NaN input gives NaN). Inference dropout is the identity: TVM's own
lowering returns ``(x, ones_like(x))``, and so does jitbyoc, as values, so no copy is
made and the op disappears into the loop nest around it.

quantize and dequantize follow TVM's legalization (``legalize_ops/qdq.py``) step for
step, per-tensor or per-channel (``axis``): ``clip(round(x / scale) + zp)`` in float, then
the cast; ``(int32(q) - zp) * scale`` in float32 (clipped and cast for another float).
A float32 quantize with one scale rounds ``x / scale`` through the ``round_quotient`` row
(:mod:`jitbyoc.ir.quotients`): the same values, by a multiply where the rounding is clear.
To 8 or 16 bits it clamps first, ``round(clamp(x / scale, min - zp, max - zp)) + zp``
(the ``round_clamped_quotient`` row, or a clamped division per channel): the same values,
a cheaper test, and no clamp in a dequantize that reads it back in the same loop.
"""

from __future__ import annotations

import math

import numpy as np

from ..ir import kir
from ..ir.dtypes import BF16, FLOATS, HALF, INTS
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from .layout import reshaped


def _check_prelu(call) -> str | None:
    x, alpha = call.args
    for what, ty in (("input", x.ty), ("alpha", alpha.ty), ("result", call.ty)):
        problem = tensor_problem(ty, FLOATS)
        if problem:
            return f"relax.nn.prelu {what}: {problem}"
    shape, slopes = dims(x.ty), dims(alpha.ty)
    if not shape or len(slopes) != 1 or str(alpha.ty.dtype) != str(x.ty.dtype):
        return "relax.nn.prelu: expects a ranked input and a 1-D alpha of its dtype"
    axis = int(call.attrs.axis) % len(shape)
    if slopes[0] not in (1, shape[axis]):
        return f"relax.nn.prelu: alpha of length {slopes[0]} does not match dim {axis} ({shape[axis]})"
    return None


@register("relax.nn.prelu", 2, _check_prelu)
def _build_prelu(fe, call, out):
    x, alpha = call.args
    shape, dt = dims(x.ty), str(x.ty.dtype)
    axis = int(call.attrs.axis) % len(shape)
    slope = reshaped(fe, alpha, (dims(alpha.ty)[0],) + (1,) * (len(shape) - axis - 1))
    value = fe.value(x)
    positive = kir.Op("greater", (value, kir.Const(0, dt)), dt, "bool")
    return kir.Op("select", (positive, value, kir.Op("multiply", (slope, value), dt, dt)), dt, dt)


def _check_dropout(call) -> str | None:
    problem = tensor_problem(call.args[0].ty, FLOATS | HALF | BF16)  # a move: any float
    return f"relax.nn.dropout: {problem}" if problem else None


@register("relax.nn.dropout", 1, _check_dropout)
def _build_dropout(fe, call, out):
    return fe.value(call.args[0]), kir.Const(1, out[1].dtype)


def _op(name: str, in_dt: str, out_dt: str, *args, **attrs):
    return kir.Op(name, args, in_dt, out_dt, tuple(sorted(attrs.items())))


def _cast(value, to: str):
    return value if value.dtype == to else _op("astype", value.dtype, to, value, to=to)


def _param(fe, call, k: int, shape):
    """Scale or zero point ``k`` broadcast along the op's axis (a per-channel vector), or
    as it is (a scalar or a single element)."""
    arg = call.args[k]
    if len(dims(arg.ty)) == 1 and dims(arg.ty)[0] != 1:
        axis = int(call.attrs.axis) % len(shape)
        return reshaped(fe, arg, (dims(arg.ty)[0],) + (1,) * (len(shape) - axis - 1))
    return reshaped(fe, arg, ()) if dims(arg.ty) else fe.value(arg)


def _clip_cast(value, to: str):
    """TVM's clip_cast: clamp to ``to``'s range in the value's dtype, then cast."""
    info = np.iinfo(to) if to in INTS else np.finfo(to)
    dt = value.dtype
    low, high = kir.Const(float(info.min) if dt in FLOATS else int(info.min), dt), \
        kir.Const(float(info.max) if dt in FLOATS else int(info.max), dt)
    return _cast(_clamp(value, low, high), to)


def _clamp(value, low, high):
    """TVM's clip, ``max(min(value, high), low)`` (NaN gives ``high``), in the value's dtype."""
    dt = value.dtype
    return _op("maximum", dt, dt, _op("minimum", dt, dt, value, high), low)


def _check_qdq(call) -> str | None:
    x, scale, zp = call.args
    name, out = call.op.name, str(call.attrs.out_dtype)
    quantize = name == "relax.quantize"
    data_types, out_types = (FLOATS, INTS) if quantize else (INTS, FLOATS)
    problem = tensor_problem(x.ty, data_types) or tensor_problem(scale.ty, {"float32"}) or \
        tensor_problem(zp.ty, INTS) or tensor_problem(call.ty, out_types)
    if problem or out not in out_types:
        return f"{name}: {problem or f'out_dtype {out}'}"
    shape = dims(x.ty)
    for p in (scale, zp):
        n = dims(p.ty)
        along = shape[int(call.attrs.axis) % len(shape)] if shape else 1  # a scalar: one of each
        if len(n) > 1 or (n and n[0] not in (1, along)):
            return f"{name}: scale/zero point of shape {n} for {shape or 'a scalar'}"
    return None


@register("relax.quantize", 3, _check_qdq)
def _build_quantize(fe, call, out):
    x = fe.value(call.args[0])
    shape, dt, to = dims(call.args[0].ty), x.dtype, str(call.attrs.out_dtype)
    scale, zp = (_param(fe, call, k, shape) for k in (1, 2))
    divisor, offset = _cast(scale, dt), _cast(zp, dt)
    one_divisor = dt == "float32" and math.prod(dims(call.args[1].ty)) == 1  # the same for every element
    if dt == "float32" and _narrow(to) and _narrow(zp.dtype):  # clamped first: the same values
        info = np.iinfo(to)
        lo, hi = (_op("subtract", dt, dt, kir.Const(float(v), dt), offset) for v in (info.min, info.max))
        if one_divisor:
            scaled = _op("round_clamped_quotient", dt, dt, x, divisor, lo, hi)
        else:
            scaled = _op("round", dt, dt, _clamp(_op("divide", dt, dt, x, divisor), lo, hi))
        return _cast(_op("add", dt, dt, scaled, offset), to)
    if one_divisor:
        scaled = _op("round_quotient", dt, dt, x, divisor)
    else:
        scaled = _op("round", dt, dt, _op("divide", dt, dt, x, divisor))
    return _clip_cast(_op("add", dt, dt, scaled, offset), to)


def _narrow(dtype: str) -> bool:
    """An integer of at most 16 bits: a zero point and the type's bounds, and their
    differences, are exact in float32."""
    return dtype in INTS and np.iinfo(dtype).bits <= 16


@register("relax.dequantize", 3, _check_qdq)
def _build_dequantize(fe, call, out):
    q = fe.value(call.args[0])
    shape, to = dims(call.args[0].ty), str(call.attrs.out_dtype)
    scale, zp = (_param(fe, call, k, shape) for k in (1, 2))
    diff = _dequantized_quantize(q, _cast(zp, "float32"))
    if diff is None:
        diff = _cast(_op("subtract", "int32", "int32", _cast(q, "int32"), _cast(zp, "int32")), "float32")
    value = _op("multiply", "float32", "float32", diff, _cast(scale, "float32"))
    return value if to == "float32" else _clip_cast(value, to)


def _dequantized_quantize(q, zp):
    """``float32(int32(q) - zp)`` without converting to the integer and back, when ``q`` is
    a float32 quantize to 8 or 16 bits clamped first (:func:`_build_quantize`):
    ``astype(r + z)`` with ``r`` an integer in ``[lo - z, hi - z]``, so ``r + z`` is the
    integer exactly and ``r + z - zp`` is ``r + 0`` where ``zp`` is ``z`` (the add makes
    the rounding's -0 the +0 the integers give). A QDQ graph dequantizes every quantize
    it makes; in one loop that is a conversion to the integer and back per element saved,
    and its clamp (ResNet-50's residual epilogues have two pairs). None for any other
    ``q``."""
    if not (isinstance(q, kir.Op) and q.op == "astype" and _narrow(q.dtype)):
        return None
    total = q.args[0]
    if not (isinstance(total, kir.Op) and total.op == "add" and total.dtype == "float32"):
        return None
    r, z = total.args
    if not _clamped_to(r, np.iinfo(q.dtype), z):
        return None
    if not _same(z, zp):
        return _op("subtract", "float32", "float32", total, zp)
    return _op("add", "float32", "float32", r, kir.Const(0.0, "float32"))  # -0 (a small negative x) is +0


def _clamped_to(r, info, z) -> bool:
    """Whether ``r`` is a rounded quotient :func:`_build_quantize` clamped to
    ``[info.min - z, info.max - z]``."""
    if isinstance(r, kir.Op) and r.op == "round_clamped_quotient":
        low, high = r.args[2:]
    elif isinstance(r, kir.Op) and r.op == "round" and isinstance(r.args[0], kir.Op) \
            and r.args[0].op == "maximum" and isinstance(r.args[0].args[0], kir.Op) \
            and r.args[0].args[0].op == "minimum":
        low, high = r.args[0].args[1], r.args[0].args[0].args[1]
    else:
        return False
    return all(isinstance(v, kir.Op) and v.op == "subtract" and isinstance(v.args[0], kir.Const)
               and float(v.args[0].value) == bound and _same(v.args[1], z)
               for v, bound in ((low, info.min), (high, info.max)))


def _same(a, b) -> bool:
    """Whether two parameter reads are the same value: loads of one buffer, equal
    constants, or the same conversion of such (kir nodes compare by identity)."""
    if isinstance(a, kir.Op) and isinstance(b, kir.Op):
        return (a.op, a.dtype, a.attrs) == (b.op, b.dtype, b.attrs) and a.op == "astype" \
            and _same(a.args[0], b.args[0])
    if isinstance(a, kir.Load) and isinstance(b, kir.Load):
        return a.buf == b.buf
    return isinstance(a, kir.Const) and isinstance(b, kir.Const) and (a.value, a.dtype) == (b.value, b.dtype)
