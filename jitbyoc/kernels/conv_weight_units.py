"""Convolution weights in blocks of ``J`` output channels, in units of ``group`` input
channels (:mod:`jitbyoc.engines.products`: a bfloat16 pair is one 32-bit unit): the
layout the direct-convolution engine reads, ``(K/J, Cin/group, KH[, KW], J, group)``
(``group`` 1: ``(K/J, Cin, KH[, KW], J)``).

A constant weight is packed once at build time (:mod:`jitbyoc.tvm.conv_weights`, by
:func:`pack`; its Relax form undoes the packing with :func:`unpacking_axes`). A weight
that is an input of a product in units is packed on every call, into a workspace, by
:func:`call_packed`: the engine has no other way to read a unit (two channels of one
tap lie ``KH * KW`` elements apart in OIHW).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ..engines import conv_engine
from ..engines.conv_plan import unit_channels
from ..engines.products import PRODUCTS
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64
from ..render.loops import for_range, free_workspace, workspace


def pack(value: np.ndarray, j: int, group: int = 1) -> np.ndarray:
    """An OIHW (or OIW) weight in blocks of ``j`` output channels, the last block padded
    with zero channels; in units of ``group`` input channels (``I`` a multiple of it). A
    view of ``value`` (or of its padded copy): the constant made of it is its one copy,
    written by :mod:`jitbyoc.tvm.constants`' writer threads."""
    k = value.shape[0]
    blocks = -(-k // j)
    if blocks * j != k:
        value = np.concatenate([value, np.zeros((blocks * j - k, *value.shape[1:]), value.dtype)])
    blocked = value.reshape(blocks, j, *value.shape[1:])
    if group == 1:
        return np.moveaxis(blocked, 1, -1)
    cin, spatial = value.shape[1], value.ndim - 2
    units = blocked.reshape(blocks, j, cin // group, group, *value.shape[2:])
    return units.transpose(0, 2, *range(4, 4 + spatial), 1, 3)


def unpacking_axes(ndim: int, group: int) -> list[int]:
    """The ``permute_dims`` axes that turn :func:`pack`'s blocks of an ``ndim``-D weight
    back into ``(K/j, j, I[/group, group], H[, W])``, reshaped to OIHW after."""
    if group == 1:
        return [0, ndim, *range(1, ndim)]
    spatial = ndim - 2
    return [0, 2 + spatial, 1, 3 + spatial, *range(2, 2 + spatial)]


def call_packed(stage, ctx) -> None:
    """Run ``stage`` (a :class:`~.conv2d.Conv2d` in units, its weight an OIHW input) on the
    engine, its weight packed first into a workspace: unit ``(b, u, t, j)`` holds
    channels ``group*u + e`` of output channel ``b*J + j`` at tap ``t`` (zero past the
    group's input channels, or past the output channels in the last block)."""
    b, g, dt = ctx.b, stage.geo, stage.inputs[0].dtype
    group, jb = PRODUCTS[dt].group, stage.plan.j
    units, blocks = unit_channels(g, dt), -(-g.k // jb)
    packed = workspace(ctx, PRODUCTS[dt].unit, I64(blocks * units * g.taps * jb))
    with for_range(b, I64(blocks * jb), "oc") as oc, for_range(b, I64(units * g.taps), "ut") as ut:
        u, t = b.sdiv(ut, I64(g.taps)), b.srem(ut, I64(g.taps))
        at = b.add(b.mul(b.add(b.mul(b.sdiv(oc, I64(jb)), I64(units * g.taps)), ut), I64(jb)),
                   b.srem(oc, I64(jb)))
        value = _unit(stage, ctx, oc, u, t, group)
        b.store(value, b.gep(packed, [at], source_etype=I32))
    conv_engine.call(stage, ctx, weight=packed)
    free_workspace(ctx, packed)


def _unit(stage, ctx, oc, u, t, group: int) -> ir.Value:
    """The unit of output channel ``oc``, input-channel unit ``u``, tap ``t``: its
    ``group`` weights side by side (zeros outside the weight)."""
    b, g, w = ctx.b, stage.geo, stage.inputs[1]
    element = lookup_dtype(w.dtype).ir  # bfloat16 as its 16 bits
    value = I32(0)
    for e in range(group):
        ic = b.add(b.mul(u, I64(group)), I64(e))
        inside = b.and_(b.icmp_signed("<", ic, I64(g.cg)), b.icmp_signed("<", oc, I64(g.k)))
        safe = b.add(b.mul(b.add(b.mul(b.select(inside, oc, I64(0)), I64(g.cg)), b.select(inside, ic, I64(0))),
                           I64(g.taps)), t)
        bits = b.zext(b.select(inside, ctx.load(w, safe), element(0)), I32)
        value = b.or_(value, b.shl(bits, I32(element.width * e)))
    return value

