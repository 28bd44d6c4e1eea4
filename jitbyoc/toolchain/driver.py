"""The build driver: regions in, one TVM ``llvm`` runtime module out.

For each region (:class:`~jitbyoc.toolchain.region.Region`) it looks the code up in the
cache (:mod:`jitbyoc.toolchain.cache`), renders and compiles what is missing (in the worker
pool, :mod:`jitbyoc.toolchain.compile_pool`, when there is more than one thing to compile),
adds the library engines the code calls, and loads everything as one runtime module
(:mod:`jitbyoc.toolchain.runtime`) that TVM loads in process. No C compiler is involved.
Cache status goes to the build's session (:mod:`jitbyoc.toolchain.session`).
"""

from __future__ import annotations

import logging
import time

import tvm

from ..engines import called_by as engines_called
from ..engines import closure as engine_closure
from ..engines import ir_text as engine_ir_text
from ..engines import parse as parse_engine
from ..ir.errors import CompileError, error_context
from ..memo import LRU
from ..render import isa, optimization
from . import cache, compile_pool, jit, runtime, session
from .region import Region
from .session import BuildSession

log = logging.getLogger("jitbyoc")


# The last few runtime modules, by the regions they hold: a rebuild of an unchanged model
# imports the same module (loading one costs TVM tens of ms). Bounded, so dropped builds
# still free their code.
MODULE_ENTRIES = 8
_MODULES = LRU(MODULE_ENTRIES)


def last_cache_status() -> dict[str, str]:
    """symbol -> "memory", "disk" (cache hits) or "compiled", for this thread's last build:
    its regions, and the library engines (``jitbyoc_lib_*``) they call."""
    last = session.last()
    return dict(last.status) if last is not None else {}


def load_region(region: Region) -> tvm.runtime.Module:
    """One region alone (with the engines it calls) as a runtime module."""
    return runtime.tvm_module({region.kernel.name: region.asm}, engine_asm(engines_called(region.asm)),
                              {region.symbol: (region.kernel.name, region.texts)})


def build_regions(regions: list[Region], build: BuildSession) -> tvm.runtime.Module | None:
    """The runtime module of a build's regions: C source for a ``target="c"`` build
    (:func:`c_regions`), else compiled code (:func:`compile_regions`)."""
    return c_regions(regions, build) if build.emit_c else compile_regions(regions, build)


def c_regions(regions: list[Region], build: BuildSession) -> tvm.runtime.Module | None:
    """The regions as one C source module, for a ``target="c"`` build (nothing compiled
    here: ``export_library`` runs the C compiler)."""
    if not regions:
        return None
    build.status.update({r.symbol: "c source" for r in regions})
    return runtime.c_source_module(regions)


def compile_regions(regions: list[Region], build: BuildSession) -> tvm.runtime.Module | None:
    """Assembly for every region's code and the engines it calls (from the cache, or
    lowered, optimized and compiled now), loaded as one runtime module with an entry per
    region."""
    t0 = time.perf_counter()
    asm: dict[str, str] = {}  # code symbol -> assembly
    status: dict[str, str] = {}
    uses: dict[str, tuple] = {}  # region symbol -> (code symbol, names table)
    misses, keys = {}, {}
    for region in regions:
        code = region.kernel.name
        uses[region.symbol] = (code, region.texts)
        key = cache.key(region.key)
        if code in keys:  # equal code: compile once
            if keys[code] != key:
                raise RuntimeError(f"jitbyoc: two different regions share the code symbol '{code}'")
            continue
        keys[code] = key
        asm[code], status[code] = cache.get(key)
        if asm[code] is None:
            misses[code] = region
    engines: dict[str, str] = {}
    _look_up(set().union(*(engines_called(a) for a in asm.values() if a)), engines, status)
    _compile_misses(misses, keys, asm, engines, status, build.machine)
    build.status.update({**{s: status[code] for s, (code, _) in uses.items()},
                                      **{e: status[e] for e in engines}})
    if not asm:
        return None
    t1 = time.perf_counter()
    module = _load(asm, engines, uses, build.machine)
    compiled = sum(status[code] == "compiled" for code, _ in uses.values())
    log.info("jitbyoc: %d regions (%d compiled, %d from cache), %d library engines (%d compiled) "
             "in %.1f ms, %.1f ms of it loading into TVM", len(uses), compiled, len(uses) - compiled,
             len(engines), sum(status[s] == "compiled" for s in engines),
             1e3 * (time.perf_counter() - t0), 1e3 * (time.perf_counter() - t1))
    return module


def engine_asm(symbols) -> dict[str, str]:
    """Assembly of the library engines ``symbols`` and of those they call (from the cache,
    or compiled now in process): what a region's assembly needs next to it in a runtime
    module."""
    def text_of(e: str) -> str:
        k = cache.key(e)
        text = cache.get(k)[0]
        if text is None:
            with error_context(CompileError, e):
                text = jit.compile_to_assembly(*_engine_job(e, isa.current()))
            cache.put(k, text)
        return text
    return engine_closure(symbols, text_of)


def _look_up(symbols, engines: dict, status: dict) -> list[str]:
    """Add ``symbols`` and the engines their cached assembly calls to ``engines`` from the
    cache (None where it has none); returns those it has none of, in order."""
    missing: list[str] = []

    def text_of(e: str) -> str | None:
        if e not in engines:
            engines[e], status[e] = cache.get(cache.key(e))
            if engines[e] is None:
                missing.append(e)
        return engines[e]
    engine_closure(symbols, text_of)
    return missing


def _engine_job(symbol: str, machine: isa.Machine) -> tuple[str, optimization.Pipeline]:
    """The IR of the engine ``symbol`` for ``machine`` and the pipeline it is compiled with."""
    engine = parse_engine(symbol)
    return engine_ir_text(engine, machine.triple, jit.data_layout(machine)), engine.pipeline


def _compile_misses(misses: dict, keys: dict, asm: dict, engines: dict, status: dict,
                    machine: isa.Machine) -> None:
    """Compile what the cache did not have: the regions, rendered here one after another,
    and the engines they call, each submitted as soon as it is known (an engine right
    after the region that first needs it, which keeps a worker busy while the engine
    renders; the pool starts engines, the large jobs, first). With two or more things to
    compile, the worker pool compiles them in parallel with the rendering; a single one
    is compiled here (a fresh process's first build need not wait for a worker)."""
    jobs: dict[str, tuple] = {}  # symbol -> (cache key, assembly or future)
    workers = None

    def submit(symbol: str, k: cache.Key, text: str, pipeline: optimization.Pipeline) -> None:
        status[symbol] = "compiled"
        with error_context(CompileError, symbol):
            jobs[symbol] = (k, workers.submit(text, pipeline, machine) if workers
                            else jit.compile_to_assembly(text, pipeline, machine))

    def submit_engine(e: str) -> None:
        nonlocal workers
        text, pipeline = _engine_job(e, machine)
        callees = _look_up(engines_called(text) - {e}, engines, status)  # a GEMM engine's microkernels
        if callees and workers is None:
            workers = compile_pool.pool()
        submit(e, cache.key(e), text, pipeline)
        for callee in callees:
            submit_engine(callee)

    missing = [e for e, text in engines.items() if text is None]  # called by cached regions
    if len(misses) + len(missing) > 1:
        workers = compile_pool.pool()
    for e in missing:
        submit_engine(e)
    for code, region in misses.items():
        new = _look_up(region.engines - engines.keys(), engines, status)
        if new and workers is None:
            workers = compile_pool.pool()
        submit(code, keys[code], region.llvm_ir, region.pipeline)  # a worker's work while engines render
        region.release()
        for e in new:
            submit_engine(e)
    for symbol, (k, result) in jobs.items():
        with error_context(CompileError, symbol):
            text = result.result() if hasattr(result, "result") else result
        (engines if symbol in engines else asm)[symbol] = text
        cache.put(k, text)


def _load(asm: dict[str, str], engines: dict[str, str], uses: dict[str, tuple],
          machine: isa.Machine) -> tvm.runtime.Module:
    # keyed by everything the module text is made of (the machine: its CPU check), compared in full
    key = (tuple(sorted(asm.items())), tuple(sorted(engines.items())),
           tuple(sorted((s, c, tuple(t)) for s, (c, t) in uses.items())), machine)
    module = _MODULES.get(key)
    if module is None:
        module = runtime.tvm_module(asm, engines, uses)
        _MODULES.put(key, module)
    return module


