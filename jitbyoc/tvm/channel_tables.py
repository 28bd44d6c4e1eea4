"""Functions of one byte and its channel as tables: a chain of elementwise ops with
per-channel constant operands, from one uint8 or int8 tensor to a ``quantize``, is
looked up in a table of 256 entries a channel, made at build time.

onnxruntime's quantizer leaves a batch norm it did not fold between two quantizes
(the zoo's ResNet-50: ``quantize(batch_norm(dequantize(quantize(conv))))`` after each of
its 53 convolutions): a subtract, a division, a multiply and an add per element, then a
second rounding, all a function of the first quantize's byte and the channel. Such a chain
becomes ``take(T, astype(q, "int32") + 256 * c)``, ``T`` holding the chain's value for
every byte of every channel; a kernel's epilogue then looks its bytes up four registers
at a time (``vpermi2b``, :func:`jitbyoc.render.vectors.vlookup`).

``T`` is computed here, in numpy, by the operations TVM's legalization writes for each op
(float32, correctly rounded: numpy's float32 arithmetic and square root are IEEE's, and
``round`` is half to even as ``nearbyint``), so the lookup gives TVM's bits; a chain
with a value that is not finite for some byte (a zero scale, a negative variance) is
left as it is. Only for a target with AVX512_VBMI: elsewhere a lookup is a load per lane,
and ResNet-50's residual layer built for AVX2 (``haswell``, on Zen 4) took 1.23-1.30x the
time of its arithmetic. The ops a chain may hold are :data:`STEPS`, and lookups in a constant
table made before (so tables compose: DenseNet-121's batch norm, then Caffe's Scale as
a multiply and an add, each quantized, is one lookup of the first byte); its channel
axis must not be the last (a vector of lookups then shares one channel's table). A
chain of one-element operands only is :mod:`.tables`'s.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir import Op

from ..ir import quotients
from ..ir.relax_types import dims
from ..render import isa
from .constants import constant, tensor_constant
from .inference import bound_value

BYTES = ("uint8", "int8")
QUANTIZED = ("int8", "uint8", "int16", "uint16")
BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
          "relax.divide": np.divide, "relax.maximum": np.maximum, "relax.minimum": np.minimum}
STEPS = frozenset(BINARY) | {"relax.quantize", "relax.dequantize", "relax.nn.batch_norm", "relax.nn.relu"}
# ops as cheap as a lookup: a chain of only these (besides its quantize at each end) stays
# arithmetic, here and in :mod:`.tables`
CHEAP = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.maximum", "relax.minimum",
                   "relax.clip", "relax.nn.relu", "relax.astype", "relax.dequantize"})
BATCH_NORM, TAKE, ASTYPE = (Op.get(f"relax.{name}") for name in ("nn.batch_norm", "take", "astype"))
ADD, SUBTRACT = Op.get("relax.add"), Op.get("relax.subtract")


class _Chain:
    """The steps from a quantize's input down to the one byte tensor they are a function
    of: ``steps`` (call, index of its varying operand), outermost first."""

    def __init__(self, lookup, shape: list):
        self.lookup, self.shape = lookup, shape
        self.steps: list[tuple[relax.Call, int]] = []
        self.leaf = None
        self.lookups: dict = {}  # id(take) -> (table, offset): a table made before (see _looked_up)
        self.values: dict = {}  # an operand -> its _constant_value, evaluated once

    def constant(self, expr):
        """:func:`_constant_value` of ``expr``, once a chain (each step's operands are
        asked for by the walk, the axis and the table)."""
        if expr not in self.values:
            self.values[expr] = _constant_value(expr, self.lookup)
        return self.values[expr]

    def follow(self, expr, depth: int = 16) -> bool:
        """Walk down from ``expr``; the leaf is the deepest byte tensor reached (a
        quantize's result is one, and the walk may go on through it to floats)."""
        deepest = None
        for _ in range(depth):
            value = bound_value(expr, self.lookup)
            if isinstance(value, relax.TupleGetItem):  # batch_norm(...)[0]
                value = bound_value(value.tuple_value, self.lookup) if value.index == 0 else None
                if not (isinstance(value, relax.Call) and value.op.same_as(BATCH_NORM)) or value.attrs.training:
                    break
            looked_up = self._looked_up(value)
            step = self._step(value) if looked_up is None else -1
            if step is None:
                break
            self.steps.append((value, step))
            expr = value.args[step] if looked_up is None else looked_up
            if str(expr.ty.dtype) in BYTES:
                deepest = (len(self.steps), expr)
        if deepest is None:
            return False
        del self.steps[deepest[0]:]
        self.leaf = deepest[1]
        return True

    def _looked_up(self, call):
        """The byte tensor ``q`` that ``call`` looks up in a constant table, ``take(T,
        astype(q) + c)`` (or ``- c``, or no ``c``; ``c`` constant: a table of this module's
        or :mod:`.tables`'s, so a chain goes on through it), recording ``(T, c)``; else None."""
        if not (isinstance(call, relax.Call) and call.op.same_as(TAKE)) or call.attrs.axis is None \
                or str(call.attrs.mode) != "clip":
            return None
        table, index = constant(bound_value(call.args[0], self.lookup)), bound_value(call.args[1], self.lookup)
        offset = np.int64(0)
        if isinstance(index, relax.Call) and (index.op.same_as(ADD) or index.op.same_as(SUBTRACT)):
            c = self.constant(index.args[1])
            offset = None if c is None or c.dtype.kind not in "iu" else \
                c.astype(np.int64) * (1 if index.op.same_as(ADD) else -1)
            index = bound_value(index.args[0], self.lookup)
        if table is None or table.ndim != 1 or offset is None or np.abs(offset).max() >= 2 ** 30 or not (
                isinstance(index, relax.Call) and index.op.same_as(ASTYPE)
                and str(index.ty.dtype) in ("int32", "int64")):  # holds every byte, and the sum
            return None
        q = index.args[0]
        if dims(q.ty) != self.shape or str(q.ty.dtype) not in BYTES:
            return None
        self.lookups[id(call)] = (table, offset)
        return q

    def _step(self, call) -> int | None:
        """The index of ``call``'s one varying operand (of the chain's shape), or None
        when ``call`` is no step: another op, or operands not constant."""
        if not (isinstance(call, relax.Call) and isinstance(call.op, Op) and call.op.name in STEPS):
            return None
        varying = [k for k, a in enumerate(call.args) if self.constant(a) is None]
        if len(varying) != 1 or dims(call.args[varying[0]].ty) != self.shape:
            return None
        name = call.op.name
        return varying[0] if varying[0] == 0 or name in BINARY else None


def _constant_value(expr, lookup, depth: int = 3):
    """``expr``'s value when constants alone compute it (a constant, or a quantize or
    dequantize of one: a QDQ graph's batch-norm parameters), else None."""
    value = constant(bound_value(expr, lookup))
    if value is not None or depth == 0:
        return value
    call = bound_value(expr, lookup)
    if not (isinstance(call, relax.Call) and isinstance(call.op, Op)
            and call.op.name in ("relax.quantize", "relax.dequantize")):
        return None
    args = [_constant_value(a, lookup, depth - 1) for a in call.args]
    return None if any(a is None for a in args) else _apply(call, args)


def _along(p: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A parameter of one value, or one a channel along ``axis`` of an ``ndim``-D operand."""
    if p.size == 1:
        return p.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return p.reshape(shape)


def _apply(call: relax.Call, args: list) -> np.ndarray | None:
    """``call`` on numpy operands as TVM's legalization computes it (module doc), or
    None where a value is not finite or the op is outside what this evaluates."""
    name, x = call.op.name, args[0]
    with np.errstate(all="ignore"):
        if name in BINARY:
            if any(a.dtype != np.float32 for a in args):
                return None
            out = BINARY[name](*args)
        elif name == "relax.nn.relu":
            out = np.maximum(x, np.float32(0)) if x.dtype == np.float32 else None
        elif name == "relax.nn.batch_norm":
            out = _batch_norm(call, *args)
        else:
            params = [_along(p, int(call.attrs.axis), x.ndim) for p in args[1:]]
            out = (_quantize if name == "relax.quantize" else _dequantize)(x, *params, str(call.attrs.out_dtype))
    if out is None or out.dtype.kind == "f" and not np.isfinite(out).all():
        return None
    return out


def _dequantize(x, scale, zp, to: str):
    """``float32(int32(x) - zp) * scale`` (TVM's ``dequantize``)."""
    if x.dtype.kind not in "iu" or to != "float32" or scale.dtype != np.float32 or zp.dtype.kind not in "iu":
        return None
    return (x.astype(np.int32) - zp.astype(np.int32)).astype(np.float32) * scale


def _quantize(x, scale, zp, to: str):
    """``clip(round(x / scale) + zp)`` in float32, then the cast (TVM's ``quantize``)."""
    if to not in QUANTIZED or x.dtype != np.float32 or scale.dtype != np.float32 or not scale.all():
        return None
    return quotients.quantized(x, scale, zp, to)


def _batch_norm(call, x, gamma, beta, mean, var):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` (TVM's inference batch norm)."""
    if any(a.dtype != np.float32 for a in (x, gamma, beta, mean, var)):
        return None
    a = call.attrs
    gamma, beta, mean, var = (_along(p, int(a.axis), x.ndim) for p in (gamma, beta, mean, var))
    y = (x - mean) / np.sqrt(var + np.float32(float(a.epsilon)))
    y = y * gamma if a.scale else y
    return y + beta if a.center else y


def _channel_axis(chain: _Chain, call, ndim: int) -> int | None:
    """The one axis the chain's per-channel operands lie along: -1 for none (one table
    for every element: a batch norm of one channel, which :mod:`.tables` does not take),
    None for several."""
    axes = set()
    for step, k in chain.steps + [(call, 0)]:
        params = [chain.lookups[id(step)][1]] if k < 0 else \
            [chain.constant(a) for i, a in enumerate(step.args) if i != k]
        for p in params:
            if p.size == 1:
                continue
            if k >= 0 and step.op.name not in BINARY:  # a quantize's or batch norm's axis
                axes.add(int(step.attrs.axis) % ndim)
            elif p.ndim > ndim:
                return None
            else:  # broadcast against the chain's tensor
                axes |= {d for d, n in enumerate([1] * (ndim - p.ndim) + list(p.shape)) if n != 1}
    return axes.pop() if len(axes) == 1 else -1 if not axes else None


def channel_table_lookup(call: relax.Call, lookup, emit):
    """``take(T, astype(q) + offsets)`` for ``call``, a quantize to a byte of a chain
    ``f(q, channel)`` that qualifies (module doc); None otherwise."""
    shape = dims(call.ty)
    if str(call.attrs.out_dtype) not in BYTES or shape is None or not all(isinstance(d, int) for d in shape) \
            or len(shape) < 2 or not isa.current().has("avx512vbmi"):
        return None  # without vpermi2b a lookup is a load per lane: slower than the arithmetic
    chain = _Chain(lookup, shape)
    if not chain.follow(call.args[0]) or all(s.op.name in CHEAP for s, _ in chain.steps):
        return None
    axis = _channel_axis(chain, call, len(shape))
    if axis is None or axis == len(shape) - 1:
        return None
    table = _table(chain, call, axis)
    if table is None:
        return None
    byte = chain.leaf if str(chain.leaf.ty.dtype) == "uint8" else emit(relax.op.astype(chain.leaf, "uint8"))
    index = emit(relax.op.astype(byte, "int32"))
    if axis >= 0:
        along = [1] * len(shape)
        along[axis] = shape[axis]
        offsets = (np.arange(shape[axis], dtype=np.int32) * 256).reshape(along)
        index = emit(relax.op.add(index, relax.const(offsets)))
    return relax.op.take(tensor_constant(table), index, axis=0, mode="clip")


def _table(chain: _Chain, call, axis: int) -> np.ndarray | None:
    """The chain's value for every byte (along the last axis) of every channel (along
    ``axis``), flattened channel by channel, each channel's 256 in the order of the bits
    (an int8 leaf is looked up as the uint8 of its bits: 0..127, then -128..-1, so every
    lookup reads a uint8 index and a renderer can read a channel's row); None where a
    step does not evaluate."""
    ndim, channels = len(chain.shape), chain.shape[axis] if axis >= 0 else 1
    probe = [1] * ndim
    probe[axis], probe[-1] = channels, 256  # axis -1: the bytes alone
    x = np.broadcast_to(np.arange(256, dtype=np.uint8).view(str(chain.leaf.ty.dtype)), probe)
    for step, k in [*reversed(chain.steps), (call, 0)]:  # from the leaf up
        if k < 0:  # take(T, astype(q) + c), clamped as take's "clip" clamps
            table, offset = chain.lookups[id(step)]
            if np.broadcast_shapes(x.shape, offset.shape) != tuple(probe):
                return None
            x = table[np.clip(x.astype(np.int64) + offset, 0, table.size - 1)]
            continue
        args = [x if i == k else chain.constant(a) for i, a in enumerate(step.args)]
        if step.op.name in BINARY and np.broadcast_shapes(*(a.shape for a in args)) != tuple(probe):
            return None  # a constant operand along another axis than the channels'
        x = _apply(step, args)
        if x is None:
            return None
    return np.ascontiguousarray(np.moveaxis(x, axis, 0)).reshape(channels * 256)
