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
import logging
import sys
from dataclasses import dataclass
from typing import Callable

KERNEL_MODULES = ("matmul", "conv2d", "pool2d", "softmax", "norm", "reduce", "layout", "slicing")


@dataclass(frozen=True)
class KernelSpec:
    relax: str
    arity: int
    check: Callable  # (call) -> str | None: why jitbyoc leaves the call to TVM
    build: Callable  # (fe, call, out) -> KernelStage or a list of them; out is a Buffer,
    #                  or a tuple of Buffers when the call returns a tuple (split). A builder
    #                  may instead return the value itself (a kir node, e.g. a Load of a view,
    #                  or a tuple of nodes); then ``out`` is dropped


KERNELS: dict[str, KernelSpec] = {}
# The heavy kernels: a region holds at most one (see jitbyoc/merge.py), so each layer of a
# network is compiled, cached and shared on its own.
ANCHOR_OPS = frozenset({"relax.matmul", "relax.nn.conv2d", "relax.nn.conv1d"})
# kernel-level rewrites run after lowering and epilogue fusion, in order: (kernel) -> None
PASSES: list[Callable] = []


def register(relax: str, arity: int, check: Callable):
    """Decorator for a builder ``(fe, call, out) -> KernelStage`` of Relax op ``relax``."""
    def wrap(build):
        KERNELS[relax] = KernelSpec(relax, arity, check, build)
        return build
    return wrap


FAILED: dict[str, str] = {}  # kernel module -> why it could not be imported


def load_all() -> dict[str, KernelSpec]:
    """Import every kernel module once. One that fails to import is logged and skipped,
    so its ops stay with TVM instead of breaking every build."""
    for name in KERNEL_MODULES:
        module = f"{__name__}.{name}"
        if module in sys.modules or name in FAILED:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                FAILED[name] = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - a broken kernel must not break the rest
            FAILED[name] = f"{type(err).__name__}: {err}"
        if name in FAILED:
            logging.getLogger("jitbyoc").error("jitbyoc: kernel module %s failed to import (%s); "
                                               "its ops stay with TVM", name, FAILED[name])
    return KERNELS
