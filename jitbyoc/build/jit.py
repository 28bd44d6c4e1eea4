"""LLVM IR text in, optimized IR (and assembly) out, for the host CPU.

How a module is compiled is a :class:`~jitbyoc.render.optimization.Pipeline` chosen by what
the module is (:data:`~jitbyoc.render.optimization.GLUE` for regions, each engine kind its own). O3 added nothing
to ResNet-18's run time (39.0 vs 38.8 ms) while costing two thirds more compile time.

Compiling is kept apart from rendering: this module knows nothing of kernels. llvmlite's
global context is not thread-safe, so every use of it here holds one lock.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import llvmlite
import llvmlite.binding as llvm

from ..render.optimization import GLUE, Pipeline
from . import compile_worker

LOCK = threading.RLock()


@lru_cache(maxsize=None)
def target_machine() -> llvm.TargetMachine:
    with LOCK:
        return compile_worker.make_machine(llvm, llvm.get_host_cpu_name(), host_features())


@lru_cache(maxsize=None)
def host_features() -> str:
    return llvm.get_host_cpu_features().flatten()


@lru_cache(maxsize=None)
def _host() -> tuple:
    with LOCK:
        return (("triple", llvm.get_process_triple()), ("cpu", llvm.get_host_cpu_name()),
                ("features", host_features()), ("llvm", ".".join(map(str, llvm.llvm_version_info))),
                ("llvmlite", llvmlite.__version__))


def host() -> dict:
    """What compiled code is specialized for; part of every cache key."""
    return dict(_host())


@lru_cache(maxsize=None)
def data_layout() -> str:
    return str(target_machine().target_data)


def optimize(ir_text: str, pipeline: Pipeline = GLUE) -> str:
    """Optimized IR text, for inspection (the same passes the build runs)."""
    with LOCK:
        with compile_worker.optimized_module(llvm, target_machine(), ir_text, pipeline) as mod:
            return str(mod)


def compile_to_assembly(ir_text: str, pipeline: Pipeline = GLUE) -> str:
    """IR text -> host assembly in one pass (no text round trip of the optimized IR)."""
    with LOCK:
        return compile_worker.compile_to_assembly(llvm, target_machine(), ir_text, pipeline)

