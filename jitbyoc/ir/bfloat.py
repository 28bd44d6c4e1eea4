"""bfloat16 conversions, written once for both renderers: float32 to bfloat16 rounds to
nearest even, as ``ml_dtypes`` and TVM's build do (a NaN keeps its sign and upper
payload, made quiet; subnormals round like any other value); bfloat16 to float32 is exact (the 16 bits are float32's
upper half).

Not LLVM's ``fptrunc ... to bfloat``: with AVX512_BF16 it is ``vcvtneps2bf16``, which
flushes subnormal inputs to zero (1e-40 gives 0, where TVM gives 1e-40's bfloat16), and
without it a call of compiler-rt's ``__truncsfbf2``, which a JIT has no library for.
The integer form is a few vector operations per 16 values, beside a product's K of them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from llvmlite import ir

from .llvmtypes import I16, I32

QUIET = 0x0040  # bfloat16's quiet-NaN bit

# C: the same two conversions, in the rendered file's preamble (jitbyoc.render.c.PRELUDE)
C_HELPERS = r"""
static inline uint16_t jb_bf16_from_f32(float x) {
  uint32_t u; memcpy(&u, &x, 4);
  if (x != x) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float jb_f32_from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }
"""


def bits(value) -> int:
    """A literal's bfloat16 bits (rounded to nearest even, as ``ml_dtypes``): how a constant
    of a bfloat16 buffer is written, in LLVM (an ``i16``) and in C (a ``uint16_t``)."""
    return int(np.array(value, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def _like(value, scalar: ir.Type) -> ir.Type:
    t = value.type
    return ir.VectorType(scalar, t.count) if isinstance(t, ir.VectorType) else scalar


def _splat(value, n: int):
    t = value.type
    return ir.Constant(t, [n] * t.count) if isinstance(t, ir.VectorType) else ir.Constant(t, n)


def from_float32(b: ir.IRBuilder, x) -> ir.Value:
    """float32 (scalar or vector) to bfloat16's bits, rounded to nearest even."""
    u = b.bitcast(x, _like(x, I32))
    odd = b.and_(b.lshr(u, _splat(u, 16)), _splat(u, 1))
    rounded = b.lshr(b.add(u, b.add(_splat(u, 0x7FFF), odd)), _splat(u, 16))
    quiet = b.or_(b.lshr(u, _splat(u, 16)), _splat(u, QUIET))
    nan = b.fcmp_unordered("uno", x, x)
    return b.trunc(b.select(nan, quiet, rounded), _like(x, I16))


def to_float32(b: ir.IRBuilder, bits) -> ir.Value:
    """bfloat16's bits (scalar or vector) to float32, exactly."""
    u = b.zext(bits, _like(bits, I32))
    return b.bitcast(b.shl(u, _splat(u, 16)), _like(bits, ir.FloatType()))


def from_float32_c(x: str) -> str:
    return f"jb_bf16_from_f32({x})"


def to_float32_c(bits: str) -> str:
    return f"jb_f32_from_bf16({bits})"


def widened_c(dtype, expr: str) -> str:
    """``expr`` of ``dtype`` (a :class:`~jitbyoc.ir.dtypes.DType`) as a sum takes it: a
    bfloat16's bits widened to float32, anything else as it is."""
    return to_float32_c(expr) if dtype.is_bfloat else expr
