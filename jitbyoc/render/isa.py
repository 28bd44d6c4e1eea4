"""The machine jitbyoc writes code for: LLVM triple, CPU and features, and the vector ISA
its register-blocked kernels follow.

A build compiles for one :class:`Machine`: the host by default, or what the TVM target
names (:mod:`jitbyoc.tvm.target` derives it; :func:`compiling_for` scopes it to the
build). AVX-512 machines have 32 vector registers of 512 bits; AVX2 machines (most
laptops and desktops, AMD before Zen 4) 16 of 256 bits; baseline x86-64 16 of 128 (SSE2);
AArch64 32 of 128 (NEON). Kernels keep writing 64-byte vectors (:data:`VECTOR_BYTES`,
which LLVM splits into the machine's registers); what must follow the ISA is how many of
them a register tile holds, or the tile spills (a 6x64 float32 GEMM tile is 48 ymm
accumulators on AVX2: 53 GFLOP/s where OpenBLAS reaches 155 on a 2-core Zen 3).

Vector widths are counted here alone: :func:`lanes` (elements per register, or per vector
of any width) and :func:`registers_per_vector`.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from functools import lru_cache

import llvmlite.binding as llvm

from ..context import scoped
from ..ir.dtypes import dtype as lookup_dtype

# The vectors kernels write on every machine: one AVX-512 register (LLVM splits it into
# a narrower machine's registers)
VECTOR_BITS = 512
VECTOR_BYTES = VECTOR_BITS // 8


@dataclass(frozen=True)
class Machine:
    """What code is compiled for, in LLVM's terms. ``features`` is LLVM's feature string
    (``+avx2,+fma,-avx512f,...``), complete: the CPU's own features spelled out."""
    triple: str
    cpu: str
    features: str

    @property
    def arch(self) -> str:
        return self.triple.split("-")[0]

    def has(self, feature: str) -> bool:
        return feature in _enabled(self.features)

    def describe(self) -> str:
        return f"{self.triple} cpu={self.cpu} ({vector_bits(self)}-bit vectors)"


@lru_cache(maxsize=None)
def _enabled(features: str) -> frozenset[str]:
    """The features a feature string turns on (parsed once: kernels ask per instruction)."""
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


@lru_cache(maxsize=1)
def host() -> Machine:
    """This machine, as LLVM sees it."""
    return Machine(llvm.get_process_triple(), llvm.get_host_cpu_name(),
                   llvm.get_host_cpu_features().flatten())


_CURRENT: contextvars.ContextVar[Machine | None] = contextvars.ContextVar("jitbyoc_machine", default=None)


def current() -> Machine:
    """The machine the build in progress compiles for (the host outside any build)."""
    return _CURRENT.get() or host()


def compiling_for(machine: Machine):
    """Compile for ``machine`` inside the ``with`` block (code, engines, cache keys, plans)."""
    return scoped(_CURRENT, machine)


def vector_bits(machine: Machine | None = None) -> int:
    """The width of the machine's vector registers."""
    m = machine or current()
    if m.arch in ("x86_64", "i686", "i386"):
        return 512 if m.has("avx512f") else 256 if m.has("avx") else 128
    return 128  # AArch64 NEON (SVE's width is not known at compile time: unused)


def element_bits(element: str | int) -> int:
    """The width of ``element``: a dtype name (as stored: a bool is a byte) or a width in bits."""
    return element if isinstance(element, int) else lookup_dtype(element).storage_bits


def lanes(element: str | int, bits: int | None = None) -> int:
    """Elements of ``element`` (a dtype name or a width in bits) in a vector of ``bits``:
    by default one register of the build's machine; kernels write :data:`VECTOR_BITS`
    (:func:`jitbyoc.render.vectors.lanes`)."""
    return (vector_bits() if bits is None else bits) // element_bits(element)


def registers_per_vector(count: int, element: str | int) -> int:
    """Registers of the build's machine that a vector of ``count`` elements fills (at least one)."""
    return max(1, count * element_bits(element) // vector_bits())


def vector_registers(machine: Machine | None = None) -> int:
    m = machine or current()
    if m.arch in ("x86_64", "i686", "i386"):
        return 32 if m.has("avx512f") else 16
    return 32


def has_fma(machine: Machine | None = None) -> bool:
    """Whether the machine fuses multiply-adds in hardware (x86 FMA3, every AArch64).
    Without it ``llvm.fma`` is a call to libm's ``fma`` per element (3 GFLOP/s on a
    256^3 product for baseline x86-64)."""
    m = machine or current()
    return m.arch != "x86_64" or m.has("fma") or m.has("avx512f")
