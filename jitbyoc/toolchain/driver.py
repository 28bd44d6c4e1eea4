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

from ..engines import closure as engine_closure
from ..engines import emit as emit_engine
from ..engines import parse as parse_engine
from ..ir.errors import CompileError, RenderError, error_context
from ..memo import LRU
from ..render import isa, optimization
from . import cache, compile_pool, jit, runtime, session
from .region import Region
from .runtime import Code
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
    return runtime.tvm_module({region.kernel.name: Code(region.asm, frozenset(region.engines))},
                              engine_code(region.engines, isa.current()),
                              {region.symbol: (region.kernel.name, region.texts)})


_CALLS = "calls:"  # the first line of a cached entry: the engines its assembly calls


def _cached(k: cache.Key) -> tuple[Code | None, str]:
    """(the code cached under ``k``, or None; where it came from: see :func:`cache.get`)."""
    text, where = cache.get(k)
    head, newline, asm = (text or "").partition("\n")
    if not (newline and head.startswith(_CALLS)):
        return None, "miss"
    return Code(asm, frozenset(head[len(_CALLS):].split())), where


def _store(k: cache.Key, code: Code) -> None:
    cache.put(k, " ".join([_CALLS, *sorted(code.calls)]) + "\n" + code.asm)


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
    asm: dict[str, Code | None] = {}  # code symbol -> its compiled code
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
        asm[code], status[code] = _cached(key)
        if asm[code] is None:
            misses[code] = region
    engines: dict[str, Code | None] = {}
    _look_up(set().union(*(a.calls for a in asm.values() if a)), engines, status)
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


def engine_code(symbols, machine: isa.Machine) -> dict[str, Code]:
    """The compiled library engines ``symbols`` and those they call (from the cache, or
    compiled now in process): what a region's code needs next to it in a runtime module."""
    found: dict[str, Code] = {}

    def visit(e: str) -> frozenset[str]:
        k = cache.key(e)
        code = _cached(k)[0]
        if code is None:
            text, pipeline, callees = _engine_job(e, machine)
            with error_context(CompileError, e):
                code = Code(jit.compile_to_assembly(text, pipeline, machine), callees)
            _store(k, code)
        found[e] = code
        return code.calls
    engine_closure(symbols, visit)
    return found


def _look_up(symbols, engines: dict, status: dict) -> list[str]:
    """Add ``symbols`` and the engines their cached code calls to ``engines`` from the
    cache (None where it has none); returns those it has none of, in order."""
    missing: list[str] = []

    def visit(e: str) -> frozenset[str] | None:
        if e not in engines:
            engines[e], status[e] = _cached(cache.key(e))
            if engines[e] is None:
                missing.append(e)
        return engines[e].calls if engines[e] is not None else None
    engine_closure(symbols, visit)
    return missing


def _engine_job(symbol: str, machine: isa.Machine) -> tuple[str, optimization.Pipeline, frozenset[str]]:
    """The IR of the engine ``symbol`` for ``machine``, the pipeline it is compiled with
    and the engines it calls."""
    with error_context(RenderError, symbol, "library engine"):
        engine = parse_engine(symbol)
        text, callees = emit_engine(engine, machine.triple, jit.data_layout(machine))
    return text, engine.pipeline, callees


def _compile_misses(misses: dict, keys: dict, asm: dict, engines: dict, status: dict,
                    machine: isa.Machine) -> None:
    """Compile what the cache did not have: the regions, rendered here one after another,
    and the engines they call, each submitted as soon as it is known (an engine right
    after the region that first needs it, which keeps a worker busy while the engine
    renders; the pool starts engines, the large jobs, first). With two or more things to
    compile, the worker pool compiles them in parallel with the rendering; a single one
    is compiled here (a fresh process's first build need not wait for a worker)."""
    jobs: dict[str, tuple] = {}  # symbol -> (cache key, engines it calls, assembly or future)
    workers = None

    def submit(symbol: str, k: cache.Key, text: str, pipeline: optimization.Pipeline, calls) -> None:
        status[symbol] = "compiled"
        with error_context(CompileError, symbol):
            jobs[symbol] = (k, frozenset(calls), workers.submit(text, pipeline, machine) if workers
                            else jit.compile_to_assembly(text, pipeline, machine))

    def submit_engine(e: str) -> None:
        nonlocal workers
        text, pipeline, calls = _engine_job(e, machine)
        new = _look_up(calls, engines, status)  # a GEMM engine's microkernels
        if new and workers is None:
            workers = compile_pool.pool()
        submit(e, cache.key(e), text, pipeline, calls)
        for callee in new:
            submit_engine(callee)

    missing = [e for e, code in engines.items() if code is None]  # called by cached regions
    if len(misses) + len(missing) > 1:
        workers = compile_pool.pool()
    for e in missing:
        submit_engine(e)
    for code, region in misses.items():
        new = _look_up(region.engines - engines.keys(), engines, status)
        if new and workers is None:
            workers = compile_pool.pool()
        submit(code, keys[code], region.llvm_ir, region.pipeline, region.engines)  # work while engines render
        region.release()
        for e in new:
            submit_engine(e)
    for symbol, (k, calls, result) in jobs.items():
        with error_context(CompileError, symbol):
            code = Code(result.result() if hasattr(result, "result") else result, calls)
        (engines if symbol in engines else asm)[symbol] = code
        _store(k, code)


def _load(asm: dict[str, Code], engines: dict[str, Code], uses: dict[str, tuple],
          machine: isa.Machine) -> tvm.runtime.Module:
    # keyed by everything the module text is made of (the machine: its CPU check), compared in full
    key = (tuple(sorted(asm.items())), tuple(sorted(engines.items())),
           tuple(sorted((s, c, tuple(t)) for s, (c, t) in uses.items())), machine)
    module = _MODULES.get(key)
    if module is None:
        module = runtime.tvm_module(asm, engines, uses)
        _MODULES.put(key, module)
    return module


