"""The zoo suite's own pieces (``python -m bench --suite zoo``), without running it: the
ONNX light-model materializer, the FLOP counter, the block timer, the ratios, the accuracy
measures of ``--precision bf16`` and ``--list``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import models
from bench.timing import Stats, time_blocks

REPO = Path(__file__).resolve().parents[1]


def _light(stem: str):
    onnx = pytest.importorskip("onnx")
    from bench.zoo_onnx import light_path

    path = light_path(stem)
    if not Path(path).exists():
        pytest.skip(f"{path} is not in this onnx wheel")
    return onnx, onnx.load(path)


@pytest.mark.parametrize("stem", ["squeezenet", "shufflenet"])
def test_materializer_turns_every_fill_into_an_initializer(stem):
    from onnx import numpy_helper

    from bench.zoo_onnx import materialize

    onnx, model = _light(stem)
    inits = {t.name: t for t in model.graph.initializer}
    fills = {n.output[0]: tuple(numpy_helper.to_array(inits[n.input[0]]))
             for n in model.graph.node if n.op_type == "ConstantOfShape"}
    assert fills  # the light files keep their weights as fills
    out = materialize(model, stem)
    onnx.checker.check_model(out)
    assert not [n for n in out.graph.node if n.op_type == "ConstantOfShape"]
    weights = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    for name, shape in fills.items():
        w = weights[name]
        assert w.shape == shape and w.dtype == np.float32 and np.isfinite(w).all()
        assert w.size == 1 or w.std() > 0  # random, not the fill's constant
    assert not {i.name for i in out.graph.input} & set(weights)  # constants, not inputs
    assert [i.name for i in out.graph.input] == ["gpu_0/data_0" if stem == "shufflenet" else "data_0"]


def test_materializer_is_deterministic_and_batch_norm_variances_are_positive():
    from onnx import numpy_helper

    from bench.zoo_onnx import materialize

    _, first = _light("shufflenet")
    _, second = _light("shufflenet")
    a, b = materialize(first, "shufflenet"), materialize(second, "shufflenet")
    assert a.SerializeToString() == b.SerializeToString()
    weights = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    variances = [n.input[4] for n in a.graph.node if n.op_type == "BatchNormalization"]
    assert variances and all((weights[v] > 0).all() for v in variances if v in weights)


def test_flop_count_of_a_tiny_module_is_exact():
    from tvm import relax

    from bench.flops import count_flops
    from bench.kernel_common import module

    def body(bb, x, w, g, gw, a, b):
        bb.emit(relax.op.nn.conv2d(x, w, padding=1))  # (1, 4, 8, 8)
        bb.emit(relax.op.nn.conv2d(g, gw, groups=2))  # (1, 4, 4, 4)
        return bb.emit(relax.op.matmul(a, b))  # (2, 5, 3)

    mod = module([("x", (1, 3, 8, 8)), ("w", (4, 3, 3, 3)), ("g", (1, 4, 6, 6)),
                  ("gw", (4, 2, 3, 3)), ("a", (2, 5, 7)), ("b", (7, 3))], body)
    conv = 1 * 4 * 8 * 8 * (3 * 3 * 3)  # outputs x (input channels x window)
    grouped = 1 * 4 * 4 * 4 * (2 * 3 * 3)  # 2 input channels per group
    matmul = 2 * 5 * 3 * 7
    assert count_flops(mod) == 2 * (conv + grouped + matmul) == 16548


def test_block_timer_takes_turns_in_blocks():
    now, log = [0.0], []

    def clock():
        return now[0]

    def make(name, cost):
        def run():
            log.append(name)
            now[0] += cost
        return run

    samples = time_blocks({"a": make("a", 0.375), "b": make("b", 0.25)}, rounds=2, budget=0.5,
                          settle=0.0, clock=clock, sleep=lambda s: None)
    # per block: one untimed call, then timed calls until the budget is spent (the costs
    # are binary fractions: exact sums); the second round runs in the reverse order
    assert log == ["a"] * 3 + ["b"] * 4 + ["b"] * 4 + ["a"] * 3
    assert samples == {"a": [0.375] * 4, "b": [0.25] * 6}
    with pytest.raises(ValueError):
        time_blocks({"a": make("a", 1.0)}, rounds=0)


def test_ratios_and_peak_share():
    from bench.zoo_run import geomean, timing_fields

    stats = {"jitbyoc": Stats(0.02, 0.02, 0.02, 3), "onnxruntime": Stats(0.01, 0.01, 0.01, 3),
             "torch": Stats(0.04, 0.04, 0.04, 3)}
    row = timing_fields(stats, flops=2_000_000_000, peak=200.0)
    assert row["jitbyoc_gflops"] == pytest.approx(100.0)
    assert row["jitbyoc_peak_pct"] == pytest.approx(50.0)
    assert row["ratio_onnxruntime"] == pytest.approx(2.0) and row["ratio_torch"] == pytest.approx(0.5)
    assert row["fastest_peer"] == "onnxruntime" and row["ratio_fastest"] == pytest.approx(2.0)
    assert geomean([2.0, 0.5, None]) == pytest.approx(1.0)


def test_peak_share_of_bf16_products_is_against_their_own_peak():
    """With --precision bf16, "% peak" is the time the model's FLOPs take at peak (the bf16
    ones at the vdpbf16ps loop's rate, the rest at the FMA loop's) over jitbyoc's: 1 GFLOP
    at 200 and 1 GFLOP at 100 GFLOP/s take 15 ms, half of 30 ms. Against the FMA loop
    alone the row said 67 %."""
    from bench.zoo_run import timing_fields

    row = timing_fields({"jitbyoc": Stats(0.03, 0.03, 0.03, 3)}, flops=2_000_000_000, peak=100.0,
                        lowered=1_000_000_000, narrow_peak=200.0)
    assert row["jitbyoc_peak_pct"] == pytest.approx(50.0)


def test_suites_select_apart():
    zoo = models.select(None, quick=False, suite="zoo")
    default = models.select(None, quick=False)
    assert zoo and all(e.suite == "zoo" for e in zoo)
    assert default and all(e.suite == "default" for e in default)
    assert {"onnx_resnet50", "torch_bert_base", "torch_vit_base"} <= {e.name for e in zoo}
    assert any(e.tvm_default for e in zoo) and not all(e.tvm_default for e in zoo)
    with pytest.raises(KeyError, match="suites"):
        models.select(["mlp", "onnx_squeezenet"], quick=False)
    with pytest.raises(KeyError, match="suite"):
        models.select(None, quick=False, suite="nope")


def test_list_shows_the_zoo_suite():
    pytest.importorskip("tqdm", reason="the harness needs the bench extra: pip install '.[bench]'")
    proc = subprocess.run([sys.executable, "-m", "bench", "--list"], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "suite default" in proc.stdout and "suite zoo (python -m bench --suite zoo)" in proc.stdout
    for name in ("onnx_vgg19", "torch_resnet50", "torch_bert_base", "mlp"):
        assert name in proc.stdout


def test_fastest_peer_runs_at_jitbyocs_precision():
    from bench.zoo_run import timing_fields

    stats = {"jitbyoc": Stats(0.02, 0.02, 0.02, 3), "onnxruntime": Stats(0.01, 0.01, 0.01, 3),
             "openvino": Stats(0.016, 0.016, 0.016, 3), "openvino_f32": Stats(0.03, 0.03, 0.03, 3)}
    precisions = {"jitbyoc": "bf16", "onnxruntime": "fp32", "openvino": "bf16", "openvino_f32": "fp32"}
    row = timing_fields(stats, flops=0, peak=0.0, precisions=precisions)
    assert row["fastest_peer"] == "openvino" and row["ratio_fastest"] == pytest.approx(1.25)
    assert row["ratio_onnxruntime"] == pytest.approx(2.0)  # every peer still has its ratio
    assert row["openvino_precision"] == "bf16" and row["onnxruntime_precision"] == "fp32"
    fp32 = timing_fields(stats, flops=0, peak=0.0, precisions={**precisions, "jitbyoc": "fp32"})
    assert fp32["fastest_peer"] == "onnxruntime"
    alone = timing_fields({k: stats[k] for k in ("jitbyoc", "onnxruntime")}, 0, 0.0, precisions)
    assert "fastest_peer" not in alone and "ratio_fastest" not in alone  # none at bf16


def test_cosine_error_and_top1_agreement():
    from bench.accuracy import accuracy_fields, class_scores, cosine_error, top1_agreement

    ref = [np.array([[1.0, 3.0, 2.0], [5.0, 1.0, 0.0]]), np.array([2.0])]
    assert cosine_error(ref, ref) == pytest.approx(0.0, abs=1e-15)
    assert cosine_error([2 * a for a in ref], ref) == pytest.approx(0.0, abs=1e-15)  # scale-free
    assert cosine_error([-a for a in ref], ref) == pytest.approx(2.0)
    nudged = [ref[0] + np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1e-3]]), ref[1]]
    assert 0 < cosine_error(nudged, ref) < 1e-7
    scores = [ref[0]]
    assert top1_agreement(scores, scores) == 1.0
    assert top1_agreement([np.array([[1.0, 2.0, 3.0], [5.0, 1.0, 0.0]])], scores) == 0.5
    assert top1_agreement(ref, ref) is None  # two outputs: not a classifier
    assert class_scores([np.zeros((1, 1000, 1, 1))]).shape == (1, 1000)  # SqueezeNet's
    assert class_scores([np.zeros((1, 128, 768))]) is None  # BERT's hidden states
    fields = accuracy_fields({"a": scores, "b": [np.roll(ref[0], 1, axis=1)]}, scores)
    assert fields["a_top1"] == 1.0 and fields["b_top1"] == 0.0 and fields["b_cos_err"] > 0.1


def test_bf16_is_checked_against_tvm_to_one_bfloat16_ulp():
    from bench.zoo_run import REFERENCES, TOLERANCES, check

    ref = [np.ones(8)]
    off = {err: [ref[0] + np.eye(8)[0] * err] for err in (5e-4, 5e-3, 1e-2)}

    def ok(err, precision, ran=("tvm",)):
        outputs = {"jitbyoc": off[err], **{name: ref for name in ran}}
        return check(outputs, [], REFERENCES[precision], TOLERANCES[precision])["ok"]

    assert ok(5e-4, "fp32") and not ok(5e-3, "fp32")
    assert ok(5e-3, "bf16") and not ok(1e-2, "bf16")
    assert ok(5e-3, "bf16", ran=("onnxruntime",)) is None  # fp32 peers are no bf16 reference
    assert not ok(5e-3, "fp32", ran=("onnxruntime",))


def test_bf16_activations_reach_lower_precision():
    """``--precision bf16 --activations bf16`` lowers with ``activations="bf16"`` (the row
    says so); the default keeps float32 activations."""
    from types import SimpleNamespace

    from bench import zoo_build
    from bench.__main__ import parse_args
    from tests.test_bf16_activations import _residual_model

    assert parse_args(["--suite", "zoo", "--precision", "bf16", "--activations", "bf16"]).activations == "bf16"
    assert parse_args(["--suite", "zoo"]).activations == "float32"
    mod, _ = _residual_model(np.random.default_rng(1), c=8, hw=5)
    widened = {}
    for activations in ("float32", "bf16"):
        low, fields = zoo_build.lower(SimpleNamespace(name="residual"), SimpleNamespace(mod=mod), "bf16", None,
                                      activations)
        assert fields["activations"] == activations
        widened[activations] = low.script().count('dtype="float32") = R.astype(')
    assert widened == {"float32": 0, "bf16": 1}, widened


def test_the_onnx_export_of_mobilenet_v2_leaves_nothing_to_tvm():
    """``onnx_mobilenet_v2``: the zoo's torch MobileNetV2 as its ONNX export through TVM's
    ONNX frontend, whose ReLU6s arrive as ``Clip`` (``call_tir``s of TOPI's maximum and
    minimum: jitbyoc.tvm.lift_te). Every op joins a region; nothing is compiled here."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    import jitbyoc
    from bench.zoo_torch import exported_model

    case = exported_model("mobilenet_v2")
    report = jitbyoc.report(case.mod)
    assert report.fallbacks == [] and report.offloaded_share == 1.0
    assert case.onnx_model is not None
