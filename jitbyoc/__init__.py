"""jitbyoc: a TVM BYOC codegen that JIT-compiles Relax regions with llvmlite.

>>> import jitbyoc
>>> jitbyoc.enable()
>>> ex = tvm.compile(mod, target="llvm")   # supported regions now run jitbyoc's code

Public API: :func:`enable`, :func:`disable`, :func:`enabled` (context manager),
:func:`is_enabled`, :func:`partition_for_jitbyoc`, :func:`report`, :func:`last_report`,
:func:`inspect`.
"""

from __future__ import annotations

from contextlib import contextmanager

from .compat import check_llvm_majors
from .threads import default_threads

default_threads()
check_llvm_majors()

from . import codegen, patterns, pipeline  # noqa: E402
from .codegen import Region  # noqa: E402
from .partition import partition_for_jitbyoc, regions  # noqa: E402
from .report import Report, last_report, report  # noqa: E402

__version__ = "0.1.0"

patterns.register()
codegen.register()
pipeline.register_pipeline()


class _Switch:
    """Returned by :func:`enable`/:func:`disable`; as a context manager it restores the
    state from before the call on exit."""

    def __init__(self, before: bool):
        self.before = before

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        (pipeline.enable if self.before else pipeline.disable)()
        return False


def enable() -> _Switch:
    """Make ``tvm.compile``/``relax.build`` offload supported regions (process-wide)."""
    before = pipeline.enabled()
    pipeline.enable()
    return _Switch(before)


def disable() -> _Switch:
    """Restore TVM's default pipelines exactly."""
    before = pipeline.enabled()
    pipeline.disable()
    return _Switch(before)


def is_enabled() -> bool:
    return pipeline.enabled()


@contextmanager
def enabled():
    """``with jitbyoc.enabled(): ...`` offloads inside the block only."""
    with enable():
        yield


def inspect(mod) -> list[Region]:
    """Every region of ``mod`` with its kernel IR, LLVM IR (before and after optimization),
    assembly and C source (attributes ``kernel``, ``llvm_ir``, ``llvm_ir_optimized``,
    ``asm``, ``c_source``); nothing is handed to TVM."""
    part = mod if regions(mod) else partition_for_jitbyoc(mod)
    return [Region.from_function(f) for f in regions(part).values()]


__all__ = ["enable", "disable", "enabled", "is_enabled", "partition_for_jitbyoc", "report",
           "last_report", "inspect", "Region", "Report", "__version__"]
