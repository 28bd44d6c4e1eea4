"""A compile worker that stops answering never hangs a build: past its deadline it is
killed, the job is compiled in process, and the pool starts a new worker."""

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import cache, compile_pool
from tests.conftest import build_model, run


def _model(k: int) -> tvm.IRModule:
    """Two regions (one heavy kernel each), so a cold build has several jobs for the pool."""
    def body(bb, x, w):
        y = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w)))
        return bb.emit(relax.op.tanh(relax.op.matmul(y, relax.op.permute_dims(w))))
    return build_model({"x": ((5, 7 + k), "float32"), "w": ((7 + k, 3), "float32")}, body)


def _check(ex, k: int) -> None:
    rng = np.random.default_rng(k)
    x, w = rng.standard_normal((5, 7 + k), "float32"), rng.standard_normal((7 + k, 3), "float32")
    np.testing.assert_allclose(run(relax.VirtualMachine(ex, tvm.cpu()), x, w),
                               np.tanh(np.maximum(x @ w, 0) @ w.T), rtol=1e-5, atol=1e-5)


def _build(k: int):
    with jitbyoc.enabled():
        return tvm.compile(_model(k), target="llvm")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("JITBYOC_COMPILE_WORKERS", "2")
    monkeypatch.setenv("JITBYOC_COMPILE_TIMEOUT", "3")
    cache.configure(path=tmp_path / "cache", enabled=True)
    cache.clear_memory()
    yield
    cache.configure(path=tmp_path / "unused", enabled=True)
    cache.clear_memory()


def test_stopped_workers_do_not_hang_the_build(fresh, caplog):
    pool = compile_pool.pool()
    _check(_build(1), 1)  # starts the workers
    stopped = [w.proc.pid for w in list(pool.workers)]
    assert stopped, "the pool started workers"
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    result = {}
    try:
        with caplog.at_level(logging.WARNING, logger="jitbyoc"):
            t = threading.Thread(target=lambda: result.setdefault("ex", _build(2)), daemon=True)
            t.start()
            t.join(120)
        assert "ex" in result, "the build hung on a stopped worker"
        _check(result["ex"], 2)
        assert "did not answer in time" in caplog.text
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed past its deadline, as it should be
    _check(_build(3), 3)
    fresh_pids = {w.proc.pid for w in pool.workers}
    assert fresh_pids and not fresh_pids & set(stopped), "stopped workers were replaced"


def test_deadline_grows_with_the_job(monkeypatch):
    monkeypatch.delenv("JITBYOC_COMPILE_TIMEOUT", raising=False)
    assert compile_pool.deadline("x") >= compile_pool.TIMEOUT_FLOOR_S
    assert compile_pool.deadline("x" * 2**22) > compile_pool.deadline("x") + 60


def test_a_recycled_worker_is_never_missing_from_the_pool(monkeypatch):
    """The successor starts before the old worker leaves, so a caller that just got its
    result always finds a worker (a slow start used to leave ``workers`` empty)."""
    monkeypatch.setattr(compile_pool, "RECYCLE_JOBS", 1)
    start = compile_pool._Worker.__init__

    def slow_start(self):
        start(self)
        time.sleep(0.3)

    monkeypatch.setattr(compile_pool._Worker, "__init__", slow_start)
    pool = compile_pool.Pool(1)
    (region,) = jitbyoc.inspect(_model(4))[:1]
    try:
        for _ in range(2):
            pool.submit(region.llvm_ir).result(timeout=120)
            until = time.monotonic() + 0.6  # spans the recycling that follows the result
            while time.monotonic() < until:
                assert pool.workers, "the pool had no worker while one was being replaced"
                time.sleep(0.005)
    finally:
        pool.close()


def test_workers_are_replaced_after_their_job_budget(monkeypatch):
    """llvmlite leaks per compiled module, in workers too: each is replaced after
    RECYCLE_JOBS jobs, and the results stay those of the main process."""
    from jitbyoc.toolchain import jit
    monkeypatch.setattr(compile_pool, "RECYCLE_JOBS", 2)
    pool = compile_pool.Pool(1)
    (region,) = jitbyoc.inspect(_model(4))[:1]
    pids = []
    try:
        for _ in range(5):
            assert pool.submit(region.llvm_ir).result(timeout=120) == jit.compile_to_assembly(region.llvm_ir)
            pids.append(pool.workers[0].proc.pid)
    finally:
        pool.close()
    assert len(set(pids)) >= 2, pids
