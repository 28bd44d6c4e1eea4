"""jitbyoc: a TVM BYOC codegen that JIT-compiles Relax regions with llvmlite.

>>> import jitbyoc
>>> jitbyoc.enable()
>>> ex = tvm.compile(mod, target="llvm")   # supported regions now run jitbyoc's code

Public API: :func:`enable`, :func:`disable`, :func:`enabled` (context manager),
:func:`disabled` (context manager), :func:`is_enabled`, :func:`partition_for_jitbyoc`,
:func:`lower_precision`, :func:`quantize_weights`, :func:`report`, :func:`last_report`,
:func:`inspect`, :func:`profile`.
"""

from __future__ import annotations

from contextlib import contextmanager

from .compat import check_llvm_majors
from .threads import default_threads
from .version import __version__

default_threads()
check_llvm_majors()

from .toolchain import cache  # noqa: E402  (jitbyoc.cache.configure)
from .toolchain.region import Region  # noqa: E402
from .toolchain.session import BuildSession  # noqa: E402
from .profile import Profile, profile  # noqa: E402
from .tvm import codegen, hook, patterns  # noqa: E402
from .tvm.partition import partition_for_jitbyoc, regions  # noqa: E402
from .tvm.precision import lower_precision  # noqa: E402
from .tvm.weights import quantize_weights  # noqa: E402
from .tvm.report import Report, last_report, report  # noqa: E402

patterns.register()
codegen.register()
hook.register_pipeline()


class _Switch:
    """What :func:`enable`/:func:`disable` return. Not a context manager: use
    :func:`enabled`/:func:`disabled` for a block (they nest and overlap safely)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        raise TypeError(f"jitbyoc.{self.what}() switches the process default; for a block "
                        f"use 'with jitbyoc.{self.what}d():'")

    def __exit__(self, *exc):
        return False


def enable() -> _Switch:
    """Make ``tvm.compile``/``relax.build`` offload supported regions: the process-wide
    default (see :mod:`jitbyoc.tvm.hook` for how it combines with blocks)."""
    hook.set_default(True)
    return _Switch("enable")


def disable() -> _Switch:
    """Turn the process-wide default off; once no :func:`enabled` block is open either,
    TVM's pipelines are restored exactly."""
    hook.set_default(False)
    return _Switch("disable")


def is_enabled() -> bool:
    """Whether a build started now would offload."""
    return hook.active()


@contextmanager
def enabled():
    """``with jitbyoc.enabled(): ...`` offloads inside the block (blocks count: one
    thread leaving its block does not end another's)."""
    with hook.block(True):
        yield


@contextmanager
def disabled():
    """``with jitbyoc.disabled(): ...`` builds with TVM alone inside the block, whatever
    the default and any enabled() block say."""
    with hook.block(False):
        yield


def inspect(mod) -> list[Region]:
    """Every region of ``mod`` with its kernel IR, LLVM IR (before and after optimization),
    assembly and C source (attributes ``kernel``, ``llvm_ir``, ``llvm_ir_optimized``,
    ``asm``, ``c_source``); nothing is handed to TVM."""
    build = BuildSession()
    part = mod if regions(mod) else partition_for_jitbyoc(mod, build)
    return [codegen.region_of(f, build) for f in regions(part).values()]


__all__ = ["enable", "disable", "enabled", "disabled", "is_enabled", "partition_for_jitbyoc", "report",
           "last_report", "quantize_weights", "lower_precision", "inspect", "profile", "Profile", "Region",
           "Report", "cache", "__version__"]
