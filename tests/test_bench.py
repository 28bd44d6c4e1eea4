"""The benchmark harness: its timing/statistics code with fake clocks, and one real
``python -m bench --quick`` run whose outputs must agree with each other."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import models, report
from bench.timing import Stats, max_errors, speedup, time_alternating, timed

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    """A clock that only moves when a fake workload says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_workloads(clock: FakeClock, costs: dict[str, list[float]], log: list[str]):
    """Callables that advance ``clock`` by their next cost and log their name."""
    def make(name):
        queue = list(costs[name])

        def run():
            log.append(name)
            clock.now += queue.pop(0)
            return name

        return run

    return {name: make(name) for name in costs}


def test_stats_median_min_max():
    assert Stats.of([3.0, 1.0, 2.0]) == Stats(2.0, 1.0, 3.0, 3)
    assert Stats.of([4.0, 1.0, 2.0, 3.0]) == Stats(2.5, 1.0, 4.0, 4)
    assert Stats.of([0.5]) == Stats(0.5, 0.5, 0.5, 1)
    with pytest.raises(ValueError):
        Stats.of([])


def test_timed_uses_the_clock():
    clock = FakeClock()
    log: list[str] = []
    fn = fake_workloads(clock, {"a": [0.25]}, log)["a"]
    assert timed(fn, clock) == ("a", 0.25)


def test_alternation_order_and_warmup_excluded():
    clock = FakeClock()
    log: list[str] = []
    # first calls are very slow (compilation, allocation): they must not be in the samples
    costs = {"tvm": [50.0, 40.0, 3.0, 1.0, 2.0], "jitbyoc": [60.0, 30.0, 0.5, 0.25, 1.5]}
    samples = time_alternating(fake_workloads(clock, costs, log), repeat=3, warmup=2, clock=clock)
    assert log == ["tvm", "jitbyoc"] * 5
    assert samples == {"tvm": [3.0, 1.0, 2.0], "jitbyoc": [0.5, 0.25, 1.5]}
    tvm, jit = Stats.of(samples["tvm"]), Stats.of(samples["jitbyoc"])
    assert (jit.median, jit.min, jit.max) == (0.5, 0.25, 1.5)
    assert speedup(tvm, jit) == pytest.approx(4.0)


def test_alternation_with_peers_keeps_mapping_order():
    clock = FakeClock()
    log: list[str] = []
    costs = {name: [1.0] * 3 for name in ("tvm", "jitbyoc", "torch", "onnxruntime")}
    time_alternating(fake_workloads(clock, costs, log), repeat=2, warmup=1, clock=clock)
    assert log == ["tvm", "jitbyoc", "torch", "onnxruntime"] * 3


@pytest.mark.parametrize("repeat, warmup", [(0, 1), (1, 0)])
def test_alternation_rejects_empty_rounds(repeat, warmup):
    with pytest.raises(ValueError):
        time_alternating({"a": lambda: None}, repeat=repeat, warmup=warmup)


def test_max_errors():
    ref = [np.array([[1.0, -4.0], [0.0, 2.0]], dtype="float32"), np.array([10.0])]
    out = [np.array([[1.0, -4.5], [0.0, 2.0]], dtype="float32"), np.array([10.25])]
    abs_err, rel_err = max_errors(out, ref)
    assert abs_err == 0.5
    assert rel_err == 0.5 / 10.0  # normwise: divided by max|ref| over all outputs
    assert max_errors(ref, ref) == (0.0, 0.0)
    assert math.isnan(max_errors([np.array([np.nan, 1.0])], [np.array([1.0, 1.0])])[0])
    with pytest.raises(ValueError):
        max_errors([np.zeros(3)], [np.zeros(4)])


def test_fmt_ms():
    assert report.fmt_ms(None) == "-"
    assert report.fmt_ms(1.8) == "1800"
    assert report.fmt_ms(0.0123) == "12.3"
    assert report.fmt_ms(0.00123) == "1.23"
    assert report.fmt_ms(0.0000123) == "0.012"


def test_select():
    quick = [e.name for e in models.select(None, quick=True)]
    full = [e.name for e in models.select(None, quick=False)]
    assert "seeds_10x10" in quick and set(quick) < set(full)
    picked = models.select(["mlp", "seeds_10x10"], quick=True)
    assert [e.name for e in picked] == ["mlp", "seeds_10x10"]
    with pytest.raises(KeyError, match="known"):
        models.select(["no_such_model"], quick=False)


def test_seeds_model_matches_numpy():
    import tvm
    from tvm import relax

    import jitbyoc

    case = models.seeds_10x10()
    x0, x1, x2, x3 = case.inputs
    with jitbyoc.disabled():
        ex = tvm.compile(case.mod, target="llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, case.inputs))
    np.testing.assert_allclose(got.numpy(), (x0 + x1 - x2) * x3, rtol=1e-6)


# ---- the slow one: a real quick run -------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("tqdm", reason="the harness needs the bench extra: pip install '.[bench]'")
    pytest.importorskip("matplotlib", reason="the harness needs the bench extra")
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def _table_models(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("---"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("speedup ="))
    return [ln.split()[0] for ln in lines[start + 1:end]]


@pytest.mark.slow
def test_quick_outputs_agree(quick_run):
    out, stdout = quick_run
    data = json.loads((out / "results.json").read_text())
    with (out / "results.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    names = [r["model"] for r in data["rows"]]
    assert names and names == [r["model"] for r in csv_rows] == _table_models(stdout)
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for s in data["skipped"]:
        assert f"SKIPPED {s['model']}: " in stdout
    assert data["machine"]["cpu"] and data["machine"]["cpu"] in stdout
    for row, crow in zip(data["rows"], csv_rows):
        for key in ("speedup", "tvm_median_s", "jitbyoc_median_s", "max_rel_err", "offload_share"):
            assert float(crow[key]) == pytest.approx(row[key], rel=1e-12)


@pytest.mark.slow
def test_quick_numbers_are_consistent(quick_run):
    out, _ = quick_run
    rows = json.loads((out / "results.json").read_text())["rows"]
    for r in rows:
        assert r["speedup"] == pytest.approx(r["tvm_median_s"] / r["jitbyoc_median_s"])
        for who in ("tvm", "jitbyoc"):
            assert 0 < r[f"{who}_min_s"] <= r[f"{who}_median_s"] <= r[f"{who}_max_s"]
        for key in ("build_cold_tvm_s", "build_cold_jitbyoc_s", "build_warm_tvm_s",
                    "build_warm_jitbyoc_s"):
            assert r[key] > 0
        assert math.isfinite(r["max_abs_err"]) and 0 <= r["max_rel_err"] < 1e-3 and r["ok"]
        assert r["offload_share"] == pytest.approx(r["offloaded_ops"] / r["total_ops"])
        for peer in ("torch", "onnxruntime"):
            if r[f"{peer}_median_s"] is not None:
                ratio = r["tvm_median_s"] / r[f"{peer}_median_s"]
                assert r[f"{peer}_vs_tvm"] == pytest.approx(ratio)
                assert r[f"{peer}_max_rel_err"] < 1e-3
    by_name = {r["model"]: r for r in rows}
    assert by_name["seeds_10x10"]["offload_share"] == 1.0 and by_name["seeds_10x10"]["regions"] == 1
    # 3 matmul + 3 add + 2 relu, whichever of them jitbyoc takes
    assert by_name["mlp"]["model_ops"] == 8 and by_name["mlp"]["offloaded_ops"] > 0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity needs Linux")
def test_busy_cpu_spins_on_that_cpu_only_and_stops(monkeypatch):
    from bench.__main__ import busy_cpu

    monkeypatch.delenv("JITBYOC_BENCH_BUSY_CPU", raising=False)
    cpu = min(os.sched_getaffinity(0))
    with busy_cpu(cpu) as spin:
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(spin.pid) != {cpu}:  # the child pins itself first thing
            assert spin.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert os.environ["JITBYOC_BENCH_BUSY_CPU"] == str(cpu)
    assert spin.poll() is not None and "JITBYOC_BENCH_BUSY_CPU" not in os.environ


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity needs Linux")
def test_busy_cpu_refuses_a_cpu_the_process_may_not_use():
    from bench.__main__ import busy_cpu

    with pytest.raises(SystemExit, match="--busy-cpu 4096: this process may run on CPUs"), busy_cpu(4096):
        pass


@pytest.mark.parametrize("target, avx2_kernel", [("haswell", True), ("skylake-avx512", False), (None, False)])
def test_numpy_runs_openblas_kernel_of_the_targets_isa(monkeypatch, target, avx2_kernel):
    """An AVX2 target's sgemm is compared with OpenBLAS's AVX2 kernel, not its AVX-512 one
    (which the target cannot use); the holds this machine may set are lifted otherwise."""
    import platform

    from bench import kernels_matmul

    if avx2_kernel and platform.machine() != "x86_64":
        pytest.skip("OpenBLAS's x86 kernels exist on x86-64 only")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Sandybridge")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "262144")
    held = kernels_matmul.openblas_for(target)
    assert held == {"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_L2_SIZE": "262144"}
    assert "OPENBLAS_L2_SIZE" not in os.environ
    assert os.environ.get("OPENBLAS_CORETYPE") == ("Haswell" if avx2_kernel else None)


def test_the_peak_takes_turns_with_the_kernels_and_reports_its_own_rate():
    """``bench_case`` times the FMA loop in the case's own blocks; its rate is the loop's
    FLOPs over the loop's median, kept apart from the candidates' times."""
    from bench import kernels_matmul

    case = kernels_matmul.sgemm_case(32, np.random.default_rng(0))
    ran = []

    def fake_peak():
        ran.append(1)
        time.sleep(0.002)

    sticks = {"peak": (fake_peak, 2e6), "mix": (fake_peak, 1e6)}
    out = kernels_matmul.bench_case(case, rounds=2, with_tvm=False, yardsticks=sticks)
    assert ran and "peak" not in out and "mix" not in out and out["jitbyoc"] > 0
    assert 0.2 < out["peak_gflops"] <= 1.0 and 0.1 < out["mix_gflops"] <= 0.5  # FLOPs in at least 2 ms
    assert "of the FMA loop" in kernels_matmul.report(case, out, peak=100.0)


@pytest.mark.parametrize("cpu", ["haswell", None])
def test_the_mix_loop_runs_a_kernels_step_on_l1_data(cpu):
    """bench.contention's mix loop: per tap V vector loads, J broadcasts and J x V FMAs
    (the conv engine's register block for the ISA), a 3x3 window of taps unrolled per
    step, n steps per call; its sum shows every FMA ran."""
    import ctypes

    import llvmlite.binding as llvm

    from bench import contention, target
    from jitbyoc.peak import jit_loop, lanes
    from jitbyoc.render import isa

    target.set_target(cpu)
    try:
        with isa.compiling_for(target.machine()):
            j, v = contention.BLOCKS[32 if isa.vector_registers() >= 32 else 16]
            text = contention.mix_ir(lanes(), j, v)
            loop, engine = jit_loop(text, "mix", (ctypes.c_int64, ctypes.c_void_p))
            m = isa.current()
            tm = llvm.Target.from_triple(m.triple).create_target_machine(cpu=m.cpu, features=m.features, opt=3)
            asm = tm.emit_assembly(llvm.parse_assembly(text))
    finally:
        target.set_target(None)
    buf = np.full(contention.BUFFER_FLOATS, 1e-3, np.float32)
    assert loop(1000, buf.ctypes.data) == pytest.approx(9 * j * v * 1000 * 1e-6, rel=1e-3)
    assert asm.count("vfmadd") == 9 * j * v and (cpu != "haswell" or asm.count("vbroadcastss") == 9 * j)
    assert (j, v) == ((4, 3) if cpu == "haswell" else contention.BLOCKS[32 if "zmm" in asm else 16])


def test_contention_prints_both_loops_in_turns(capsys):
    from bench import contention

    ratios = contention.main(["--seconds", "0.3", "--threads", "1"])
    out = capsys.readouterr().out
    assert ratios and all(r > 0 for r in ratios) and "mix/fma over" in out


def test_the_int8_row_runs_the_quantized_layer_on_int8_against_the_vpdpbusd_loop():
    """bench.kernels_matmul's int8 row: the QDQ layer builds into an int8 product (no
    float product left), agrees with its float32 layer to the quantization's error, and
    is reported as a share of the loop it runs on (vpdpbusd, or AMX's tdpbusd tile loop)
    timed in its turns."""
    from bench import kernels_matmul
    from bench.kernel_common import vm_function
    from jitbyoc.tvm.prepare import prepare

    case = kernels_matmul.int8_case(8, 64, 32, np.random.default_rng(0))
    text = prepare(case["mod"], {"relax.dequantize", "relax.matmul"}).script()
    assert 'R.matmul(' in text and 'out_dtype="int32"' in text
    got, want = (vm_function(case[k], True, case["args"])() for k in ("mod", "fp32"))
    got, want = (v.numpy() for v in (got, want))
    assert np.abs(got - want).max() < 0.2  # two quantizations of 0.05 and the inputs' of ~0.03
    out = kernels_matmul.bench_narrow_case(case, rounds=2, threads=1)
    assert out["jitbyoc"] > 0 and out["dot_gflops"] > 0
    assert f"of the {kernels_matmul.loop_name('uint8')} loop" in kernels_matmul.report_narrow(case, out)
