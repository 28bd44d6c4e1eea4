"""The ``tvm.compile`` hook: partition -> RunCodegen -> TVM's own pipeline.

``tvm.compile`` -> ``relax.build(relax_pipeline="default")`` looks the pipeline up in
``tvm.relax.pipeline.PIPELINE_MAP`` at build time. While jitbyoc may be on, the
``"default"`` and ``"default_build"`` entries are wrapped so they offload first; once it
cannot be, the originals are put back exactly (found through the wrappers themselves, so
reloading this module loses nothing).

The switch is process-wide, like TVM's own pipeline registry, and made of counts, not a
saved boolean: a *default* (``jitbyoc.enable()``/``disable()``) and the number of open
``enabled()`` and ``disabled()`` blocks, in any thread. A build offloads when no
``disabled()`` block is open and the default is on or an ``enabled()`` block is open.
Blocks nest and overlap across threads: thread A leaving its block never ends thread B's.
The ``"jitbyoc"`` pipeline always offloads (an explicit opt-in).

Each build that offloads has a :class:`~jitbyoc.toolchain.session.BuildSession`, made
here and handed to partitioning, the codegen and the report. Builds in several threads
share nothing mutable but the bounded, locked caches, so jitbyoc's own work (lowering,
rendering, compiling) runs in parallel; TVM's passes do not: its Relax passes keep a
class-level ``BlockBuilder`` stack and ``LegalizeOps`` enters a process-wide TE tag scope.
Every build through these pipelines, offloading or not, takes
:data:`jitbyoc.tvm.turn.TVM_TURN` for TVM's part of it, which makes concurrent
``tvm.compile`` calls safe while the pipelines are wrapped (TVM's own pipeline alone is
not).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from contextlib import contextmanager

import tvm
from tvm import tirx
from tvm.relax.pipeline import PIPELINE_MAP

from ..render import isa
from ..render.isa import Machine
from ..toolchain import session
from ..toolchain.session import BuildSession
from . import codegen, constants, weights_table
from . import report as offload_report
from .composite_types import restore_call_types
from .partition import partition_for_jitbyoc, regions
from .target import machine_for
from .turn import TVM_TURN

log = logging.getLogger("jitbyoc")

_LOCK = threading.Lock()
HOOKED = ("default", "default_build")


class _Switch:
    def __init__(self):
        self.default = False
        self.blocks = {True: 0, False: 0}  # open enabled() / disabled() blocks


_STATE = _Switch()


def _machine_here(mod: tvm.IRModule, target) -> Machine | None:
    """The machine a build for ``target`` compiles for (:mod:`.target`; a ``"c"`` target
    renders C for this machine's kernel plans), or None when jitbyoc does not compile for
    it: not a CPU target, or an architecture jitbyoc's kernels are not written for (left
    to TVM, with the reason in the offload report)."""
    kind = target.kind.name if target is not None else "llvm"
    if kind not in ("llvm", "c"):
        return None
    if kind == "c":
        return isa.host()
    machine = machine_for(target)
    if isinstance(machine, str):
        log.warning("jitbyoc: %s; the build is left to TVM", machine)
        offload_report.record_declined(mod, machine)
        return None
    return machine


ANCHOR = "__jitbyoc_anchor"


def _with_anchor(mod: tvm.IRModule) -> tvm.IRModule:
    """Add an empty PrimFunc so TVM always has a compiled host library to link.

    When every op is offloaded no PrimFunc is left, and TVM's VMLink then stands in an
    empty C source module, which makes ``VirtualMachine(ex)`` run a C compiler. One empty
    function keeps the build on the LLVM path.
    """
    anchor = tirx.PrimFunc([], tirx.Evaluate(tirx.const(0, "int32"))).with_attr("global_symbol", ANCHOR)
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions, attrs=mod.attrs)
    mod[ANCHOR] = anchor
    return mod


@contextmanager
def _gc_paused():
    """Python's cyclic GC off for the duration: rendering IR makes ~10^5 short-lived
    llvmlite objects, and the collections they trigger (each scanning TVM's and the
    user's live objects too) cost up to half of a cold build's Python time (ResNet-18:
    engines rendered in 123 ms without collections, 146-265 ms with them). Cycles made
    meanwhile are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def offload(mod: tvm.IRModule, build: BuildSession) -> tvm.IRModule:
    """Partition ``mod`` and compile its regions for ``build``; the rest is left for TVM.
    Partitioning takes :data:`TVM_TURN` for its TVM passes (not for lowering), as
    ``RunCodegen`` does; the regions are compiled in between, outside it (the codegen
    then hands the module over)."""
    t0 = time.perf_counter()
    with _gc_paused(), session.opened(build):
        with constants.writes_overlap():  # packed weights are written while regions compile
            part = partition_for_jitbyoc(mod, build)
            t1 = time.perf_counter()
            found = list(regions(part).values())
            codegen.build_module(found, build)
            with TVM_TURN:
                out = restore_call_types(part, codegen.run_codegen(part, build))
                out = weights_table.hand_over(out, {str(f.attrs["global_symbol"]) for f in found})
    build.timings.update(partition_s=t1 - t0, codegen_s=time.perf_counter() - t1)
    offload_report.record(part, build)
    return _with_anchor(out) if found else out


def _in_turn(inner):
    """``inner`` (TVM's pipeline) run in :data:`TVM_TURN`."""
    @tvm.transform.module_pass(opt_level=0, name="jitbyoc.tvm_turn")
    def _tvm_alone(mod, _ctx):
        with TVM_TURN:
            return inner(mod)
    return _tvm_alone


def _wrap(make_pipeline, always: bool = False):
    def make(**kwargs):
        inner = make_pipeline(**kwargs)
        if not (always or active()):
            return _in_turn(inner)  # TVM's pipeline, untouched, in its turn

        @tvm.transform.module_pass(opt_level=0, name="jitbyoc.offload")
        def _offload_then_tvm(mod, _ctx):
            target = tvm.target.Target.current(allow_none=True)
            machine = _machine_here(mod, target)
            if machine is not None:
                as_c = target is not None and target.kind.name == "c"
                mod = offload(mod, BuildSession(machine, emit_c=as_c, writes_overlap=True))
            with TVM_TURN:
                return inner(mod)

        return _offload_then_tvm

    make.jitbyoc_original = make_pipeline
    return make


def _original(name: str):
    make = PIPELINE_MAP[name]
    while hasattr(make, "jitbyoc_original"):
        make = make.jitbyoc_original
    return make


def _sync() -> None:
    """Wrap TVM's pipelines while a build could offload; restore them exactly otherwise."""
    wanted = _STATE.default or _STATE.blocks[True] > 0
    for name in HOOKED:
        hooked = hasattr(PIPELINE_MAP[name], "jitbyoc_original")
        if wanted and not hooked:
            PIPELINE_MAP[name] = _wrap(PIPELINE_MAP[name])
        elif not wanted and hooked:
            PIPELINE_MAP[name] = _original(name)


def set_default(on: bool) -> None:
    with _LOCK:
        _STATE.default = on
        _sync()


@contextmanager
def block(on: bool):
    """An ``enabled()`` (``on``) or ``disabled()`` block: counted while open."""
    with _LOCK:
        _STATE.blocks[on] += 1
        _sync()
    try:
        yield
    finally:
        with _LOCK:
            _STATE.blocks[on] -= 1
            _sync()


def active() -> bool:
    """Whether a build started now offloads."""
    return _STATE.blocks[False] == 0 and (_STATE.default or _STATE.blocks[True] > 0)


def register_pipeline() -> None:
    if "jitbyoc" not in PIPELINE_MAP:
        PIPELINE_MAP["jitbyoc"] = _wrap(lambda **kw: _original("default")(**kw), always=True)
