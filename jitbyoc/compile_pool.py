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
from concurrent.futures import Future, ThreadPoolExecutor

from . import compile_worker, jit
from .threads import physical_cores

log = logging.getLogger("jitbyoc")
SPEED_LEVEL = 2


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", compile_worker.__file__],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def compile(self, ir_text: str) -> str:
        h = jit.host()
        compile_worker._write(self.proc.stdin, (ir_text, SPEED_LEVEL, h["cpu"], h["features"]))
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
    def __init__(self, size: int):
        self.size = size
        self.idle: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="jitbyoc-compile")

    def _take(self) -> _Worker:
        with self.lock:
            if self.idle.empty() and len(self.workers) < self.size:
                self.workers.append(_Worker())
                return self.workers[-1]
        return self.idle.get()

    def _run(self, ir_text: str) -> str:
        worker = self._take()
        try:
            text = worker.compile(ir_text)
        except Exception as err:  # noqa: BLE001 - fall back, never fail the build
            log.warning("jitbyoc: compile worker failed (%s); compiling in process", err)
            worker.close()
            with self.lock:
                self.workers.remove(worker)
            return jit.compile_to_assembly(ir_text, SPEED_LEVEL)
        self.idle.put(worker)
        return text

    def submit(self, ir_text: str) -> Future:
        return self.threads.submit(self._run, ir_text)

    def close(self) -> None:
        self.threads.shutdown(wait=False)
        for w in self.workers:
            w.close()


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
