"""Hand-written kernels: one file each, registered by Relax op name.

A kernel file defines a :class:`~jitbyoc.kir.KernelStage` subclass with ``emit_llvm``,
``emit_c`` and ``reference``, and registers a :class:`KernelSpec` with :func:`register`:
the pattern arity, a check function returning why a call cannot be taken (or None),
and a builder that turns the Relax call into the stage. The frontend materializes
operands with ``fe.buffer(expr)``; elementwise ops that follow a kernel are fused into
its epilogue afterwards (see :func:`jitbyoc.frontend.fuse_epilogues`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

KERNEL_MODULES = ("matmul", "conv2d", "pool2d", "softmax", "norm", "reduce", "layout")


@dataclass(frozen=True)
class KernelSpec:
    relax: str
    arity: int
    check: Callable  # (call) -> str | None: why jitbyoc leaves the call to TVM
    build: Callable  # (fe, call, out) -> KernelStage or a list of them; out is a Buffer,
    #                  or a tuple of Buffers when the call returns a tuple (split)


KERNELS: dict[str, KernelSpec] = {}
# kernel-level rewrites run after lowering and epilogue fusion, in order: (kernel) -> None
PASSES: list[Callable] = []


def register(relax: str, arity: int, check: Callable):
    """Decorator for a builder ``(fe, call, out) -> KernelStage`` of Relax op ``relax``."""
    def wrap(build):
        KERNELS[relax] = KernelSpec(relax, arity, check, build)
        return build
    return wrap


def load_all() -> dict[str, KernelSpec]:
    for name in KERNEL_MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    return KERNELS
