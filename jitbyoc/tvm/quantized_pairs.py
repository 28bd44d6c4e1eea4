"""Products of two quantized activations (attention's ``Q @ K^T`` and ``P @ V`` in a QDQ
graph) as uint8 x int8 products summed in int32, both zero points corrected exactly::

    matmul(dequantize(a, sa, za), dequantize(b, sb, zb))
      = sa * sb * sum_k (a - za) (b - zb)
      = sa * sb * (a' @ b' - zb' * rowsum(a') - za' * colsum(b') + K * za' * zb')

with ``a'`` uint8 (int8 activations shifted by 128) and ``b'`` int8 (uint8 ones shifted by
-128), their zero points shifted with them: what onnxruntime's MatMulInteger does with two
zero points. Every term is an integer, exact in int32 while ``K * 255 * 128`` is; the
float product then comes from one conversion and one scale, as in :mod:`.quantized`
(a few float32 ulps from the float graph, which sums rounded products).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ..ir.relax_types import dims
from ..ir.rules import why_not
from .constants import constant, tensor_constant
from .inference import bound_value
from .quantized import _activation, _normalized, _placeholder, recentred, reordered_sums

LARGEST_K = 2 ** 31 // (255 * 128)  # the integer sum of K products stays in int32


def activation_product(call: relax.Call, lookup, emit, pack):
    """``matmul(dequantize(a), dequantize(b))`` of two per-tensor quantized tensors of rank
    2 or more as the corrected int8 product above; None where it does not apply or
    jitbyoc would not take the product. A constant operand (a weight with a nonzero zero
    point) is shifted and summed at build time, and ``pack(product)`` packs it."""
    a, b = (_activation(x, lookup) for x in call.args)
    shape_a, shape_b = dims(call.args[0].ty), dims(call.args[1].ty)
    if str(call.ty.dtype) != "float32" or a is None or b is None or shape_a is None or shape_b is None \
            or min(len(shape_a), len(shape_b)) < 2 or not isinstance(shape_a[-1], int) \
            or shape_a[-1] >= LARGEST_K:
        return None
    (qa, za, sa, _), (qb, zb, sb, _) = a, b
    zb -= 128  # b as int8: its zero point, which _activation gives for b as uint8, with it
    if why_not(_normalized(relax.op.matmul(_placeholder(qa), _placeholder(qb, "int8"), out_dtype="int32"))):
        return None
    ua, sb8 = recentred(qa, "uint8", emit, lookup), recentred(qb, "int8", emit, lookup)
    acc = emit(reordered_sums(pack(_normalized(relax.op.matmul(ua, sb8, out_dtype="int32")))))
    if zb:
        acc = emit(relax.op.subtract(acc, relax.op.multiply(_sums(ua, -1, lookup, emit), relax.const(zb, "int32"))))
    if za:
        acc = emit(relax.op.subtract(acc, relax.op.multiply(_sums(sb8, -2, lookup, emit), relax.const(za, "int32"))))
    if za and zb:
        acc = emit(relax.op.add(acc, relax.const(shape_a[-1] * za * zb, "int32")))
    return relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(np.float32(sa) * np.float32(sb)))


def _sums(q, axis: int, lookup, emit):
    """``q``'s int32 sums along ``axis``, kept: at build time for a constant."""
    value = constant(bound_value(q, lookup))
    if value is not None:
        return tensor_constant(value.astype(np.int32).sum(axis=axis, keepdims=True, dtype=np.int32))
    return emit(relax.op.sum(relax.op.astype(q, "int32"), axis=[axis], keepdims=True))
