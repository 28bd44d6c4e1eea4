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
    return _cast(_op("maximum", dt, dt, _op("minimum", dt, dt, value, high), low), to)


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
    divisor = _cast(scale, dt)
    if dt == "float32" and math.prod(dims(call.args[1].ty)) == 1:  # the same for every element
        scaled = _op("round_quotient", dt, dt, x, divisor)
    else:
        scaled = _op("round", dt, dt, _op("divide", dt, dt, x, divisor))
    return _clip_cast(_op("add", dt, dt, scaled, _cast(zp, dt)), to)


@register("relax.dequantize", 3, _check_qdq)
def _build_dequantize(fe, call, out):
    q = fe.value(call.args[0])
    shape, to = dims(call.args[0].ty), str(call.attrs.out_dtype)
    scale, zp = (_param(fe, call, k, shape) for k in (1, 2))
    clipped = _quantized_float(q)
    if clipped is not None:  # the same integer, never converted to a byte and back
        diff = _recentred(clipped, _cast(zp, "float32"))
    else:
        diff = _cast(_op("subtract", "int32", "int32", _cast(q, "int32"), _cast(zp, "int32")), "float32")
    value = _op("multiply", "float32", "float32", diff, _cast(scale, "float32"))
    return value if to == "float32" else _clip_cast(value, to)


def _recentred(clipped, zp):
    """``clipped - zp`` for ``clipped = max(min(r + z, hi), lo)`` (:func:`_quantized_float`):
    where ``z`` is this ``zp``, a zero point of at most 16 bits, it is
    ``max(min(r, hi - zp), lo - zp)``, exactly (``r`` is an integer or not finite; the sums
    round only past 2**24, where both forms saturate; NaN gives ``hi - zp`` either way), and
    the bounds do not change in the loop: two instructions a quantize-dequantize pair fewer
    (ResNet-50's residual epilogues have two pairs)."""
    inner, low = clipped.args
    total, high = inner.args
    r, z = total.args
    source = z.args[0] if isinstance(z, kir.Op) and z.op == "astype" else z
    if not _same(z, zp) or source.dtype not in ("uint8", "int8", "uint16", "int16"):
        return _op("subtract", "float32", "float32", clipped, zp)
    bound = (_op("subtract", "float32", "float32", c, zp) for c in (high, low))
    return _op("maximum", "float32", "float32", _op("minimum", "float32", "float32", r, next(bound)), next(bound))


def _same(a, b) -> bool:
    """Whether two parameter reads are the same value: loads of one buffer, equal
    constants, or the same conversion of such (kir nodes compare by identity)."""
    if isinstance(a, kir.Op) and isinstance(b, kir.Op):
        return (a.op, a.dtype, a.attrs) == (b.op, b.dtype, b.attrs) and a.op == "astype" \
            and _same(a.args[0], b.args[0])
    if isinstance(a, kir.Load) and isinstance(b, kir.Load):
        return a.buf == b.buf
    return isinstance(a, kir.Const) and isinstance(b, kir.Const) and (a.value, a.dtype) == (b.value, b.dtype)


def _quantized_float(q):
    """The float32 value ``q`` casts, when ``q`` is the result of :func:`_build_quantize`
    from float32 to an 8-bit integer: an integer in the byte's range (a rounded value
    plus the zero point, clamped; the clamps' selects turn NaN into the upper bound), so
    ``float(int(q) - zp) == clamped - float(zp)`` exactly. A QDQ graph dequantizes every
    quantize it makes; in one loop that is a conversion to bytes and back per element
    saved (ResNet-50's residual epilogues have three). None for any other ``q``."""
    if not (isinstance(q, kir.Op) and q.op == "astype" and q.dtype in ("uint8", "int8")):
        return None
    v = q.args[0]
    if not (isinstance(v, kir.Op) and v.op == "maximum" and v.dtype == "float32"):
        return None
    low, inner = v.args[1], v.args[0]
    if not (isinstance(inner, kir.Op) and inner.op == "minimum" and isinstance(low, kir.Const)):
        return None
    total, high = inner.args
    info = np.iinfo(q.dtype)
    rounded = isinstance(total, kir.Op) and total.op == "add" and isinstance(total.args[0], kir.Op) \
        and total.args[0].op in ("round", "round_quotient")
    exact = isinstance(high, kir.Const) and (float(low.value), float(high.value)) == (info.min, info.max)
    return v if rounded and exact else None
