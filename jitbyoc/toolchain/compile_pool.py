"""Compile regions in parallel, in worker processes.

llvmlite serializes every LLVM call behind one process-wide lock, so threads cannot
compile two regions at once; worker processes (:mod:`jitbyoc.toolchain.compile_worker`, started on
the first build that has two or more regions to compile, and kept) can. The main process
renders each region's IR and hands it over; a worker optimizes it and emits assembly with
the same target machine the main process would use, so the result is the same text.

``JITBYOC_COMPILE_WORKERS=0`` turns the pool off (default: one worker per physical core).
Any failure to start, talk to or get a result from a worker falls back to compiling in
process, with a warning: a build never fails because of the pool. That includes a worker
that stops answering (stopped, swapped out, wedged): each reply has a deadline,
:func:`deadline`, after which the worker is killed and replaced.

llvmlite never frees a pass builder's instrumentation callbacks (``LLVMPY_CreatePassBuilder``
allocates them, nothing deletes them), about 1.5 KB per compile (the larger leaks, the
pass pipeline and the global context's constants, are freed by
:func:`jitbyoc.toolchain.compile_worker.optimized_module`; ``tests/test_memory_growth.py``), so a
worker is replaced after :data:`RECYCLE_JOBS` jobs (its successor starts at once, while
the pool waits for work).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ..context import env_number
from ..render import isa
from ..render.isa import Machine
from ..render.optimization import GLUE, Pipeline
from ..threads import physical_cores
from . import compile_worker, jit

log = logging.getLogger("jitbyoc")


# Measured in process (ResNet-18, the encoder block, mlp, conv_block): the largest job,
# the GEMM engine (168 KB of IR), takes 130-160 ms; the slowest per byte, a conv region,
# 3.2 ms per KB. A reply later than the floor (~200x the largest job) plus 60 s per MB
# (~18x the slowest rate) comes from a worker that is not running: stopped, swapped out,
# wedged. JITBYOC_COMPILE_TIMEOUT sets the floor, in seconds.
TIMEOUT_FLOOR_S = 30.0
TIMEOUT_PER_MB_S = 60.0
RECYCLE_JOBS = 2000  # ~3 MB of llvmlite's leak per worker, then a fresh one


def deadline(ir_text: str) -> float:
    """Seconds a worker may take to answer a job of this size."""
    floor = env_number("JITBYOC_COMPILE_TIMEOUT", TIMEOUT_FLOOR_S, float)
    return floor + TIMEOUT_PER_MB_S * len(ir_text) / 2**20


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", compile_worker.__file__],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        # a stopped worker's full pipe would block a plain write forever
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.jobs = 0

    def _wait(self, fd: int, writing: bool, until: float) -> None:
        """Until ``fd`` is ready, or kill the worker once ``until`` (monotonic) has passed."""
        poller = select.poll()  # not select.select: fds past 1023 (FD_SETSIZE) are common
        poller.register(fd, select.POLLOUT if writing else select.POLLIN)
        left = until - time.monotonic()
        if left <= 0 or not poller.poll(math.ceil(left * 1000)):  # a hang-up counts as ready
            self.proc.kill()  # SIGKILL ends a stopped process too
            self.proc.wait()
            raise TimeoutError(f"compile worker {self.proc.pid} did not answer in time; killed")

    def _send(self, data: bytes, until: float) -> None:
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while True:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:  # the pipe is full
                pass
            if not view:
                return
            self._wait(fd, True, until)

    def _read(self, n: int, until: float) -> bytes:
        """``n`` bytes of the reply."""
        fd, data = self.proc.stdout.fileno(), bytearray()
        while len(data) < n:
            self._wait(fd, False, until)
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise RuntimeError(f"compile worker {self.proc.pid} exited ({self.proc.poll()})")
            data += chunk
        return bytes(data)

    def compile(self, ir_text: str, pipeline: Pipeline, machine: Machine) -> str:
        self.jobs += 1
        until = time.monotonic() + deadline(ir_text)
        self._send(compile_worker.message((ir_text, tuple(pipeline), machine.triple, machine.cpu,
                                           machine.features)), until)
        size = struct.unpack("<Q", self._read(8, until))[0]
        ok, text = compile_worker.pickle.loads(self._read(size, until))
        if not ok:
            raise RuntimeError(text)
        return text

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - shutting down; nothing to report to
            self.proc.kill()


class Pool:
    """``size`` workers, each fed by a thread that takes the largest waiting job first:
    a build submits its library engines (a few, ~10x a region's size) as it finds them
    among dozens of regions, and the biggest jobs started last would end the build late."""

    def __init__(self, size: int):
        self.size = size
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.count = 0
        self.threads: list[threading.Thread] = []

    def _serve(self) -> None:
        worker = None
        while True:
            _, _, job = self.jobs.get()
            if job is None:
                break
            ir_text, pipeline, machine, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                worker = worker or self._start()
                future.set_result(worker.compile(ir_text, pipeline, machine))
                if worker.jobs >= RECYCLE_JOBS:  # the successor first: never a pool without one
                    worker, old = self._start(), worker
                    self._drop(old)
            except Exception as err:  # noqa: BLE001 - fall back, never fail the build
                log.warning("jitbyoc: compile worker failed (%s); compiling in process", err)
                self._drop(worker)
                worker = None
                try:
                    future.set_result(jit.compile_to_assembly(ir_text, pipeline, machine))
                except Exception as err2:  # noqa: BLE001 - the build reports it
                    future.set_exception(err2)
        self._drop(worker)

    def _start(self) -> _Worker:
        worker = _Worker()
        with self.lock:
            self.workers.append(worker)
        return worker

    def _drop(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.close()
            with self.lock:
                self.workers.remove(worker)

    def submit(self, ir_text: str, pipeline: Pipeline = GLUE, machine: Machine | None = None) -> Future:
        """Compile ``ir_text`` for ``machine`` (default: the build's, taken now: the
        serving threads do not see the build's context)."""
        future: Future = Future()
        with self.lock:
            self.count += 1
            self.jobs.put((-len(ir_text), self.count, (ir_text, pipeline, machine or isa.current(), future)))
            if len(self.threads) < self.size:
                self.threads.append(threading.Thread(target=self._serve, daemon=True,
                                                     name=f"jitbyoc-compile-{len(self.threads)}"))
                self.threads[-1].start()
        return future

    def close(self) -> None:
        for i, _ in enumerate(self.threads):
            self.jobs.put((float("inf"), i, None))
        for t in self.threads:
            t.join(timeout=10)


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> Pool | None:
    """The shared pool, or None when it is turned off (``JITBYOC_COMPILE_WORKERS=0``)."""
    global _POOL
    size = env_number("JITBYOC_COMPILE_WORKERS", physical_cores())
    if size < 1:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = Pool(size)
            atexit.register(_POOL.close)
        return _POOL
