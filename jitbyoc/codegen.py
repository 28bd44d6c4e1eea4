"""``relax.ext.jitbyoc``: regions in, one TVM ``llvm`` runtime module out.

Each region is lowered to kernel IR, rendered to LLVM IR, optimized and compiled to
assembly for the host CPU on its own (so it can be inspected and cached on its own);
all regions of a build then go into one runtime module (see :mod:`jitbyoc.runtime`)
that TVM loads in process. No C compiler is involved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import tvm
from . import cache, compile_pool, jit, kir, runtime
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
        """LLVM IR after optimization for the host CPU (what the build compiles)."""
        return jit.optimize(self.llvm_ir)

    @cached_property
    def asm(self) -> str:
        """Host assembly; this is what runs."""
        return jit.compile_to_assembly(self.llvm_ir)

    @cached_property
    def c_source(self) -> str:
        return c_renderer.emit_c(self.kernel, self.arg_names)


_STATUS = threading.local()
# The last few runtime modules, by the regions they hold: a rebuild of an unchanged model
# imports the same module (loading one costs TVM tens of ms). Bounded, so dropped builds
# still free their code.
_MODULES: OrderedDict = OrderedDict()
_MODULES_LOCK = threading.Lock()
MODULE_ENTRIES = 8


def last_cache_status() -> dict[str, str]:
    """symbol -> "memory", "disk" (cache hits) or "compiled", for this thread's last build."""
    return dict(getattr(_STATUS, "status", {}))


def compile_regions(functions) -> tvm.runtime.Module | None:
    """Assembly for every region (from the cache, or lowered, optimized and compiled now),
    loaded as one runtime module."""
    t0 = time.perf_counter()
    asm: dict[str, str] = {}
    status: dict[str, str] = {}
    keys, misses = [], {}
    for func in functions:
        symbol = str(func.attrs["global_symbol"])
        if symbol in asm:  # equal content, equal symbol: compile once
            continue
        k = cache.key(symbol)
        keys.append(k)
        asm[symbol], status[symbol] = cache.get(k)
        if asm[symbol] is None:
            misses[symbol] = (k, func)
    _compile_misses(misses, asm, status)
    _STATUS.status = status
    if not asm:
        return None
    t1 = time.perf_counter()
    module = _load(tuple(sorted(keys)), asm)
    compiled = sum(v == "compiled" for v in status.values())
    log.info("jitbyoc: %d regions (%d compiled, %d from cache) in %.1f ms, %.1f ms of it loading into TVM",
             len(asm), compiled, len(asm) - compiled, 1e3 * (time.perf_counter() - t0),
             1e3 * (time.perf_counter() - t1))
    return module


def _compile_misses(misses: dict, asm: dict, status: dict) -> None:
    """Compile the regions the cache did not have: rendered here, one after another, and
    compiled by the worker pool meanwhile when there are several (else in process)."""
    workers = compile_pool.pool() if len(misses) > 1 else None
    pending = {}
    for symbol, (k, func) in misses.items():
        region = Region.from_function(func)
        if workers is None:
            asm[symbol] = region.asm
        else:
            pending[symbol] = workers.submit(region.llvm_ir)
        status[symbol] = "compiled"
    for symbol, future in pending.items():
        asm[symbol] = future.result()
    for symbol, (k, _) in misses.items():
        cache.put(k, asm[symbol])


def _load(key: tuple, asm: dict[str, str]) -> tvm.runtime.Module:
    with _MODULES_LOCK:
        if key in _MODULES:
            _MODULES.move_to_end(key)
            return _MODULES[key]
    module = runtime.tvm_module(asm)
    with _MODULES_LOCK:
        _MODULES[key] = module
        while len(_MODULES) > MODULE_ENTRIES:
            _MODULES.popitem(last=False)
    return module


def _codegen(functions, options, constant_names):
    module = compile_regions(list(functions))
    return [module] if module is not None else []


def register() -> None:
    for name in ("relax.ext.jitbyoc", "relay.ext.jitbyoc"):
        tvm.register_global_func(name, _codegen, override=True)
