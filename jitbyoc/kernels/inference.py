"""Ops that are elementwise expressions at inference: ``nn.prelu`` and ``nn.dropout``.

prelu is ``x > 0 ? x : alpha[c] * x`` with ``alpha`` broadcast along ``axis`` (TVM's
``topi.nn.prelu``; a NaN input gives NaN). Inference dropout is the identity: TVM's own
lowering returns ``(x, ones_like(x))``, and so does jitbyoc, as values, so no copy is
made and the op disappears into the loop nest around it.
"""

from __future__ import annotations

from ..ir import kir
from ..ir.dtypes import FLOATS
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
    problem = tensor_problem(call.args[0].ty, FLOATS)
    return f"relax.nn.dropout: {problem}" if problem else None


@register("relax.nn.dropout", 1, _check_dropout)
def _build_dropout(fe, call, out):
    return fe.value(call.args[0]), kir.Const(1, out[1].dtype)
