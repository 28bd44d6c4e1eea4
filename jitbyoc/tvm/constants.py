"""Constants at build time, read and written with as few copies as can be: a model's
weights are most of its bytes (BERT-base: 340 MB of linear weights), and every pass over
them is build time.

* Reading a constant (:func:`constant`) is a view of TVM's tensor.
* Making one (:func:`tensor_constant`) is a single copy into memory TVM's tensor wraps
  as it is. Inside :func:`deferred` (the rewrites of :mod:`.prepare`) the copy waits: the
  tensor is made over untouched memory, reading it gives the view it will be copied from,
  and :func:`write_deferred` copies only the constants the rewritten function still uses.
  A rewrite that packs a weight a later rewrite repacks (a projection's
  panels, then its heads, then slices of the heads: ViT's fused QKV) writes it once.
* Those copies run on writer threads (all cores but one) while partitioning goes on
  (numpy copies without the GIL); :func:`finish_writes` waits for them (in a build, at
  the end of the regions' compiling: :func:`writes_overlap`), and reading a constant still
  being written waits for it. Small constants (scalars a lowering reads) are written at once.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from threading import Lock

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from ..threads import physical_cores

TENSOR_ALIGN = 64  # what TVM's tensors wrapping foreign memory require
DEFER_BYTES = 1 << 16  # smaller constants are written at once
MAP_BYTES = 1 << 20  # larger ones get a mapping of their own (_fresh)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value; Python 3.11 lacks the name

# address of a deferred tensor's memory -> (that memory as an array, the value it will hold)
_DEFERRED: ContextVar[dict | None] = ContextVar("jitbyoc_deferred_constants", default=None)
_WRITING: dict = {}  # address -> future of its copy, until finish_writes
_WRITING_LOCK = Lock()


def constant(expr) -> np.ndarray | None:
    """A constant's value as a read-only numpy array: a view of TVM's tensor, or of what a
    deferred one will hold (a copy only where numpy's DLPack does not take the dtype);
    None when ``expr`` is not a constant."""
    value = getattr(expr, "value", None) if isinstance(expr, Constant) else None
    if not hasattr(value, "numpy"):
        return None
    array = _dlpack_view(value)
    if array is None:
        array = value.numpy()
    with _WRITING_LOCK:
        writing = _WRITING.get(array.ctypes.data)
    if writing is not None:
        writing.result()
    pending = _DEFERRED.get() or {}
    waiting = pending.get(array.ctypes.data)
    if waiting is not None and waiting[0].shape == array.shape and waiting[0].dtype == array.dtype:
        if callable(waiting[1]):  # a fill: written now, and no longer pending
            _write(*pending.pop(array.ctypes.data))
            array = waiting[0].view()
        else:
            array = waiting[1].view()
    array.flags.writeable = False
    return array


# dtypes numpy's DLPack does not carry, exchanged as the unsigned integers of their size
# (ml_dtypes' bfloat16: bf16 weights are half of a bf16 build's bytes)
_AS_BITS = {"bfloat16": "uint16"}


def _dlpack_view(tensor) -> np.ndarray | None:
    """A numpy view of TVM's ``tensor`` (None where numpy's DLPack does not take it)."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, ValueError, RuntimeError):
        bits = _AS_BITS.get(str(tensor.dtype))
    if bits is None:
        return None
    try:
        view = np.from_dlpack(tensor._create_view(tuple(tensor.shape), bits))
    except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):
        return None
    return view.view(np.dtype(str(tensor.dtype)))


def _tvm_tensor(buffer: np.ndarray):
    """TVM's tensor over ``buffer``'s memory (:data:`_AS_BITS` dtypes through their bits)."""
    bits = _AS_BITS.get(str(buffer.dtype))
    if bits is None:
        return tvm.runtime.from_dlpack(buffer)
    return tvm.runtime.from_dlpack(buffer.view(bits))._create_view(buffer.shape, str(buffer.dtype))


def tensor_constant(value: np.ndarray) -> relax.Constant:
    """``relax.const(value)`` written once (now, or by :func:`write_deferred`).
    ``relax.const`` of an array copies it once more, twice with a dtype."""
    value = np.asarray(value)
    buffer = _fresh(value.nbytes).view(value.dtype).reshape(value.shape)
    pending = _DEFERRED.get()
    try:
        made = relax.const(_tvm_tensor(buffer))
    except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):  # a dtype DLPack does not carry
        return relax.const(np.ascontiguousarray(value), str(value.dtype))
    _write_or_defer(pending, buffer, value)
    return made


def filled_constant(shape, dtype, fill) -> relax.Constant:
    """A constant whose memory ``fill(out)`` writes (a transform of a weight), as
    :func:`tensor_constant` writes a copy: now, or on a writer thread once the rewritten
    function is known to use it. Reading it before (:func:`constant`) fills it first."""
    buffer = _fresh(int(np.prod(shape)) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)
    made = relax.const(_tvm_tensor(buffer))
    _write_or_defer(_DEFERRED.get(), buffer, fill)
    return made


def _write_or_defer(pending: dict | None, buffer: np.ndarray, src) -> None:
    """:func:`_write` ``src`` (an array, or a fill) into ``buffer`` now, outside
    :func:`deferred` or when small; else leave it to :func:`write_deferred`."""
    if pending is None or buffer.nbytes < DEFER_BYTES:
        _write(buffer, src)
    else:
        pending[buffer.ctypes.data] = (buffer, src)


def _fresh(nbytes: int) -> np.ndarray:
    """``nbytes`` of 64-byte-aligned memory: large ones a mapping of their own, which
    :func:`_write` fills in whole (numpy's own asks for transparent huge pages, and
    faulting those in one by one, compacting memory for them, took 145-630 ms for BERT's
    340 MB of weights on this VM; populated at once, 205 ms every time)."""
    if nbytes >= MAP_BYTES:
        try:
            return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
        except (OSError, ValueError, AttributeError):  # no anonymous mappings here
            pass
    raw = np.empty(nbytes + TENSOR_ALIGN, np.uint8)
    start = -raw.ctypes.data % TENSOR_ALIGN
    return raw[start:start + nbytes]


def _write(dst: np.ndarray, src) -> None:
    """``dst[...] = src`` (``src(dst)`` for a fill, :func:`filled_constant`); a mapping of
    :func:`_fresh` is populated in one call first (Linux 5.14+; elsewhere its pages fault
    in as the copy goes)."""
    base = dst
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is not None:
        try:
            base.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            pass
    if callable(src):
        src(dst)
    else:
        np.copyto(dst, src)


@contextmanager
def deferred():
    """Constants made inside are written by :func:`write_deferred` (given the pending set
    this yields), or never if it is not called: the caller drops what it made."""
    pending: dict = {}
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def write_deferred(pending: dict, func) -> None:
    """Start writing the deferred constants ``func`` uses (all of them: it is the only
    holder) on the writer threads; forget the others. :func:`finish_writes` waits for them."""
    if not pending:
        return
    used: set[int] = set()

    def note(expr) -> None:
        view = _dlpack_view(expr.value) if isinstance(expr, Constant) and hasattr(expr.value, "__dlpack__") else None
        if view is not None:
            used.add(view.ctypes.data)

    relax.analysis.post_order_visit(func, note)
    jobs = [pending[address] for address in used if address in pending]
    jobs.sort(key=lambda job: -job[0].nbytes)  # big first: several writers finish together
    with _WRITING_LOCK:
        for buffer, value in jobs:
            _WRITING[buffer.ctypes.data] = _pool().submit(_write, buffer, value)
    pending.clear()


def finish_writes() -> None:
    """Wait for the constants :func:`write_deferred` started (an error in a copy is raised
    here: the build must not go on with a constant half written)."""
    with _WRITING_LOCK:
        futures = list(_WRITING.values())
    try:
        for done in futures:
            done.result()
    finally:
        with _WRITING_LOCK:
            for address in [a for a, f in _WRITING.items() if f in futures]:
                del _WRITING[address]


@contextmanager
def writes_overlap():
    """The writes started inside go on until its end, which waits for them: ``tvm.compile``
    partitions and then compiles the regions, which read no weight but through
    :func:`constant` (which waits for the one it reads), so the copies overlap the
    compiling too. On this VM, memory freed by an earlier build faults back in slowly:
    ViT's 340 MB of packed weights took 0.85-1.0 s to fault in after BERT's build, against
    0.11-0.16 s in a fresh process, and partitioning (0.45 s) waited for the rest.
    Partitioning leaves the writes running when its session says the build waits for
    them (:attr:`~jitbyoc.toolchain.session.BuildSession.writes_overlap`)."""
    try:
        yield
    finally:
        finish_writes()


@cache
def _pool() -> ThreadPoolExecutor:
    """The writers of deferred constants: numpy copies without the GIL, so they run while
    the partitioning goes on; all cores but that one (on 2 cores, two writers and the
    partitioning thread took turns: partitioning went 0.35 -> 0.66 s)."""
    return ThreadPoolExecutor(max(1, physical_cores() - 1), thread_name_prefix="jitbyoc-constants")
