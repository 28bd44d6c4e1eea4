"""A build session: what one build knows, made by the ``tvm.compile`` hook for that build
and handed explicitly from step to step: partitioning fills in the regions' lowerings and
the calls it had to reject, the driver the cache status of each symbol, the hook the
timings, and the offload report reads it all at the end.

Two builds in two threads share nothing mutable but the bounded, locked caches
(:mod:`jitbyoc.memo`). The one place a session cannot be handed as an argument is TVM's
``RunCodegen``, which calls ``relax.ext.jitbyoc`` by name: the hook passes the session's
id in the pass's ``target_options`` and the codegen finds the session by it among the
builds under way (:func:`find`). A codegen called with no session (``RunCodegen`` run by
hand on :func:`jitbyoc.partition_for_jitbyoc`'s result) makes a session of its own.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..render import isa
from ..render.isa import Machine

OPTION = "session"  # the key of a session's id in RunCodegen's options for jitbyoc


@dataclass(eq=False)
class BuildSession:
    """One build's state. ``machine``: what it compiles for; ``emit_c``: a ``target="c"``
    build, whose regions are handed to TVM as C source."""
    machine: Machine = field(default_factory=isa.current)  # default: the scope's (the host outside any)
    emit_c: bool = False
    writes_overlap: bool = False  # packed weights' writes outlast partitioning: the build waits at its end
    status: dict[str, str] = field(default_factory=dict)  # symbol -> "memory", "disk", "compiled", ...
    timings: dict[str, float] = field(default_factory=dict)  # jitbyoc's share of the build, seconds
    rejected: dict[str, str] = field(default_factory=dict)  # call signature -> why its lowering failed
    lowered: dict[int, tuple] = field(default_factory=dict)  # region function handle -> (function, Lowered)
    modules: dict[frozenset, object] = field(default_factory=dict)  # region symbols -> runtime module
    report: object = None  # the offload report, once the build has made it
    id: str = field(default_factory=lambda: secrets.token_hex(16))

    def lowering_of(self, func):
        """The lowering partitioning made of the region function ``func``, or None."""
        hit = self.lowered.get(func.__chandle__())
        return hit[1] if hit is not None and hit[0].same_as(func) else None

    def module_for(self, symbols) -> tuple[bool, object]:
        """(found, the runtime module built ahead of ``RunCodegen`` holding every region in
        ``symbols``)."""
        wanted = frozenset(symbols)
        for held, module in self.modules.items():
            if wanted <= held:
                return True, module
        return False, None


class _Sessions:
    """The builds under way, by id (for the codegen); each thread's last session (its
    cache status: :func:`jitbyoc.toolchain.driver.last_cache_status`) and last session
    with a report (:func:`jitbyoc.last_report`: a ``RunCodegen`` run by hand makes none)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.last = threading.local()


_SESSIONS = _Sessions()


@contextmanager
def opened(session: BuildSession):
    """The session's build, under way inside the block: the codegen can find it, and code
    is planned and rendered for its machine (:func:`jitbyoc.render.isa.compiling_for`,
    scoped to this thread)."""
    with _SESSIONS.lock:
        _SESSIONS.open[session.id] = session
    remember(session)
    try:
        with isa.compiling_for(session.machine):
            yield session
    finally:
        with _SESSIONS.lock:
            _SESSIONS.open.pop(session.id, None)


def find(options) -> BuildSession | None:
    """The session whose id RunCodegen's ``options`` carry, if its build is under way."""
    sid = options.get(OPTION) if options is not None else None
    if sid is None:
        return None
    with _SESSIONS.lock:
        return _SESSIONS.open.get(str(sid))


def last() -> BuildSession | None:
    """This thread's most recent session."""
    return getattr(_SESSIONS.last, "session", None)


def remember(session: BuildSession) -> None:
    """Make ``session`` this thread's most recent (its build opened, or a codegen run by
    hand)."""
    _SESSIONS.last.session = session


def reported(session: BuildSession) -> None:
    """Make ``session``, whose report is made, this thread's most recent report."""
    _SESSIONS.last.reported = session


def last_reported() -> BuildSession | None:
    """This thread's most recent session with a report."""
    return getattr(_SESSIONS.last, "reported", None)
