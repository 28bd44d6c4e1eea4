"""Quantized products as int8 products: the QDQ form of TVM's ONNX frontend (and of any
frontend that writes ``dequantize`` before a float product) computed on ``vpdpbusd``.

A quantized graph reaches Relax as float products of dequantized operands::

    conv2d(dequantize(qx, sx, zx), dequantize(Wq, sw, zw))   # matmul alike

with ``qx`` uint8 or int8 activations, ``sx``/``zx`` per tensor, and ``Wq`` a constant
int8 (or uint8) weight with per-tensor or per-output-channel ``sw``/``zw``. Since
``(qx - zx)`` and ``(Wq - zw)`` are integers, the product is ``sx * sw * (qx (*) Wq' -
zx * sum(Wq'))`` with ``Wq' = Wq - zw``: an integer product (exact in int32), one
integer correction per output channel, one float scale. The rewrite, here in Relax::

    astype(conv2d(qx', Wq', out_dtype="int32") - zx' * sum(Wq'), "float32") * (sx * sw)

with ``qx'`` uint8 (int8 activations shifted by 128, their zero point with them) and
``Wq'`` int8 (a uint8 weight shifted by -128), which the GEMM and convolution engines
run as uint8 x int8 products in int32 (:data:`jitbyoc.engines.products.PRODUCTS`). What
follows (the bias add, the activation, the ``quantize`` of the next layer) is unchanged
and fuses into the product's epilogue, so a chain of quantized layers passes uint8
tensors from one kernel to the next, as onnxruntime's and oneDNN's int8 paths do.

Where the rewrite does not apply, the product stays as it is (float, exact to the
graph): a weight whose zero point is not zero after the shift (``Wq - zw`` then needs
a per-row sum of the activations as well), a per-channel activation scale, other
layouts. A convolution whose padding would read ``zx`` (a nonzero activation zero
point) pads ``qx'`` with ``zx'`` first, which is what the float graph's zero padding of
``qx - zx`` means.

Error against TVM's build of the float graph: the integer sum is exact; the float graph
rounds each dequantized operand and each product and sums K of them in float32 (its
error ``gamma_K * sum|x'||w'|``); here one conversion to float32 and one product with
the rounded scale ``sx * sw`` (3 ulp in all). The ``quantize`` after the layer turns
differences across a rounding boundary into one-step differences of the uint8 output;
the tests state that bound in output steps.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import Op

from ..ir.quotients import REORDERED
from ..ir.rules import why_not
from .constants import constant, tensor_constant
from .linear import bound_value

DEQUANTIZE = Op.get("relax.dequantize")
MATMUL, CONV2D = Op.get("relax.matmul"), Op.get("relax.nn.conv2d")
PERMUTE_DIMS = Op.get("relax.permute_dims")
TRIGGERS = frozenset({"relax.dequantize", "relax.quantize"})
SPAN = tvm.ir.Span(tvm.ir.SourceName(REORDERED), 0, 0, 0, 0)


def reordered_sums(product: relax.Call) -> relax.Call:
    """``product`` (an integer product standing for a float product of dequantized
    operands) marked so by its span, which the rewrites after this one and the
    partitioning keep: the lowering rounds the requantizations in its epilogue as
    products (:data:`jitbyoc.ir.quotients.REORDERED`)."""
    return relax.Call(product.op, product.args, product.attrs, product.ty_args, span=SPAN)


def _dequantized(expr, lookup):
    """``(q, scale, zero point, axis)`` of a ``dequantize`` to float32 with constant
    parameters (numpy arrays), or None."""
    call = bound_value(expr, lookup)
    if not (isinstance(call, relax.Call) and call.op.same_as(DEQUANTIZE)) \
            or str(call.attrs.out_dtype) != "float32":
        return None
    q, scale, zp = call.args
    s, z = constant(bound_value(scale, lookup)), constant(bound_value(zp, lookup))
    if s is None or z is None or str(q.ty.dtype) not in ("uint8", "int8"):
        return None
    return q, s.astype(np.float32).reshape(-1), z.astype(np.int32).reshape(-1), int(call.attrs.axis)


def _activation(expr, lookup):
    """``(activations, zero point, scale, shifted)`` of a per-tensor dequantize, or None;
    ``shifted``: int8 activations, which :func:`recentred` shifts by 128 to uint8 (their
    zero point here already shifted)."""
    found = _dequantized(expr, lookup)
    if found is None or found[1].size != 1 or found[2].size != 1:
        return None
    q, scale, zp, _axis = found
    shifted = str(q.ty.dtype) == "int8"
    return q, int(zp[0]) + (128 if shifted else 0), float(scale[0]), shifted


def recentred(q, to: str, emit, lookup=None):
    """``q`` (uint8 or int8) as ``to``: shifted by 128 (exact in int16) where the dtypes
    differ, its zero point to move with it; a constant (found through ``lookup``) shifted
    at build time, anything else in the graph."""
    if str(q.ty.dtype) == to:
        return q
    shift = 128 if to == "uint8" else -128
    value = None if lookup is None else constant(bound_value(q, lookup))
    if value is not None:
        return tensor_constant((value.astype(np.int16) + shift).astype(to))
    return emit(relax.op.astype(emit(relax.op.add(relax.op.astype(q, "int16"), relax.const(shift, "int16"))), to))


def _placeholder(like, dtype: str = "uint8") -> relax.Var:
    """A variable shaped as ``like`` (an expression with struct info) of ``dtype``: the
    operand the rewritten product would read, for :func:`why_not`."""
    return relax.Var("q", relax.TensorType(like.ty.shape, dtype))


def _weight(expr, lookup, out_axis: int):
    """``(int8 weight, per-output-channel scale)`` of a dequantized constant whose zero
    point is zero once the weight is int8, scaled along ``out_axis`` or per tensor; a
    ``permute_dims`` of one (a transposed linear weight) as the permuted weight; None
    otherwise."""
    call, permute = bound_value(expr, lookup), None
    if isinstance(call, relax.Call) and call.op.same_as(PERMUTE_DIMS):
        permute = call
        call = bound_value(call.args[0], lookup)
    found = _dequantized(call, lookup)
    value = None if found is None else constant(bound_value(found[0], lookup))
    if value is None:
        return None
    _q, scale, zp, axis = found
    ndim = value.ndim
    if permute is not None:
        axes = permute.attrs.axes
        perm = list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]
        value, axis = value.transpose(perm), perm.index(axis % ndim)
    weight = value.astype(np.int16) - (128 if value.dtype == np.uint8 else 0)
    zp = zp - (128 if value.dtype == np.uint8 else 0)
    if (zp != 0).any() or (scale.size > 1 and axis % ndim != out_axis % ndim):
        return None
    return weight.astype(np.int8), scale


def _scaled(acc, correction: np.ndarray, scale: np.ndarray, shape: tuple):
    """``astype(acc - correction, float32) * scale``, both broadcast as ``shape``."""
    if correction.any():
        acc = relax.op.subtract(acc, tensor_constant(correction.astype(np.int32).reshape(shape)))
    return relax.op.multiply(relax.op.astype(acc, "float32"), tensor_constant(scale.astype(np.float32).reshape(shape)))


def _operands(call: relax.Call, lookup, out_axis: int, ndim: int):
    """``(q, zx, sx, shifted, Wq, sw)`` of a float32 product of a dequantized activation
    (:func:`_activation`) and a dequantized ``ndim``-D constant weight whose output
    channels lie along ``out_axis`` (:func:`_weight`), or None."""
    if str(call.ty.dtype) != "float32":
        return None
    x, w = call.args
    act, weight = _activation(x, lookup), _weight(w, lookup, out_axis)
    if act is None or weight is None or weight[0].ndim != ndim:
        return None
    return (*act, *weight)


def _rescaled(acc, zx: int, sx: float, wq: np.ndarray, sw: np.ndarray, out_axis: int, shape: tuple):
    """The float product from the integer one (see the module docstring): ``zx`` times
    each output channel's weight sum taken off, scaled by ``sx * sw``."""
    k = wq.shape[out_axis]
    sums = np.moveaxis(wq.astype(np.int32), out_axis, 0).reshape(k, -1).sum(axis=1)
    return _scaled(acc, zx * sums, np.float32(sx) * sw * np.ones(k, np.float32), shape)


def quantized_matmul(call: relax.Call, lookup, emit, pack):
    """``matmul(dequantize(qx), dequantize(W))`` of a constant 2-D ``W`` as an int8 product
    (see the module docstring), or None; ``pack(product)``: the product with its weight
    packed for the engine (:func:`.linear.prepacked_weight`)."""
    found = _operands(call, lookup, 1, 2)
    if found is None:
        return None
    q, zx, sx, _shifted, wq, sw = found
    acc = _int8_matmul(q, wq, emit, pack)
    return None if acc is None else _rescaled(acc, zx, sx, wq, sw, 1, (wq.shape[1],))


def _int8_matmul(q, wq: np.ndarray, emit, pack):
    """The int32 product of ``q`` (as uint8, :func:`recentred`) and the int8 constant
    ``wq``, emitted with its weight packed (``pack``); None, with nothing emitted, where
    jitbyoc would not take it (:func:`why_not`)."""
    weight = tensor_constant(wq)
    if why_not(_normalized(relax.op.matmul(_placeholder(q), weight, out_dtype="int32"))):
        return None
    product = _normalized(relax.op.matmul(recentred(q, "uint8", emit), weight, out_dtype="int32"))
    return emit(reordered_sums(pack(product)))


def quantized_conv2d(call: relax.Call, lookup, emit):
    """``conv2d(dequantize(qx), dequantize(W))`` (NCHW, OIHW, a constant ``W``) as an int8
    convolution (see the module docstring), or None."""
    a = call.attrs
    found = _operands(call, lookup, 0, 4)
    if found is None or str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" \
            or (a.out_layout is not None and str(a.out_layout) != "NCHW"):
        return None
    q, zx, sx, _shifted, wq, sw = found
    weight, padding = tensor_constant(wq), [int(p) for p in a.padding]
    padded = [0, 0, 0, 0, padding[0], padding[2], padding[1], padding[3]] if zx and any(padding) else None
    source = _placeholder(q)
    if padded:  # the float graph pads qx - zx with zeros: qx with zx
        source, padding = _placeholder(_normalized(relax.op.nn.pad(source, padded, "constant", float(zx)))), [0] * 4

    def conv(data):
        return relax.op.nn.conv2d(data, weight, a.strides, padding, a.dilation, a.groups, "NCHW", "OIHW", "NCHW",
                                  "int32")
    if why_not(_normalized(conv(source))):
        return None
    data = recentred(q, "uint8", emit)
    if padded:
        data = emit(relax.op.nn.pad(data, padded, "constant", float(zx)))
    return _rescaled(emit(reordered_sums(conv(data))), zx, sx, wq, sw, 0, (1, wq.shape[0], 1, 1))


def _normalized(call: relax.Call) -> relax.Call:
    """``call`` with its struct info, for :func:`why_not` (which reads operand types)."""
    return relax.BlockBuilder().normalize(call)


# data movement that commutes with a per-tensor dequantize: max(dequantize(q)) is
# dequantize(max(q)) since dequantize is increasing (scale > 0), and the others only move
# elements
COMMUTING = frozenset(Op.get(name) for name in (
    "relax.nn.max_pool2d", "relax.reshape", "relax.permute_dims", "relax.squeeze", "relax.expand_dims",
    "relax.concat"))
QUANTIZE, CONCAT = Op.get("relax.quantize"), Op.get("relax.concat")


def requantized(call: relax.Call, lookup, requantize=None):
    """``quantize(f(dequantize(q, s, z)), s, z)`` with the same per-tensor parameters as
    ``f(q)`` for ``f`` an op of :data:`COMMUTING` (or none), exactly: ``((q - z) * s) / s``
    rounds back to ``q - z``. A quantized graph's pooling, reshapes and concatenations
    then move uint8, not float32, and no float tensor is written between them; None when
    the pattern does not hold. A concatenation's items may be dequantized with other
    per-tensor parameters (onnxruntime's QDQ SqueezeNet concatenates two branches of
    their own scales): such an item is requantized by itself, ``requantize(quantize(
    dequantize(q_i), s, z))`` (the caller emits it), the same arithmetic per element."""
    params = _per_tensor(call, lookup)
    inner = bound_value(call.args[0], lookup)
    if params is None or not isinstance(inner, relax.Call):
        return None
    if inner.op.same_as(DEQUANTIZE):
        return inner.args[0] if _per_tensor(inner, lookup) == params else None
    if not any(inner.op.same_as(op) for op in COMMUTING):
        return None
    data = bound_value(inner.args[0], lookup)
    items = list(data.fields) if isinstance(data, relax.Tuple) else [inner.args[0]]
    sources = [bound_value(item, lookup) for item in items]
    if not all(isinstance(s, relax.Call) and s.op.same_as(DEQUANTIZE) for s in sources):
        return None
    found = [_per_tensor(s, lookup) for s in sources]
    if None in found:
        return None
    if any(f != params for f in found) and (requantize is None or not inner.op.same_as(CONCAT)):
        return None
    quantized = [s.args[0] if f == params else
                 requantize(relax.Call(call.op, [item, *call.args[1:]], call.attrs, call.ty_args))
                 for s, f, item in zip(sources, found, items)]
    first = relax.Tuple(quantized) if isinstance(data, relax.Tuple) else quantized[0]
    return relax.Call(inner.op, [first, *inner.args[1:]], inner.attrs, inner.ty_args)


def _per_tensor(call: relax.Call, lookup):
    """``(scale, zero point, quantized dtype)`` of a per-tensor quantize or dequantize
    with constant parameters, or None."""
    scale, zp = (constant(bound_value(a, lookup)) for a in call.args[1:3])
    if scale is None or zp is None or scale.size != 1 or zp.size != 1:
        return None
    dtype = str(call.attrs.out_dtype) if call.op.same_as(QUANTIZE) else str(call.args[0].ty.dtype)
    return float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0]), dtype


TAKE = Op.get("relax.take")


def gathered_dequantize(call: relax.Call, lookup, emit):
    """``take(dequantize(q), indices)`` as ``dequantize(take(q, indices))``: a quantized
    embedding table is read, not dequantized whole on every call (BERT's 30522 x 768
    word embeddings: 23 M elements a call). Exact: the same elements, the same
    arithmetic. Per-tensor parameters, or per-channel along another axis than the
    gathered one; None otherwise."""
    table = bound_value(call.args[0], lookup)
    if not (isinstance(table, relax.Call) and table.op.same_as(DEQUANTIZE)) or call.attrs.axis is None:
        return None
    q, scale, zp = table.args
    ndim, indices = len(q.ty.shape), call.args[1]
    axis, along = int(call.attrs.axis) % ndim, int(table.attrs.axis) % ndim
    per_channel = any(len(a.ty.shape) == 1 and int(a.ty.shape[0]) != 1 for a in (scale, zp))
    if per_channel and along == axis:
        return None
    rank = len(indices.ty.shape)
    moved = along if along < axis else along + rank - 1  # where that axis lands in the result
    rows = emit(relax.op.take(q, indices, axis=axis, mode=str(call.attrs.mode)))
    return relax.op.dequantize(rows, scale, zp, axis=moved if per_channel else -1, out_dtype=str(table.attrs.out_dtype))


ASTYPE, SUBTRACT = Op.get("relax.astype"), Op.get("relax.subtract")


def _widened(expr, lookup):
    """``(x, zero point or None)`` of ``subtract(astype(x, "int32"), zp)`` or
    ``astype(x, "int32")`` with ``x`` of 8 bits: how TVM's ONNX frontend writes
    MatMulInteger's operands; None otherwise."""
    call, zp = bound_value(expr, lookup), None
    if isinstance(call, relax.Call) and call.op.same_as(SUBTRACT) and len(call.args[1].ty.shape) == 0:
        call, zp = bound_value(call.args[0], lookup), call.args[1]
    if not (isinstance(call, relax.Call) and call.op.same_as(ASTYPE)) \
            or str(call.args[0].ty.dtype) not in ("uint8", "int8"):
        return None
    return call.args[0], zp


def _cast_constant(expr, lookup) -> np.ndarray | None:
    """The value of a constant, or of ``astype`` of one (the frontend's zero points)."""
    call = bound_value(expr, lookup)
    if isinstance(call, relax.Call) and call.op.same_as(ASTYPE):
        value = constant(bound_value(call.args[0], lookup))
        return None if value is None else value.astype(str(call.attrs.dtype))
    return constant(call)


def integer_matmul(call: relax.Call, lookup, emit, pack):
    """``matmul(astype(qa) - za, astype(Wq) - zw, out_dtype="int32")`` of a constant 2-D
    ``Wq`` (MatMulInteger: what ``quantize_dynamic`` writes, ``za`` computed per call by
    DynamicQuantizeLinear) as ``matmul(qa', Wq') - za' * sum(Wq')`` on the uint8 x int8
    product, exactly (int8 activations and uint8 weights shifted as in
    :func:`quantized_matmul`); None where ``Wq - zw`` is not int8."""
    if str(call.ty.dtype) != "int32" or len(call.args[1].ty.shape) != 2:
        return None
    act, wide = _widened(call.args[0], lookup), _widened(call.args[1], lookup)
    value = None if wide is None else constant(bound_value(wide[0], lookup))
    wz = None if wide is None or wide[1] is None else _cast_constant(wide[1], lookup)
    if act is None or value is None or (wide[1] is not None and wz is None):
        return None
    weight = value.astype(np.int32) - (0 if wz is None else int(wz))
    if weight.min() < -128 or weight.max() > 127:
        return None
    (q, za), wq = act, weight.astype(np.int8)
    shifted = str(q.ty.dtype) == "int8"
    acc = _int8_matmul(q, wq, emit, pack)
    if acc is None:
        return None
    zero = relax.const(128 if shifted else 0, "int32") if za is None else \
        (emit(relax.op.add(za, relax.const(128, "int32"))) if shifted else za)
    sums = tensor_constant(wq.astype(np.int32).sum(axis=0, dtype=np.int32))
    return relax.op.subtract(acc, relax.op.multiply(zero, sums))
