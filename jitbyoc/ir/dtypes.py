"""The dtypes jitbyoc lowers, with their LLVM, C, DLPack and numpy spellings.

Booleans are stored as one byte (DLPack ``kDLBool``, 8 bits) and live in registers as
``i1``; every other dtype is stored as it is held. A dtype with ``lanes`` > 1 stands for
a vector of that many elements (its LLVM types are ``<lanes x T>``): the op table's rules
emit scalars and vectors alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from llvmlite import ir


@dataclass(frozen=True)
class DType:
    name: str
    kind: str  # "float", "int" (signed or not) or "bool"
    bits: int
    dl_code: int  # DLPack type code: 0 int, 1 uint, 2 float, 6 bool
    c: str
    lanes: int = 1

    @property
    def signed(self) -> bool:
        """Whether integer compares, extensions, shifts and conversions are signed (bool:
        an unsigned bit)."""
        return self.dl_code != 1 and not self.is_bool

    def with_lanes(self, lanes: int) -> "DType":
        return self if lanes == self.lanes else dataclasses.replace(self, lanes=lanes)

    def _vector(self, t: ir.Type) -> ir.Type:
        return t if self.lanes == 1 else ir.VectorType(t, self.lanes)

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def is_bfloat(self) -> bool:
        """bfloat16: stored and held as its 16 bits (an ``i16``; C ``uint16_t``), converted
        to and from float32 by :mod:`jitbyoc.ir.bfloat`, never computed in."""
        return self.kind == "bfloat"

    @property
    def storage_bits(self) -> int:
        return 8 if self.is_bool else self.bits

    @property
    def nbytes(self) -> int:
        return self.storage_bits // 8

    @property
    def ir(self) -> ir.Type:
        """The register type."""
        if self.is_float:
            return self._vector({16: ir.HalfType(), 32: ir.FloatType()}.get(self.bits, ir.DoubleType()))
        return self._vector(ir.IntType(self.bits))  # integers, and bfloat16's bits

    @property
    def storage_ir(self) -> ir.Type:
        return self._vector(ir.IntType(8)) if self.is_bool else self.ir

    # the one place a dtype held otherwise than stored (a bool: i1 in registers, a byte in
    # memory) is converted; renderers, kernels and engines load and store through these
    def loaded_llvm(self, b: ir.IRBuilder, raw: ir.Value) -> ir.Value:
        """A loaded element, or vector of them, as held (a bool: its byte is not 0)."""
        return b.icmp_unsigned("!=", raw, ir.Constant(raw.type, 0)) if self.is_bool else raw

    def stored_llvm(self, b: ir.IRBuilder, value: ir.Value) -> ir.Value:
        """A held value, or vector of them, as stored (a bool: its i1 zero-extended)."""
        if not self.is_bool:
            return value
        count = value.type.count if isinstance(value.type, ir.VectorType) else 1
        return b.zext(value, self.with_lanes(count).storage_ir)

    def loaded_c(self, raw: str) -> str:
        """A loaded element as held (storing a bool needs nothing: C converts it to a byte)."""
        return f"({raw} != 0)" if self.is_bool else raw

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name)

    @property
    def storage_c(self) -> str:
        return "uint8_t" if self.is_bool else self.c

    @property
    def c_suffix(self) -> str:
        """Of C float literals and libm functions: ``f`` for float32."""
        return "f" if self.is_float and self.bits == 32 else ""

    def held(self, value):
        """``value`` as this dtype holds it, as a Python number (float32 rounds; an
        out-of-range float becomes an infinity, as a C conversion makes it)."""
        if self.is_float or self.is_bfloat:
            with np.errstate(over="ignore"):
                return float(self.numpy.type(value))
        return int(bool(value)) if self.is_bool else int(value)


DTYPES = {
    d.name: d
    for d in (
        DType("float32", "float", 32, 2, "float"),
        DType("float64", "float", 64, 2, "double"),
        DType("float16", "float", 16, 2, "_Float16"),
        DType("bfloat16", "bfloat", 16, 4, "uint16_t"),
        DType("int32", "int", 32, 0, "int32_t"),
        DType("int64", "int", 64, 0, "int64_t"),
        DType("bool", "bool", 1, 6, "bool"),
        DType("int8", "int", 8, 0, "int8_t"),
        DType("int16", "int", 16, 0, "int16_t"),
        DType("uint8", "int", 8, 1, "uint8_t"),
        DType("uint16", "int", 16, 1, "uint16_t"),
        DType("uint32", "int", 32, 1, "uint32_t"),
        DType("uint64", "int", 64, 1, "uint64_t"),
    )
}

FLOATS = frozenset({"float32", "float64"})
# float16 is stored and held as half (LLVM promotes each half operation to float and rounds
# its result, as TVM's LLVM build does); only the rows and kernels that name HALF take it:
# moves, compares, max/min and remainders, none that accumulate or approximate
HALF = frozenset({"float16"})
# bfloat16 is only converted (astype to and from float32) and multiplied (products that
# accumulate in float32: :mod:`jitbyoc.engines.products`); the rows and kernels that name
# BF16 take it
BF16 = frozenset({"bfloat16"})
INTS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | {"bool"}
STORED = ALL | HALF | BF16  # what copies take: views, permutes, concatenations


def dtype(name: str) -> DType:
    """Look up a dtype by name; raises ``KeyError`` naming the supported ones."""
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise KeyError(f"jitbyoc: unsupported dtype {name!r}; known: {sorted(DTYPES)}") from None
