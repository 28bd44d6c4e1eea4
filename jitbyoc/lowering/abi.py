"""The packed-function entry, as a renderer-neutral list of argument checks.

TVM calls ``int32 __tvm_ffi_<symbol>(void* self, const TVMFFIAny* args, int32 n, TVMFFIAny* ret)``
with the region's inputs then its preallocated outputs. Each argument is a 16-byte
``TVMFFIAny``: ``int32 type_index`` at 0, the value at 8. A ``tvm.runtime.Tensor``
(type index 70) holds its ``DLTensor`` 24 bytes after the object pointer; a raw
``DLTensor*`` has type index 7. The entry checks every argument and, on a mismatch, sets
a TVM error naming the region, the argument and expected vs got, then returns -1.

Both renderers walk :func:`plan` and emit each check the same way, so the C and LLVM
entries enforce the same contract with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import dtype as lookup_dtype
from ..kir import Kernel

ANY_SIZE = 16
TYPE_DLTENSOR_PTR = 7
TYPE_TENSOR = 70
TENSOR_DLTENSOR_OFFSET = 24
KDL_CPU = 1
# DLTensor field offsets (x86-64 / aarch64 layout)
DL_DATA, DL_DEVICE_TYPE, DL_NDIM, DL_DTYPE, DL_SHAPE, DL_STRIDES, DL_BYTE_OFFSET = 0, 8, 16, 20, 24, 32, 40


@dataclass(frozen=True)
class ArgCount:
    expected: int
    message: str  # printf format with one %d: got


@dataclass(frozen=True)
class Unpack:
    """Resolve argument ``index`` to its DLTensor; anything else is a type error."""
    index: int
    message: str  # %d: got type index


@dataclass(frozen=True)
class FieldEq:
    """The int field at ``offset`` of the DLTensor (``bits`` wide) equals ``expected``."""
    index: int
    offset: int
    bits: int
    expected: int
    message: str  # one %d per entry of ``parts``
    parts: tuple = ((0, -1),)  # (shift, mask) of the got value to print; -1: all of it


@dataclass(frozen=True)
class DimEq:
    """``shape[axis]`` equals an int, or binds/checks a symbolic size."""
    index: int
    axis: int
    expected: int | str
    binds: bool  # first sight of a symbolic size: bind it instead of checking
    message: str  # %lld: got (and %lld: expected, for bound symbolic sizes)


@dataclass(frozen=True)
class Contiguous:
    """Null strides, or compact row-major strides (unit dims excepted)."""
    index: int
    message: str  # %d axis, %lld got, %lld expected


def _dtype_word(name: str) -> int:
    dt = lookup_dtype(name)
    return dt.dl_code | (dt.storage_bits << 8) | (1 << 16)


def plan(kernel: Kernel, arg_names: list[str]) -> list:
    where = f"jitbyoc region '{kernel.name}'"
    roles = [f"input {i}" for i in range(len(kernel.inputs))] + \
            [f"output {i}" for i in range(len(kernel.outputs))]
    checks: list = [ArgCount(len(kernel.params),
                             f"{where}: expected {len(kernel.params)} arguments "
                             f"({len(kernel.inputs)} inputs, {len(kernel.outputs)} outputs), got %d")]
    bound: set[str] = set()
    for i, (buf, name, role) in enumerate(zip(kernel.params, arg_names, roles)):
        arg = f"{where}: argument {i} ('{name}', {role})"
        checks.append(Unpack(i, f"{arg}: expected a tvm.runtime.Tensor or DLTensor, "
                                f"got FFI type index %d"))
        checks.append(FieldEq(i, DL_DEVICE_TYPE, 32, KDL_CPU,
                              f"{arg}: expected a CPU tensor (device type {KDL_CPU}), got device type %d"))
        checks.append(FieldEq(i, DL_NDIM, 32, buf.ndim, f"{arg}: expected ndim {buf.ndim}, got %d"))
        d = lookup_dtype(buf.dtype)
        checks.append(FieldEq(i, DL_DTYPE, 32, _dtype_word(buf.dtype),
                              f"{arg}: expected dtype {buf.dtype} (DLDataType code {d.dl_code}, "
                              f"bits {d.storage_bits}, lanes 1), got code %d, bits %d, lanes %d",
                              ((0, 0xFF), (8, 0xFF), (16, 0xFFFF))))
        shape_txt = "(" + ", ".join(map(str, buf.shape)) + ("," if buf.ndim == 1 else "") + ")"
        for axis, d in enumerate(buf.shape):
            if isinstance(d, str) and d not in bound:
                bound.add(d)
                checks.append(DimEq(i, axis, d, True, ""))
                continue
            exp = f"{d} = %lld" if isinstance(d, str) else str(d)
            checks.append(DimEq(i, axis, d, False,
                                f"{arg}: expected shape {shape_txt}, but shape[{axis}] is %lld "
                                f"(expected {exp})"))
        checks.append(Contiguous(i, f"{arg}: expected a contiguous tensor, but strides[%d] is %lld "
                                    f"(expected %lld)"))
    return checks
