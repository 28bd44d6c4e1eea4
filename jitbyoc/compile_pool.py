"""Compile regions in parallel, in worker processes.

llvmlite serializes every LLVM call behind one process-wide lock, so threads cannot
compile two regions at once; worker processes (:mod:`jitbyoc.compile_worker`, started on
the first build that has two or more regions to compile, and kept) can. The main process
renders each region's IR and hands it over; a worker optimizes it and emits assembly with
the same target machine the main process would use, so the result is the same text.

``JITBYOC_COMPILE_WORKERS=0`` turns the pool off (default: one worker per physical core).
Any failure to start, talk to or get a result from a worker falls back to compiling in
process, with a warning: a build never fails because of the pool.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future

from . import compile_worker, jit
from .threads import physical_cores

log = logging.getLogger("jitbyoc")


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", compile_worker.__file__],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def compile(self, ir_text: str, pipeline: jit.Pipeline) -> str:
        h = jit.host()
        compile_worker._write(self.proc.stdin, (ir_text, tuple(pipeline), h["cpu"], h["features"]))
        reply = compile_worker._read(self.proc.stdout)
        if reply is None:
            raise RuntimeError(f"compile worker {self.proc.pid} exited ({self.proc.poll()})")
        ok, text = reply
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
            ir_text, pipeline, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                worker = worker or self._start()
                future.set_result(worker.compile(ir_text, pipeline))
            except Exception as err:  # noqa: BLE001 - fall back, never fail the build
                log.warning("jitbyoc: compile worker failed (%s); compiling in process", err)
                self._drop(worker)
                worker = None
                try:
                    future.set_result(jit.compile_to_assembly(ir_text, pipeline))
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

    def submit(self, ir_text: str, pipeline: jit.Pipeline = jit.GLUE) -> Future:
        future: Future = Future()
        with self.lock:
            self.count += 1
            self.jobs.put((-len(ir_text), self.count, (ir_text, pipeline, future)))
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
    """The shared pool, or None when parallel compiling is off or pointless."""
    global _POOL
    size = int(os.environ.get("JITBYOC_COMPILE_WORKERS", physical_cores()))
    if size < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = Pool(size)
            atexit.register(_POOL.close)
        return _POOL
