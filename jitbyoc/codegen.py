"""``relax.ext.jitbyoc``: regions in, one TVM ``llvm`` runtime module out.

Each region is lowered to kernel IR, rendered to LLVM IR, optimized and compiled to
assembly for the host CPU on its own (so it can be inspected and cached on its own);
all regions of a build then go into one runtime module (see :mod:`jitbyoc.runtime`)
that TVM loads in process. No C compiler is involved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property

import tvm
from . import jit, kir, runtime
from .frontend import lower_region
from .lowering import c as c_renderer
from .lowering.llvm import emit_llvm

log = logging.getLogger("jitbyoc")


@dataclass
class Region:
    """One offloaded region and every rendering of it, made on first access."""
    symbol: str
    kernel: kir.Kernel
    arg_names: list[str]
    timings: dict = field(default_factory=dict)

    @classmethod
    def from_function(cls, func) -> "Region":
        kernel, names = lower_region(func)
        return cls(kernel.name, kernel, names)

    @cached_property
    def llvm_ir(self) -> str:
        """LLVM IR before optimization."""
        return str(emit_llvm(self.kernel, self.arg_names, jit.host()["triple"], jit.data_layout()))

    @cached_property
    def llvm_ir_optimized(self) -> str:
        t0 = time.perf_counter()
        text = jit.optimize(self.llvm_ir)
        self.timings["optimize_s"] = time.perf_counter() - t0
        return text

    @cached_property
    def asm(self) -> str:
        """Host assembly; this is what runs."""
        t0 = time.perf_counter()
        text = jit.assembly(self.llvm_ir_optimized)
        self.timings["codegen_s"] = time.perf_counter() - t0
        return text

    @cached_property
    def c_source(self) -> str:
        return c_renderer.emit_c(self.kernel, self.arg_names)


def compile_regions(functions) -> tuple[list[Region], tvm.runtime.Module | None]:
    """Lower, optimize and load ``functions``; one runtime module for all of them."""
    t0 = time.perf_counter()
    regions: dict[str, Region] = {}
    for func in functions:
        symbol = str(func.attrs["global_symbol"])
        if symbol not in regions:  # equal content, equal symbol: compile once
            regions[symbol] = Region.from_function(func)
    if not regions:
        return [], None
    module = runtime.tvm_module({sym: r.asm for sym, r in regions.items()})
    log.info("jitbyoc: compiled %d regions in %.1f ms", len(regions), 1e3 * (time.perf_counter() - t0))
    return list(regions.values()), module


def _codegen(functions, options, constant_names):
    _, module = compile_regions(list(functions))
    return [module] if module is not None else []


def register() -> None:
    for name in ("relax.ext.jitbyoc", "relay.ext.jitbyoc"):
        tvm.register_global_func(name, _codegen, override=True)
