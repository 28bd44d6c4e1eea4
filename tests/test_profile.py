"""jitbyoc.profile: per-callee times of a built model, with the FLOPs of its products
counted from the kernel IR (checked against counts made by hand here)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from tests.conftest import build_model

RNG = np.random.default_rng(3)


def _build(mod):
    with jitbyoc.enabled():
        return tvm.compile(mod, target="llvm")


def _model(batch):
    def body(bb, x, w, m):
        y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, w, padding=1))))
        flat = bb.emit(relax.op.reshape(y, relax.ShapeExpr([batch, 8 * 6 * 6]) if isinstance(batch, int)
                                        else (y.ty.shape.values[0], 8 * 6 * 6)))
        z = bb.emit(relax.op.matmul(flat, m))
        return bb.emit(relax.op.sort(z, axis=1))  # stays with TVM

    return build_model({"x": ((batch, 3, 6, 6), "float32"), "w": ((8, 3, 3, 3), "float32"),
                        "m": ((8 * 6 * 6, 10), "float32")}, body)


def _args(n):
    return [RNG.standard_normal(s).astype("float32")
            for s in ((n, 3, 6, 6), (8, 3, 3, 3), (8 * 6 * 6, 10))]


def _expected_gflop(n):
    conv = 2 * n * 8 * 6 * 6 * 3 * 3 * 3
    matmul = 2 * n * 10 * 8 * 6 * 6
    return (conv + matmul) / 1e9


def test_profile_times_every_callee_and_counts_the_flops_of_products():
    ex = _build(_model(2))
    prof = jitbyoc.profile(ex, *_args(2), repeat=3, warmup=1, peak_gflops=100.0)
    owners = {r.owner for r in prof.rows}
    assert {"jitbyoc", "tvm"} <= owners, [(r.name, r.owner) for r in prof.rows]
    assert any("sort" in r.name for r in prof.rows if r.owner == "tvm")
    assert abs(prof.gflop - _expected_gflop(2)) < 1e-12
    assert abs(sum(r.share for r in prof.rows) - 1.0) < 1e-9
    for r in prof.rows:
        assert r.seconds > 0 and r.calls >= 1
        if r.gflops is not None:
            assert abs(r.peak_share - r.gflops / 100.0) < 1e-12
    text = str(prof)
    assert "conv2d" in text and "GFLOP/s" in text and "3x6x6" in text


def test_profile_binds_symbolic_sizes_from_the_arguments():
    ex = _build(_model(tvm.ir.expr.Var("n", "int64")))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for n in (1, 3):
        prof = jitbyoc.profile(vm, *_args(n), repeat=2, warmup=1, peak_gflops=100.0)
        assert abs(prof.gflop - _expected_gflop(n)) < 1e-12
        conv = next(r for r in prof.rows if "conv2d" in r.ops)  # the call's shapes, not sym0
        assert conv.shapes.startswith(f"{n}x3x6x6, ") and "sym" not in str(prof), conv.shapes


def test_profile_of_tvm_alone_has_no_jitbyoc_rows():
    with jitbyoc.disabled():
        ex = tvm.compile(_model(1), target="llvm")
    prof = jitbyoc.profile(ex, *_args(1), repeat=2, warmup=0, peak_gflops=100.0)
    assert prof.rows and all(r.owner != "jitbyoc" for r in prof.rows)
    assert prof.gflop == 0.0


def test_profile_refuses_no_runs_by_name():
    """``repeat=0`` raised statistics' "no median for empty data". Found by a review helper."""
    ex = _build(_model(1))
    for bad in ({"repeat": 0}, {"warmup": -1}):
        with pytest.raises(ValueError, match="repeat must be at least 1 and warmup at least 0"):
            jitbyoc.profile(ex, *_args(1), peak_gflops=100.0, **bad)


def test_peak_is_one_thread_times_threads_when_threads_together_run_on_one_core(monkeypatch):
    """Two threads measured together at one core's rate (the other core busy elsewhere
    for that moment) must not become the yardstick: % of peak would read double."""
    from jitbyoc import peak

    rates = {1: 110.0, 2: 112.0}  # 2 threads together: one core's rate
    monkeypatch.setattr(peak, "fma_peak", lambda threads, iters=0: rates[threads])
    peak._measured.cache_clear()
    try:
        assert peak.measured_peak(2) == 220.0
        rates[2] = 230.0
        peak._measured.cache_clear()
        assert peak.measured_peak(2) == 230.0
    finally:
        peak._measured.cache_clear()


def test_fma_runner_keeps_every_thread_on_the_loop_and_counts_its_flops(monkeypatch):
    """The peak as a benchmark candidate: one call runs the loop once per thread, at once,
    for the calibrated count, and its FLOPs are what those runs compute."""
    import threading
    import time as _time
    import types

    from jitbyoc import peak

    calls, barrier = [], threading.Barrier(2, timeout=5)
    # the fake loop takes 2 ms of a fake clock: a real sleep overshoots on a busy machine
    # (3.7 ms once in a full test run, which calibrated 5.4e6 iterations, not 1e7)
    clock = [_time.perf_counter()]
    monkeypatch.setattr(peak, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fake_loop(n):
        if n != 1_000_000:  # the calibration run is alone; a call's runs must overlap
            barrier.wait()
        calls.append((threading.get_ident(), n))
        clock[0] += 0.002
        return 0.0

    monkeypatch.setattr(peak, "peak_loop", lambda: (fake_loop, object()))
    run, flops = peak.fma_runner(2, seconds=0.02)
    assert calls[0][1] == 1_000_000
    iters = round(0.02 / 0.002 * 1_000_000)
    calls.clear()
    run()
    assert [n for _, n in calls] == [calls[0][1]] * 2 and len({t for t, _ in calls}) == 2
    assert abs(calls[0][1] - iters) / iters < 0.5  # calibrated from the 2 ms fake run
    assert flops == 2 * calls[0][1] * peak.flops_per_iteration()
