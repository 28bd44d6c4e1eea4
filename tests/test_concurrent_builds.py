"""Builds from several threads at once: each ``tvm.compile`` has a build session of its
own, and TVM's part of every build takes turns (:data:`jitbyoc.tvm.turn.TVM_TURN`).

TVM alone is not thread-safe here: its ``BlockBuilder`` keeps a class-level stack and
``LegalizeOps`` enters a process-wide TE tag scope ("nested op_tag is not allowed"). The
models are made before the threads start (making them uses that ``BlockBuilder`` stack);
the threads only build and run."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from tests.conftest import build_model, run

RNG = np.random.default_rng(41)
THREADS = 6


def _model(i: int):
    """A small model of its own for each ``i`` (distinct shapes, weights and ops), with its
    numpy reference and an input."""
    m, k, n = 2 + i % 5, 8 + 4 * (i % 7), 16 + 8 * (i % 3)
    w = RNG.standard_normal((k, n)).astype("float32")
    b = RNG.standard_normal(n).astype("float32")
    last = ("relu", "tanh", "softmax")[i % 3]

    def body(bb, x):
        y = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(w)), relax.const(b)))
        return bb.emit({"relu": relax.op.nn.relu, "tanh": relax.op.tanh,
                        "softmax": relax.op.nn.softmax}[last](y))

    def reference(x):
        y = x.astype("float64") @ w + b
        if last == "softmax":
            e = np.exp(y - y.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        return np.maximum(y, 0) if last == "relu" else np.tanh(y)

    x = RNG.standard_normal((m, k)).astype("float32")
    return build_model({"x": ((m, k), "float32")}, body), reference, x


def _build(mod, mode: str):
    """``mode``: "on" (plain tvm.compile with jitbyoc on), "off" (inside a
    ``jitbyoc.disabled()`` block: TVM alone) or "explicit" (the "jitbyoc" pipeline)."""
    if mode == "explicit":
        return relax.build(mod, "llvm", relax_pipeline="jitbyoc"), jitbyoc.last_report()
    if mode == "off":
        with jitbyoc.disabled():
            return tvm.compile(mod, target="llvm"), None
    return tvm.compile(mod, target="llvm"), None


def _build_and_check(case) -> str | None:
    """Build and run one model; what went wrong, or None."""
    i, mode, (mod, reference, x) = case
    try:
        ex, rep = _build(mod, mode)
        got = run(relax.VirtualMachine(ex, tvm.cpu()), x)
    except Exception as err:  # noqa: BLE001 - the test reports every failure
        return f"model {i} ({mode}): {type(err).__name__}: {err}"
    if not np.allclose(got, reference(x), rtol=1e-4, atol=1e-5):
        return f"model {i} ({mode}): wrong result"
    if rep is not None:  # this thread's report is this build's, not another thread's
        inputs = [s for r in rep.regions for s in r.inputs]
        want = f"float32[{x.shape[0]}x{x.shape[1]}]"
        if not rep.regions or not any(want in s for s in inputs):
            return f"model {i} ({mode}): the report is another build's: {inputs}"
    return None


@pytest.mark.parametrize("rounds", [4])
def test_threads_build_distinct_models_at_once_on_and_off(rounds):
    """N threads build distinct models, jitbyoc on, off and explicit, mixed: no error,
    every result right, every report the thread's own build's."""
    models = [_model(i) for i in range(18)]
    modes = ("on", "off", "explicit")
    cases = [(i, modes[(i + r) % 3], models[i]) for r in range(rounds) for i in range(len(models))]
    start = threading.Barrier(THREADS)

    def worker(chunk):
        start.wait(timeout=60)  # every thread starts building at once
        return [_build_and_check(c) for c in chunk]

    with jitbyoc.enabled(), ThreadPoolExecutor(THREADS) as pool:
        chunks = [cases[t::THREADS] for t in range(THREADS)]
        problems = [p for found in pool.map(worker, chunks) for p in found if p]
    assert problems == [], problems


def test_only_tvms_part_of_a_build_takes_the_turn(monkeypatch):
    """TVM_TURN is held while TVM's passes run (partitioning's pattern matching and
    merging, RunCodegen) and not while jitbyoc lowers regions or compiles them, so
    builds in several threads overlap there."""
    from jitbyoc.tvm import codegen, partition
    from jitbyoc.tvm.turn import TVM_TURN
    held: dict[str, list] = {"merge": [], "lower": [], "compile": [], "codegen": []}

    def noting(name, fn):
        return lambda *a, **k: held[name].append(TVM_TURN._is_owned()) or fn(*a, **k)

    monkeypatch.setattr(partition, "merge_regions", noting("merge", partition.merge_regions))
    monkeypatch.setattr(partition.lower, "lower_region", noting("lower", partition.lower.lower_region))
    monkeypatch.setattr(codegen.driver, "build_regions", noting("compile", codegen.driver.build_regions))
    monkeypatch.setattr(codegen.session, "find", noting("codegen", codegen.session.find))
    mod, reference, x = _model(99)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert held == {"merge": [True], "lower": [False], "compile": [False], "codegen": [True]}, held
    np.testing.assert_allclose(run(relax.VirtualMachine(ex, tvm.cpu()), x), reference(x), rtol=1e-4, atol=1e-5)
