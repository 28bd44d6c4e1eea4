"""LLVM IR text in, optimized IR (and assembly) out, for the build's machine (the host CPU
unless the TVM target names another: :mod:`jitbyoc.render.isa`).

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

from ..render import isa
from ..render.isa import Machine
from ..render.optimization import GLUE, Pipeline
from . import compile_worker

LOCK = threading.RLock()


def target_machine(machine: Machine | None = None) -> llvm.TargetMachine:
    """LLVM's target machine for ``machine`` (default: the build's, :func:`isa.current`)."""
    return _target_machine(machine or isa.current())


@lru_cache(maxsize=None)
def _target_machine(machine: Machine) -> llvm.TargetMachine:
    with LOCK:
        return compile_worker.make_machine(llvm, machine.triple, machine.cpu, machine.features)


def machine_info() -> dict:
    """What compiled code is specialized for (the build's machine, :func:`isa.current`,
    and the compiler's versions); part of every cache key."""
    m = isa.current()
    return {"triple": m.triple, "cpu": m.cpu, "features": m.features,
            "llvm": ".".join(map(str, llvm.llvm_version_info)), "llvmlite": llvmlite.__version__}


def data_layout(machine: Machine | None = None) -> str:
    """LLVM's data layout for ``machine`` (default: the build's)."""
    return _data_layout(machine or isa.current())


@lru_cache(maxsize=None)
def _data_layout(machine: Machine) -> str:
    return str(_target_machine(machine).target_data)


def optimize(ir_text: str, pipeline: Pipeline = GLUE) -> str:
    """Optimized IR text, for inspection (the same passes the build runs)."""
    with LOCK:
        with compile_worker.optimized_module(llvm, target_machine(), ir_text, pipeline) as mod:
            return str(mod)


def compile_to_assembly(ir_text: str, pipeline: Pipeline = GLUE, machine: Machine | None = None) -> str:
    """IR text -> assembly for ``machine`` (default: the build's) in one pass (no text
    round trip of the optimized IR)."""
    with LOCK:
        return compile_worker.compile_to_assembly(llvm, target_machine(machine), ir_text, pipeline)

