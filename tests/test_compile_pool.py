"""Parallel compilation in worker processes: same code as in process, and never a failure."""

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import cache, compile_pool, driver, jit
from jitbyoc.render import isa
from jitbyoc.render.optimization import GLUE
from tests import models


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setenv("JITBYOC_COMPILE_WORKERS", "2")
    p = compile_pool.pool()
    assert p is not None
    return p


def test_workers_emit_the_same_assembly_as_the_process(pool):
    regions = jitbyoc.inspect(models.Branchy) + jitbyoc.inspect(models.Symbolic)
    futures = [pool.submit(r.llvm_ir) for r in regions]
    for r, f in zip(regions, futures):
        assert f.result(timeout=120) == jit.compile_to_assembly(r.llvm_ir)


def test_each_job_gets_its_pipeline_in_any_order(pool):
    """Engines and regions are compiled with different pipelines (strength reduction is
    a process-wide LLVM option a worker switches per job; the args engine takes the lean
    pass list): whatever a worker compiled before, the result is what the main process
    makes with the same pipeline."""
    (region,) = jitbyoc.inspect(models.SeedExample)
    engines = ["jitbyoc_lib_gemm_float32_4_k_x", "jitbyoc_lib_conv_float32_16_16_1", "jitbyoc_lib_args"]
    jobs = [(region.llvm_ir, GLUE)] + [driver._engine_job(e, isa.host())[:2] for e in engines]
    assert len({p.lsr for _, p in jobs}) == 2 and len({p for _, p in jobs}) == 4
    assert {p.speed_level for _, p in jobs} == {0, 1}
    order = jobs + jobs[::-1] + jobs
    futures = [pool.submit(text, p) for text, p in order]
    for (text, p), f in zip(order, futures):
        assert f.result(timeout=120) == jit.compile_to_assembly(text, p)


def test_waiting_jobs_run_largest_first(monkeypatch):
    """Engines (the largest jobs) found late in a build still start before the regions
    queued ahead of them."""
    done, gate = [], __import__("threading").Event()

    class FakeWorker:
        jobs = 0

        def compile(self, text, pipeline, machine):
            gate.wait(60)
            done.append(len(text))
            return text

        def close(self):
            pass

    p = compile_pool.Pool(1)
    monkeypatch.setattr(compile_pool, "_Worker", FakeWorker)
    first = p.submit("x" * 5)  # taken at once; the rest wait behind it
    while not first.running():
        pass
    futures = [p.submit("x" * n) for n in (10, 300, 20, 4000, 30)]
    gate.set()
    assert [f.result(timeout=60) for f in futures] == ["x" * n for n in (10, 300, 20, 4000, 30)]
    assert done == [5, 4000, 300, 30, 20, 10]
    p.close()


def test_a_dead_worker_falls_back_to_compiling_in_process(pool):
    (region,) = jitbyoc.inspect(models.SeedExample)
    pool.submit(region.llvm_ir).result(timeout=120)  # make sure a worker exists
    for w in list(pool.workers):
        w.proc.kill()
        w.proc.wait()
    assert pool.submit(region.llvm_ir).result(timeout=120) == region.asm


def test_off_switch(monkeypatch):
    monkeypatch.setenv("JITBYOC_COMPILE_WORKERS", "0")
    assert compile_pool.pool() is None


def test_a_build_with_several_regions_compiles_them_through_the_pool(pool, monkeypatch, tmp_path):
    cache.configure(path=tmp_path)
    cache.clear_memory()
    driver._MODULES.clear()
    used = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda text, pipeline, machine: used.append(text) or submit(text, pipeline, machine))
    with jitbyoc.enabled():
        ex = tvm.compile(models.Branchy, target="llvm")
    # the two regions, and the argument-check engine they call (compiled once per machine)
    assert len(used) == 3 and sum("define i32 @\"jitbyoc_lib_args\"" in text for text in used) == 1
    a, b = np.ones((4, 8), "float32"), np.full(8, -3, "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](
        tvm.runtime.tensor(np.array(False)), tvm.runtime.tensor(a), tvm.runtime.tensor(b))
    np.testing.assert_array_equal(out.numpy(), -3)
