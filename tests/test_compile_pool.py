"""Parallel compilation in worker processes: same code as in process, and never a failure."""

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc import cache, codegen, compile_pool, jit
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
    codegen._MODULES.clear()
    used = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda text: used.append(text) or submit(text))
    with jitbyoc.enabled():
        ex = tvm.compile(models.Branchy, target="llvm")
    # the two regions, and the argument-check engine they call (compiled once per machine)
    assert len(used) == 3 and sum("define i32 @\"jitbyoc_lib_args\"" in text for text in used) == 1
    a, b = np.ones((4, 8), "float32"), np.full(8, -3, "float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](
        tvm.runtime.tensor(np.array(False)), tvm.runtime.tensor(a), tvm.runtime.tensor(b))
    np.testing.assert_array_equal(out.numpy(), -3)
