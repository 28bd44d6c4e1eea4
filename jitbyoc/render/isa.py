"""The vector ISA jitbyoc writes its register-blocked kernels for: the host's, as the JIT
targets the host. AVX-512 machines have 32 vector registers of 512 bits; AVX2 machines
(most laptops and desktops, AMD before Zen 4) 16 of 256 bits. Kernels keep writing
64-byte vectors (:data:`jitbyoc.render.vectors.VECTOR_BYTES`, which LLVM splits in two on
AVX2); what must follow the ISA is how many of them a register tile holds, or the tile
spills (a 6x64 float32 GEMM tile is 48 ymm accumulators on AVX2: 53 GFLOP/s where
OpenBLAS reaches 155 on a 2-core Zen 3).
"""

from __future__ import annotations

from functools import lru_cache

import llvmlite.binding as llvm


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    return frozenset(f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+"))


def vector_bits() -> int:
    """The width of the host's vector registers."""
    return 512 if "avx512f" in host_features() else 256


def vector_registers() -> int:
    return 32 if vector_bits() == 512 else 16
