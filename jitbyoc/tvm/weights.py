"""Weight-only quantization, opt-in: :func:`quantize_weights` stores a model's constant
matmul weights and embedding tables as int8 (llama.cpp's Q8_0) or packed int4 (Q4_0), with
one scale per group of ``group_size`` consecutive elements along the reduction, as
MLC-LLM's ``group_quantize`` does, stored in float16 as llama.cpp stores it (float32
where a scale falls outside float16's normal range: :func:`scales_stored`). Activations
and sums stay float32.

The rewrite is Relax: a weight ``W`` (``N x K``, read as ``permute_dims(W)`` by a
``matmul``, torch's ``linear``) becomes its dequantization, written in elementwise ops
over the narrow constants and a reshape:

* int8: ``reshape(astype(q, "float32") * s, (N, K))``, ``q`` int8 ``(N, K/g, g)``,
  ``s`` float16 ``(N, K/g, 1)`` (widened by an ``astype``; float32 scales: none);
* int4: ``reshape(take(NIBBLE_VALUES, right_shift(astype(p, "int32"), shifts),
  mode="wrap") * s, (N, K))``: Q4_0's values in words of nibbles, each a 4-bit two's
  complement integer -8..7 (:func:`quantized_int4`). Where ``K`` is a multiple of 128 a
  word is an int32 of 8 nibbles, and lane ``j`` of 16 words holds element ``16 s + j``
  of a block of 128 in its nibble ``s`` (``shifts`` = 0, 4, .., 28): one load of 64
  bytes serves 128 weights, where Q4_0's bytes (the layout elsewhere: byte ``j`` of a
  block of 32 holds element ``j`` in its low nibble and ``j + 16`` in its high one) take
  a widening load per 32. Zen 4, 4864 x 896, one row, 2 threads: 117 -> 88 us in cache,
  120 -> 104 us a layer from memory. A nibble's value is looked up (the index wraps
  mod 16: the nibble) in :data:`NIBBLE_VALUES`, the 16 values as floats: with AVX-512 a
  vector of 16 lookups is one ``vpermps`` of a register, where shifting the nibble to
  the top of an int32 and back down, then converting, took three instructions (262 ->
  216 us on one thread). Without AVX-512 the build computes the lookup as those shifts
  (:func:`nibble_arithmetic`).

So the module means the same to TVM's own build (its differential reference, which makes
the float32 weight) as to jitbyoc's, whose matmul evaluates that expression in registers
as it reads the weight (:mod:`jitbyoc.kernels.weight_matmul`): the float32 weight is
never written, at build time or at run time. A lookup ``take(W, ids)`` in a table becomes
the same expression over the looked-up rows of ``q``/``p`` and ``s``, so a tied
embedding and output layer read one storage. A ``matmul(x, W)`` of a ``K x N`` constant
(GPT-2's ``Conv1D``) is stored transposed and read as ``permute_dims``.

Error: each weight moves by at most half a step ``|s|/2`` (int8: ``s = max|w|/127`` of its
group, rounded to the stored float16; int4: ``s = m/-8``, likewise rounded, ``m`` the
group's element of largest magnitude, so the range is -8..7 steps as in Q4_0 and an
element of the other sign past 7.5 steps clips to 7: at most one step), so a product
``x @ W.T`` moves by at most ``|x| @ |S|.T`` (int8: half that), ``S`` repeating each
group's scale, plus float32 summation error in some order.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

from ..render import isa
from .constants import constant, tensor_constant
from .inference import MATMUL
from .linear import bound_value, weight_value

log = logging.getLogger("jitbyoc")

TAKE, RIGHT_SHIFT = (tvm.ir.Op.get(f"relax.{name}") for name in ("take", "right_shift"))
TRIGGERS = frozenset({"relax.take"})  # prepare's rewrite: nibble_arithmetic
BITS = (8, 4, 16)  # 16: bfloat16, no scales
GROUP_SIZES = (32, 64, 128)
# int4: the nibbles a storage word holds, each a run of 16 elements along 16 lanes' words
NIBBLES = {"int32": 8, "uint8": 2}
# int4: a nibble's value, its 4-bit two's complement
NIBBLE_VALUES = np.array([v - 16 if v > 7 else v for v in range(16)], np.float32)
TOP = 28  # int4 without AVX-512: a nibble's top bit is shifted to an int32's sign bit
SCALE_DTYPE = np.float16  # a group's scale, where every scale of the weight is a normal one


def scales_stored(scale: np.ndarray) -> np.ndarray:
    """``scale`` (float32) as stored: float16, as llama.cpp's Q8_0 and Q4_0 store theirs
    (2 bytes a group, not 4: 1/16 of int8's bytes and 1/8 of int4's at groups of 32), when
    every nonzero scale is a normal float16 (relative rounding at most 2**-11; the values
    are quantized against the rounded scale, so a weight still moves by at most half a
    step of its own); else float32, as computed."""
    tiny, huge = np.finfo(SCALE_DTYPE).tiny, np.finfo(SCALE_DTYPE).max
    size = np.abs(scale[scale != 0])
    if size.size and (size.min() < tiny or size.max() > huge):
        return scale.astype(np.float32)
    return scale.astype(SCALE_DTYPE)


def _steps(scale: np.ndarray) -> np.ndarray:
    """The stored ``scale`` as the float32 divisor that quantizes a group (1 where it is 0:
    an all-zero group stays 0)."""
    return np.where(scale == 0, 1, scale).astype(np.float32)


def quantized_int8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 of ``w`` (``N x K``): int8 ``(N, K/g, g)`` and scales ``(N, K/g, 1)``
    (:func:`scales_stored`)."""
    groups = w.reshape(w.shape[0], -1, group).astype(np.float32)
    scale = scales_stored(np.abs(groups).max(axis=2, keepdims=True) / 127)
    q = np.rint(groups / _steps(scale))
    return np.clip(q, -127, 127).astype(np.int8), scale


def int4_word(k: int) -> tuple[str, int]:
    """int4's storage word for a reduction of ``k``: ``(dtype, nibbles)``. An int32 word
    holds 8 nibbles, so a vector of 16 words is 128 weights, loaded once for the 8 runs
    of 16 its nibbles hold; a byte holds 2 (Q4_0's block of 32) where ``k`` is no multiple
    of 128."""
    dtype = "int32" if k % (16 * NIBBLES["int32"]) == 0 else "uint8"
    return dtype, NIBBLES[dtype]


def int4_shapes(n: int, k: int, group: int) -> tuple[tuple, tuple]:
    """The shapes of int4's words and of its scales, ``(n, k / max(group, block), groups
    a block or blocks a group, 16-element runs, 16)`` once broadcast together (``block``:
    the elements of a lane's word times 16)."""
    block = 16 * int4_word(k)[1]
    outer, per = k // max(group, block), max(group, block) // min(group, block)
    if block > group:  # a lane's word holds several groups
        return (n, outer, 1, 1, 16), (n, outer, per, 1, 1)
    return (n, outer, per, 1, 16), (n, outer, 1, 1, 1)


def nibble_shifts(nibbles: int, groups: int) -> np.ndarray:
    """The right shifts (int32) that bring each run's nibbles down, as an array that
    broadcasts against int4's words: ``(groups, runs a group, 1)``; ``groups``: how many
    groups a word holds (1 where a group spans several blocks)."""
    return (4 * np.arange(nibbles, dtype=np.int32)).reshape(groups, -1, 1)


def quantized_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0's values of ``w`` (``N x K``) packed in words (:func:`int4_word`) and scales
    (:func:`scales_stored`), shapes :func:`int4_shapes`; in each block of ``16 * nibbles``
    elements, lane ``j`` of a run of 16 words holds element ``s * 16 + j`` in its nibble
    ``s``. Q4_0's value ``v`` (0..15, meaning ``(v - 8) * s``) is stored as the 4-bit two's
    complement of ``v - 8`` (``v ^ 8``)."""
    n, k = w.shape
    groups = w.reshape(n, -1, group).astype(np.float32)
    at = np.abs(groups).argmax(axis=2)[..., None]
    scale = scales_stored(np.take_along_axis(groups, at, axis=2) / -8)
    q = np.clip(np.rint(groups / _steps(scale)) + 8, 0, 15).astype(np.uint32) ^ 8
    dtype, nibbles = int4_word(k)
    runs = q.reshape(n, -1, nibbles, 16)  # element b * 16 * nibbles + s * 16 + j
    words = np.bitwise_or.reduce(runs << (4 * np.arange(nibbles, dtype=np.uint32))[:, None], axis=2)
    shape, scales = int4_shapes(n, k, group)
    words = words.astype(np.uint8) if dtype == "uint8" else words.view(np.int32)
    return words.reshape(shape), scale.reshape(scales)


def dequantized(q: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """The float32 ``N x K`` weight that :func:`quantized_int8`/:func:`quantized_int4`'s
    storage means (numpy: the tests' and the bench's reference); a bfloat16 weight has no
    scale."""
    if scale is None:
        return q.astype(np.float32)
    scale = scale.astype(np.float32)
    if q.dtype == np.int8:
        return (q.astype(np.float32) * scale).reshape(q.shape[0], -1)
    shifts = nibble_shifts(NIBBLES[str(q.dtype)], scale.shape[-3]).astype(np.uint32)
    nibbles = (q.astype(np.uint32) << (TOP - shifts)).view(np.int32) >> TOP
    return (nibbles.astype(np.float32) * scale).reshape(q.shape[0], -1)


def _dequantize(q, scale, shape) -> relax.Expr:
    """The Relax expression of the float32 weight ``q``/``scale`` (constants, or their
    looked-up rows) stand for, reshaped to ``shape`` (a bfloat16 ``q``: no scale)."""
    if scale is None:
        return relax.op.astype(q, "float32")
    if q.ty.dtype == "int8":
        values = relax.op.astype(q, "float32")
    else:
        # a nibble's value from a table of the 16: an index taken mod 16 (wrap) is the
        # nibble, and a vector of 16 lookups one register permute (vpermps)
        shifts = nibble_shifts(NIBBLES[str(q.ty.dtype)], int(scale.ty.shape[-3]))
        nibbles = relax.op.right_shift(relax.op.astype(q, "int32"), relax.const(shifts))
        values = relax.op.take(relax.const(NIBBLE_VALUES), nibbles, axis=0, mode="wrap")
    if scale.ty.dtype != "float32":  # float16 scales (scales_stored)
        scale = relax.op.astype(scale, "float32")
    return relax.op.reshape(relax.op.multiply(values, scale), shape)


def nibble_arithmetic(call: relax.Call, lookup):
    """On a machine without AVX-512, int4's lookup of a nibble's value (``take`` from
    :data:`NIBBLE_VALUES`, mode ``wrap``) as its arithmetic: the nibble shifted up to the
    top of an int32 and back down, signed (the same values for any index; of an index
    ``x >> c``, ``c`` a constant <= 28, ``x`` shifted up by ``28 - c``). There a table of
    16 floats is two registers, and a vector of lookups two ``vpermps``, a shift and a
    blend, slower than the shifts and a conversion (Zen 4 built for AVX2, 4864 x 896, one
    row: 300 against 190 us). None where the lookup stays."""
    if isa.current().has("avx512f") or call.attrs.mode != "wrap" or call.attrs.axis is None:
        return None
    table, index = constant(bound_value(call.args[0], lookup)), call.args[1]
    if table is None or table.dtype != NIBBLE_VALUES.dtype or not np.array_equal(table, NIBBLE_VALUES) \
            or str(index.ty.dtype) != "int32":
        return None
    top = up = relax.const(TOP, "int32")
    shifted = bound_value(index, lookup)
    if isinstance(shifted, relax.Call) and shifted.op.same_as(RIGHT_SHIFT):
        down = constant(bound_value(shifted.args[1], lookup))
        if down is not None and down.dtype == np.int32 and down.size and 0 <= down.min() and down.max() <= TOP:
            index, up = shifted.args[0], relax.const((TOP - down).astype(np.int32))
    return relax.op.astype(relax.op.right_shift(relax.op.left_shift(index, up), top), "float32")


@relax.expr_functor.mutator
class _Quantize(relax.PyExprMutator):
    def __init__(self, mod, bits: int, group: int):
        super().__init__(mod)
        self.bits, self.group = bits, group
        self.stored: dict = {}  # a constant's array (address, shape, strides) -> (q, scale)
        self.pinned: list = []  # those arrays
        self.kept: dict[str, int] = {}  # why a weight stayed float32 -> how many

    def _storage(self, value: np.ndarray | None):
        """``(q, scale)`` constants of ``value``, an ``N x K`` float32 constant (made once
        per weight, shared by a tied table and output layer; bfloat16: ``(w, None)``), or
        None (not such a constant, or it stays float32)."""
        if value is None or value.ndim != 2 or str(value.dtype) != "float32":
            return None
        key = (value.ctypes.data, value.shape, value.strides)
        if key not in self.stored:
            self.pinned.append(value)  # its address stays its own while it is a key
            self.stored[key] = self._stored(value)
        return self.stored[key]

    def _stored(self, value: np.ndarray):
        if self.bits == 16:
            return tensor_constant(value.astype(ml_dtypes.bfloat16)), None
        if value.shape[1] % self.group:
            why = f"reduction {value.shape[1]} is not a multiple of the group size {self.group}"
            self.kept[why] = self.kept.get(why, 0) + 1
            return None
        quantize = quantized_int8 if self.bits == 8 else quantized_int4
        q, scale = quantize(np.ascontiguousarray(value), self.group)
        return tensor_constant(q), tensor_constant(scale)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op.same_as(MATMUL):
            return self._matmul(call)
        if call.op.same_as(TAKE) and int(call.attrs.axis) == 0:
            return self._take(call)
        return call

    def _matmul(self, call):
        x, weight = call.args
        if str(x.ty.dtype) != "float32" or str(call.ty.dtype) != "float32":
            return call
        value = weight_value(weight, self.lookup_binding)  # (K, N): torch's W.T, or W
        stored = None if value is None else self._storage(value.T)
        if stored is None:
            return call
        w = self.builder_.emit(_dequantize(*stored, value.T.shape))
        return relax.op.matmul(x, relax.op.permute_dims(w, [1, 0]), "float32")

    def _take(self, call):
        table, ids = call.args
        stored = self._storage(constant(bound_value(table, self.lookup_binding)))
        if stored is None:
            return call
        mode = call.attrs.mode
        rows = [None if part is None else self.builder_.emit(relax.op.take(part, ids, axis=0, mode=mode))
                for part in stored]
        return _dequantize(*rows, call.ty.shape)


def quantize_weights(mod: tvm.IRModule, bits: int = 8, group_size: int = 32) -> tvm.IRModule:
    """``mod`` with its float32 matmul weights and embedding tables (constants) stored as
    ``bits``-bit integers with a float16 scale per ``group_size`` elements along the
    reduction (see the module docstring); build the result with ``tvm.compile`` as any
    module. ``bits``: 8 or 4; ``group_size``: 32, 64 or 128. A weight whose reduction is
    not a multiple of ``group_size`` stays float32 (logged). ``bits=16`` stores bfloat16
    weights instead (each rounded to nearest even; no scales, any shape): half the bytes,
    with float32 activations and sums, where :func:`jitbyoc.lower_precision` also rounds
    the activations."""
    if bits not in BITS:
        raise ValueError(f"jitbyoc.quantize_weights: bits {bits!r} is not one of {BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"jitbyoc.quantize_weights: group_size {group_size!r} is not one of {GROUP_SIZES}")
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator = _Quantize(mod, bits, group_size)
            func = relax.analysis.remove_all_unused(mutator.visit_expr(func))
            for why, count in mutator.kept.items():
                log.info("jitbyoc.quantize_weights: %d weight(s) of %s stay float32: %s",
                         count, gv.name_hint, why)
        out[gv] = func
    return tvm.IRModule(out, attrs=mod.attrs)
