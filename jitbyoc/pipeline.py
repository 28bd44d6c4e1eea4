"""The ``tvm.compile`` hook: partition -> RunCodegen -> TVM's own pipeline.

``tvm.compile`` -> ``relax.build(relax_pipeline="default")`` looks the pipeline up in
``tvm.relax.pipeline.PIPELINE_MAP`` at build time. :func:`enable` wraps the ``"default"``
and ``"default_build"`` entries so they offload first; :func:`disable` puts the originals
back. The switch is process-wide (every thread's builds see it), like TVM's own pipeline
registry; the ``"jitbyoc"`` pipeline offloads whatever the switch says. Builds through
these pipelines are serialized by :data:`BUILD_LOCK`, which makes concurrent
``tvm.compile`` calls safe while jitbyoc is enabled (TVM's own pipeline alone is not).
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager

import tvm
from tvm import relax, tirx
from tvm.relax.pipeline import PIPELINE_MAP

from . import report as report_mod
from .partition import partition_for_jitbyoc, regions

_LOCK = threading.Lock()
# TVM's Relax passes are not thread-safe (BlockBuilder keeps a class-level stack;
# LegalizeOps enters a process-global TE tag scope), so builds through our pipeline
# take turns here; running the built VMs concurrently is unaffected.
BUILD_LOCK = threading.RLock()
_ORIGINALS: dict = {}
HOOKED = ("default", "default_build")


def _offload_here() -> bool:
    target = tvm.target.Target.current(allow_none=True)
    return target is None or target.kind.name == "llvm"


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


def offload(mod: tvm.IRModule) -> tvm.IRModule:
    """Partition ``mod`` and compile its regions; the rest is left for TVM."""
    t0 = time.perf_counter()
    with _gc_paused():
        part = partition_for_jitbyoc(mod)
        t1 = time.perf_counter()
        out = relax.transform.RunCodegen()(part)
    t2 = time.perf_counter()
    report_mod.record(mod, part, {"partition_s": t1 - t0, "codegen_s": t2 - t1})
    return _with_anchor(out) if regions(part) else out


def _wrap(make_pipeline):
    def make(**kwargs):
        inner = make_pipeline(**kwargs)

        @tvm.transform.module_pass(opt_level=0, name="jitbyoc.offload")
        def _offload_then_tvm(mod, _ctx):
            with BUILD_LOCK:
                return inner(offload(mod) if _offload_here() else mod)

        return _offload_then_tvm

    make.jitbyoc_original = make_pipeline
    return make


def enable() -> None:
    with _LOCK:
        if _ORIGINALS:
            return
        for name in HOOKED:
            _ORIGINALS[name] = PIPELINE_MAP[name]
            PIPELINE_MAP[name] = _wrap(PIPELINE_MAP[name])


def disable() -> None:
    with _LOCK:
        for name, original in _ORIGINALS.items():
            PIPELINE_MAP[name] = original
        _ORIGINALS.clear()


def enabled() -> bool:
    return bool(_ORIGINALS)


def register_pipeline() -> None:
    if "jitbyoc" not in PIPELINE_MAP:
        PIPELINE_MAP["jitbyoc"] = _wrap(lambda **kw: (_ORIGINALS.get("default") or PIPELINE_MAP["default"])(**kw))
