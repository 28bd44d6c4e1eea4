"""What a build did, for the report: each region's and engine's cache status, and timings.

The pipeline opens a :class:`BuildLog` for each build (:func:`open_log`); the codegen,
called back by TVM in the same thread, writes into :func:`current`; the offload report
reads the log it is handed. A codegen call outside the pipeline (``RunCodegen`` run by
hand) writes a log of its own. :func:`last` is this thread's most recent log.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class BuildLog:
    status: dict[str, str] = field(default_factory=dict)  # symbol -> "memory", "disk", "compiled"
    timings: dict[str, float] = field(default_factory=dict)  # jitbyoc's share, in seconds


_CURRENT: ContextVar[BuildLog | None] = ContextVar("jitbyoc_build_log", default=None)
_LAST = threading.local()


@contextmanager
def open_log():
    log = BuildLog()
    token = _CURRENT.set(log)
    _LAST.log = log
    try:
        yield log
    finally:
        _CURRENT.reset(token)


def current() -> BuildLog:
    """The log of the build under way (a new one when no build opened one)."""
    log = _CURRENT.get()
    if log is None:
        log = _LAST.log = BuildLog()
    return log


def last() -> BuildLog | None:
    return getattr(_LAST, "log", None)
