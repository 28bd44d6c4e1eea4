"""Build-time packing of constant convolution weights (frontends hand weights over as
constants; onnxruntime and oneDNN reorder them the same way, once).

The direct-convolution engine (:mod:`jitbyoc.engines.conv_engine`) multiplies a vector of
pixels by the weights of ``J`` output channels at a time, one tap after another. Read
from OIHW, those ``J`` weights lie ``Cin/groups * KH * KW`` elements apart: ``J`` pointers
live across the tap loop (spilled with J = 16) and ``J`` cache lines per tap. Packed here
into blocks of ``J`` channels, ``P[K/J, Cin/groups, KH, KW, J]``, a tap's weights are one
contiguous run behind one pointer.

In Relax the packed weight reads ``reshape(permute_dims(P, [0, 4, 1, 2, 3]), W.shape)``
(``[0, 3, 1, 2]`` for conv1d; a last block padded with zero channels is sliced off with
``strided_slice``), so a build that leaves the convolution to TVM still computes the
same thing; jitbyoc's convolution reads ``P`` in place
(:func:`jitbyoc.kernels.fold_permutes.fold_conv_weights`). This runs after the rewrites
of :mod:`.prepare` (batch norm folds into a convolution's weight first).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir import Op

from ..engines.products import PRODUCTS
from ..ir.rules import why_not
from ..kernels import conv_panels, winograd
from ..kernels.conv2d import conv_geometry, engine_plan
from ..kernels.conv_weight_units import pack, unpacking_axes
from .constants import constant, filled_constant, tensor_constant

CONVS = (Op.get("relax.nn.conv2d"), Op.get("relax.nn.conv1d"))


def engine_block(call: relax.Call) -> int:
    """The ``J`` of the engine jitbyoc will run ``call`` (a normalized conv) on, when it
    will and ``J`` divides the output channels of a group or there is one group (its last
    block is padded); else 0 (the matrix product and the depthwise kernel read OIHW)."""
    dt = str(call.args[0].ty.dtype)  # the product
    if dt not in PRODUCTS or why_not(call) is not None:
        return 0
    geo = conv_geometry(call)
    plan = engine_plan(geo, dt)
    if plan is None or geo.cg % PRODUCTS[dt].group:  # units of channels must not straddle groups
        return 0
    return plan.j if geo.kg % plan.j == 0 or geo.groups == 1 else 0


def packed_conv(call: relax.Call, lookup, emit) -> relax.Call | None:
    """``call`` (a normalized conv whose weight is a constant) reading its weight packed
    for the engine (:func:`pack`), or None when it runs elsewhere, its weight is not a
    constant, or it is packed already."""
    weight = call.args[1]
    bound = lookup(weight) if isinstance(weight, relax.Var) else weight
    value = constant(bound)
    j = 0 if value is None else engine_block(call)
    if not j:
        return None
    d, group = value.ndim, PRODUCTS[str(call.args[0].ty.dtype)].group
    packed = pack(value, j, group)
    unpacked = emit(relax.op.permute_dims(tensor_constant(packed), unpacking_axes(d, group)))
    weight = emit(relax.op.reshape(unpacked, (packed.shape[0] * j, *value.shape[1:])))
    if packed.shape[0] * j != value.shape[0]:  # the padding channels sliced off
        weight = emit(relax.op.strided_slice(weight, [0], [0], [value.shape[0]], assume_inbound=True))
    return relax.Call(call.op, [call.args[0], weight], call.attrs, span=call.span)


def tap_major_conv(call: relax.Call, lookup, emit) -> relax.Call | None:
    """``call`` (a normalized conv whose weight is a constant) reading its weight as
    ``permute_dims(P, [0, 3, 1, 2])`` of ``P`` packed tap-major (``O, KH, KW, I``; ``I``
    padded with zero channels to whole units, sliced off again after the permute) when
    jitbyoc runs it gathered on AMX tiles (:func:`jitbyoc.kernels.conv_panels.tap_major`:
    the product's k is then (ky, kx, c)); else None."""
    weight = call.args[1]
    value = constant(lookup(weight) if isinstance(weight, relax.Var) else weight)
    dt = str(call.args[1].ty.dtype)
    if value is None or value.ndim != 4 or dt not in PRODUCTS or why_not(call) is not None:
        return None
    geo = conv_geometry(call)
    cp = conv_panels.channels(geo, dt)
    if not conv_panels.tap_major(geo, dt) or value.shape[2:] == (1, 1) and cp == geo.cg:
        return None  # (a 1x1's weight in whole units is tap-major as it lies)
    packed = np.zeros((value.shape[0], *value.shape[2:], cp), value.dtype)
    packed[..., :geo.cg] = value.transpose(0, 2, 3, 1)
    if conv_panels.direct(geo, dt):  # tile by tile: (K/16, KH, KW, Cp/16 units, 16, 16 units)
        tiles = conv_panels.tile_packed(packed)
        weight = emit(relax.op.reshape(emit(relax.op.permute_dims(tensor_constant(tiles), conv_panels.TILE_AXES)),
                                       (value.shape[0], cp, *value.shape[2:])))
    else:
        weight = emit(relax.op.permute_dims(tensor_constant(packed), [0, 3, 1, 2]))
    if cp != geo.cg:  # the zero channels of the last unit sliced off
        weight = emit(relax.op.strided_slice(weight, [1], [0], [geo.cg], assume_inbound=True))
    return relax.Call(call.op, [call.args[0], weight], call.attrs, span=call.span)


def winograd_conv(call: relax.Call, lookup, emit) -> relax.Call | None:
    """``call`` (a normalized conv whose weight is a constant) reading its weight as
    ``reshape(strided_slice(P, p .. p + 9), W.shape)`` of ``P`` =
    :func:`winograd.packed_weight` (the transformed weight in ``p`` rows, the chosen
    transform's points squared, then the weight) when jitbyoc runs it by Winograd's
    algorithm (:func:`winograd.fits`); else None."""
    weight = call.args[1]
    value = constant(lookup(weight) if isinstance(weight, relax.Var) else weight)
    dt = str(call.args[0].ty.dtype)
    if value is None or value.ndim != 4 or str(value.dtype) != dt or str(call.ty.dtype) != dt \
            or why_not(call) is not None or not winograd.fits(geo := conv_geometry(call), dt) \
            or (tf := winograd.chosen(geo)) is None:
        return None
    points = tf.points ** 2
    packed = filled_constant((points + 9, *value.shape[:2]), "float32",
                             lambda out: winograd.packed_weight(value, tf, out))
    part = emit(relax.op.strided_slice(packed, [0], [points], [points + 9], assume_inbound=True))
    return relax.Call(call.op, [call.args[0], emit(relax.op.reshape(part, value.shape))], call.attrs,
                      span=call.span)


@relax.expr_functor.mutator
class PackConvWeights(relax.PyExprMutator):
    """Every convolution with a constant weight that jitbyoc's engine runs, reading it
    packed (:func:`packed_conv`)."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not any(call.op.same_as(op) for op in CONVS):
            return call
        call = self.builder_.normalize(call)
        for pack in (winograd_conv, packed_conv, tap_major_conv):
            packed = pack(call, self.lookup_binding, self.builder_.emit)
            if packed is not None:
                return packed
        return call
