"""``python -m bench --suite zoo --precision int8``: the int8 QDQ copies (``bench/qdq.py``),
made once and cached, a failed quantization a skip; one zoo row of a tiny classifier at
int8 with its peers (onnxruntime and OpenVINO on the same QDQ file, OpenVINO on the fp32
file), accuracy and table; and the CLI end to end on SqueezeNet, the zoo's smallest model."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _classifier_onnx(opset: int = 11):
    """A tiny ONNX classifier (4 x 64 -> 10 classes, constant weights) at an opset older
    than 13, so its QDQ copy goes through the version converter."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 10)) / 8).astype("float32"), "w"),
             numpy_helper.from_array((rng.standard_normal(10) / 10).astype("float32"), "b")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=6)
    return model, rng.standard_normal((4, 64)).astype("float32")


def _entry(name: str = "tiny_int8"):
    """The tiny classifier as a zoo Entry (its case carries the ONNX file, as the onnx_* do)."""
    from tvm.relax.frontend.onnx import from_onnx

    from bench.case import Case
    from bench.models import Entry

    model, x = _classifier_onnx()

    def make():
        return Case(from_onnx(model, keep_params_in_input=False), [x],
                    onnx_model=model.SerializeToString())

    return Entry(name, make, "a linear classifier", 1, suite="zoo")


def _fp32_file(tmp_path, opset: int = 11) -> tuple[str, np.ndarray]:
    import onnx

    model, x = _classifier_onnx(opset)
    path = tmp_path / "tiny.onnx"
    onnx.save(model, path)
    return str(path), x


# ---- the QDQ copy ----------------------------------------------------------------------------


def test_calibration_batches_are_seeded_and_drawn_like_the_inputs():
    from bench.qdq import calibration_batches

    ids = np.array([[3, 17, 29999]], dtype="int64")
    image = np.zeros((1, 3, 8, 8), "float32")
    first, again = calibration_batches([image, ids], "m"), calibration_batches([image, ids], "m")
    assert len(first) == 4 and all(len(b) == 2 for b in first)
    for (a, i), (a2, i2) in zip(first, again):
        assert a.dtype == np.float32 and a.shape == image.shape and np.array_equal(a, a2)
        assert i.dtype == np.int64 and 3 <= i.min() and i.max() <= 29999 and np.array_equal(i, i2)
    assert not np.array_equal(first[0][0], first[1][0])  # four different batches
    assert not np.array_equal(calibration_batches([image], "other")[0][0], first[0][0])


def test_the_qdq_copy_is_made_by_the_recipe(tmp_path):
    import onnx
    from onnx import numpy_helper

    from bench.qdq import OPSET, opset_of, qdq_copy

    src, x = _fp32_file(tmp_path)
    path, why = qdq_copy(src, [x], "tiny", tmp_path / "cache")
    assert why is None and path.endswith(".qdq.onnx") and path.startswith(str(tmp_path / "cache"))
    model = onnx.load(path)
    assert opset_of(model) == OPSET  # converted up from 11
    ops = [n.op_type for n in model.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and "MatMul" in ops  # QDQ, not QOperator
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    zero_points = [inits[n.input[2]] for n in model.graph.node
                   if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    assert zero_points and all(z.dtype == np.uint8 for z in zero_points)  # uint8 activations
    weight = next(n for n in model.graph.node if n.op_type == "DequantizeLinear"
                  and inits.get(n.input[0]) is not None and inits[n.input[0]].dtype == np.int8)
    assert inits[weight.input[1]].shape == (10,)  # int8 weight, one scale per channel


def test_the_qdq_copy_is_cached_and_remade_for_a_changed_source(tmp_path, monkeypatch):
    import onnx
    from onnx import numpy_helper

    from bench import qdq

    src, x = _fp32_file(tmp_path)
    cache = tmp_path / "cache"
    first, _ = qdq.qdq_copy(src, [x], "tiny", cache)

    def no_quantizing(*args):
        raise AssertionError("a cached copy was quantized again")

    with monkeypatch.context() as patched:
        patched.setattr(qdq, "make_copy", no_quantizing)
        again, why = qdq.qdq_copy(src, [x], "tiny", cache)
    assert why is None and again == first  # from the cache
    model = onnx.load(src)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(10, 0.5, "float32"), "b"))
    onnx.save(model, src)  # a changed source: another bias
    changed, why = qdq.qdq_copy(src, [x], "tiny", cache)
    assert why is None and changed != first
    assert [p.name for p in cache.iterdir()] == [changed.rsplit("/", 1)[1]]  # the stale one went


def test_a_failed_quantization_is_a_skip_note(tmp_path, monkeypatch):
    from bench import qdq
    from bench.case import Skip
    from bench.zoo_run import measure

    def broken(*args, **kwargs):
        raise RuntimeError("the quantizer fell over")

    monkeypatch.setattr(qdq, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(qdq, "quantize", broken)
    src, x = _fp32_file(tmp_path)
    path, why = qdq.qdq_copy(src, [x], "tiny")
    assert path is None and why == "quantization failed: RuntimeError: the quantizer fell over"
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written is left to reuse
    got = measure(_entry(), rounds=1, workdir=str(tmp_path), threads=1, with_peers=True,
                  peak=100.0, precision="int8")
    assert isinstance(got, Skip)
    assert got.reason == "no int8 QDQ copy: quantization failed: RuntimeError: the quantizer fell over"


# ---- one zoo row at int8, with its peers -------------------------------------------------------


@pytest.fixture(scope="module")
def int8_row(tmp_path_factory):
    """The tiny classifier at --precision int8 with every int8 peer (QDQ copy cached in a
    temporary directory)."""
    pytest.importorskip("openvino")
    from bench import qdq
    from bench.zoo_run import measure

    workdir = tmp_path_factory.mktemp("zoo")
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(qdq, "CACHE_DIR", workdir / "qdq")
        row = measure(_entry(), rounds=1, workdir=str(workdir), threads=1, with_peers=True,
                      peak=100.0, precision="int8", narrow_peak=400.0)
    return row


def test_int8_row_builds_the_qdq_copy_and_runs_its_peers_on_it(int8_row):
    row = int8_row
    assert isinstance(row, dict), row
    assert row["precision"] == row["jitbyoc_precision"] == row["tvm_precision"] == "int8"
    assert row["qdq_file"].endswith(".qdq.onnx") and row["quantize_s"] > 0
    assert row["offloaded_ops"] > 0 and row["lowered_gflop"] is None
    for peer in ("onnxruntime_int8", "openvino_int8"):  # the same QDQ file
        assert row[f"{peer}_precision"] == "int8" and row[f"{peer}_median_s"] > 0
        assert row[f"ratio_{peer}"] == pytest.approx(row["jitbyoc_median_s"] / row[f"{peer}_median_s"])
    assert row["openvino_f32_precision"] == "fp32" and row["openvino_median_s"] > 0  # the fp32 file
    assert row["onnxruntime_median_s"] is None and row["torch_median_s"] is None
    assert row["fastest_peer"] in ("onnxruntime_int8", "openvino_int8", "tvm")  # not jitbyoc's fp32
    # jitbyoc's own fp32 build, timed in turns: the int8 build's speed-up over it
    assert row["jitbyoc_fp32_precision"] == "fp32" and row["jitbyoc_fp32_median_s"] > 0
    assert row["ratio_jitbyoc_fp32"] == pytest.approx(row["jitbyoc_median_s"] / row["jitbyoc_fp32_median_s"])
    assert row["jitbyoc_fp32_cos_err"] is None  # the reference itself: no accuracy column
    # % peak: the model's GOP at the int8 loop's rate (400 here) over jitbyoc's time
    assert row["jitbyoc_peak_pct"] == pytest.approx(100 * row["gflop"] / 400.0 / row["jitbyoc_median_s"])


def test_int8_row_has_every_int8_candidates_accuracy_against_the_fp32_model(int8_row):
    row = int8_row
    assert row["reference"] == "tvm" and row["ok"] is None  # compared, not judged
    assert row["max_rel_err"] is not None and "MISMATCH" not in (row["notes"] or "")
    for who in ("jitbyoc", "onnxruntime_int8", "openvino_int8"):
        assert 0 < row[f"{who}_cos_err"] < 1e-2, who  # int8 moved the logits, a little
        assert row[f"{who}_top1"] >= 0.75, who
    assert row["openvino_f32_cos_err"] < 1e-10  # fp32 on the fp32 file: the reference's


def test_int8_table_heads_the_qdq_peers_and_their_accuracy(int8_row):
    from bench.zoo_report import format_table
    from bench.zoo_run import summarize

    machine = {"cpu_model": "a CPU", "cpu": "znver4", "cpu_bf16": ["avx512_bf16"],
               "cpu_int8": ["avx512_vnni"], "cores": 2, "threads": 1, "python": "3",
               "peak_gflops": 100.0, "int8_peak_gflops": 400.0}
    text = format_table([int8_row], [], machine, summarize([int8_row]))
    head = text.splitlines()[1]
    for column in ("jitbyoc ms [int8]", "jit fp32 ms [fp32]", "jit/jit fp32", "ort qdq ms [int8]",
                   "ov qdq ms [int8]", "ov f32 ms [fp32]",
                   "jit/ort qdq", "jit/ov qdq", "1-cos jit", "top1 jit", "1-cos ort qdq",
                   "top1 ov qdq"):
        assert column in head, column
    assert "bf16 GFLOP" not in head and "ort ms" not in head
    assert "(llvm cpu znver4, avx512_bf16, avx512_vnni)" in text.splitlines()[0]
    assert "vpdpbusd loop's 400 GOP/s" in text


def test_an_openvino_crash_on_the_qdq_file_is_a_note(tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    from bench import peer_openvino, peers, qdq

    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(peer_openvino, "probe_command", lambda *args: crash)
    monkeypatch.setattr(qdq, "CACHE_DIR", tmp_path / "qdq")
    case = _entry().make()
    got, notes = peers.make_peers(case, str(tmp_path), "tiny", 1, ("onnxruntime_int8", "openvino_int8"))
    assert [(p.name, p.precision) for p in got] == [("onnxruntime_int8", "int8")]
    assert notes and notes[0].startswith("openvino_int8: crashed: SIGSEGV in the probe")


# ---- the CLI -----------------------------------------------------------------------------------


def test_int8_needs_the_zoo_suite():
    from bench.__main__ import main

    assert main(["--precision", "int8", "--model", "mlp", "--keep-cache"]) == 2


def test_int8_zoo_runs_end_to_end_on_squeezenet(tmp_path, monkeypatch, capsys):
    """``python -m bench --suite zoo --precision int8 --model onnx_squeezenet``
    (:func:`run_squeezenet`): the light model is converted to opset 13, quantized,
    imported, built, checked against TVM's build and timed."""
    from bench import kernels_matmul, qdq

    monkeypatch.setattr(qdq, "CACHE_DIR", tmp_path / "qdq")
    data, stdout = run_squeezenet("int8", tmp_path, monkeypatch, capsys)
    row = data["rows"][0]
    assert row["precision"] == "int8" and row["reference"] == "tvm" and row["jitbyoc_median_s"] > 0
    assert row["jitbyoc_cos_err"] is not None and row["qdq_file"].startswith(str(tmp_path / "qdq"))
    assert data["settings"]["int8"]["per_channel"] and data["machine"]["int8_peak_gflops"] == 400.0
    assert "jitbyoc ms [int8]" in stdout and f"{kernels_matmul.loop_name('uint8')} loop 400.0" in stdout


def run_squeezenet(precision: str, tmp_path, monkeypatch, capsys) -> tuple[dict, str]:
    """``python -m bench --suite zoo --precision <precision> --model onnx_squeezenet`` in
    this process, one round, without peers (the row tests have them) and with stand-in
    peaks (the peak loops are not what is tested): results.json and what it printed."""
    pytest.importorskip("tqdm", reason="the harness needs the bench extra")
    from bench import kernels_matmul
    from bench.__main__ import main
    from bench.zoo_onnx import LIGHT_MODELS, light_path

    if not os.path.exists(light_path(LIGHT_MODELS["squeezenet"])):
        pytest.skip("light_squeezenet.onnx is not in this onnx wheel")
    monkeypatch.setattr(kernels_matmul, "machine_peak", lambda threads: 100.0)
    monkeypatch.setattr(kernels_matmul, "dot_machine_peak", lambda product, threads: 400.0)
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    out = tmp_path / "out"
    argv = ["--suite", "zoo", "--precision", precision, "--model", "onnx_squeezenet", "--repeat",
            "1", "--threads", "1", "--no-peers", "--keep-cache", "--out", str(out)]
    torch_threads = _torch_threads()
    try:
        assert main(argv) == 0
    finally:  # main sets torch's thread count for the process: the later tests get it back
        _torch_threads(torch_threads)
    data = json.loads((out / "results.json").read_text())
    assert not data["skipped"] and [r["model"] for r in data["rows"]] == ["onnx_squeezenet"]
    return data, capsys.readouterr().out


def _torch_threads(count: int | None = None) -> int | None:
    """torch's intra-op thread count (None without torch); set it first if ``count``."""
    from bench.peers import version

    if version("torch") is None:
        return None
    import torch

    if count:
        torch.set_num_threads(count)
    return torch.get_num_threads()


def test_an_output_softmax_stays_float_in_the_copy(tmp_path):
    """A classifier ending in Softmax: the softmax that makes the output is not
    quantized (its probabilities would round to 0), the product before it is."""
    import onnx
    from onnx import TensorProto, helper

    from bench.qdq import output_softmax, qdq_copy

    model, x = _classifier_onnx()
    graph = model.graph
    graph.node.append(helper.make_node("Softmax", ["y"], ["p"], name="probs"))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [4, 10]))
    src = tmp_path / "soft.onnx"
    onnx.save(model, src)
    assert output_softmax(model) == ["probs"]
    path, why = qdq_copy(str(src), [x], "soft", tmp_path / "cache")
    assert why is None
    nodes = onnx.load(path).graph.node
    producer = {o: n for n in nodes for o in n.output}
    assert producer["p"].op_type == "Softmax"  # not a DequantizeLinear of its quantized output
    assert "QuantizeLinear" in [n.op_type for n in nodes]  # the MatMul before it is still quantized
