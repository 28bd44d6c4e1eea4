"""``python -m bench --suite zoo --precision fp16``: the float16 copies (``bench/fp16.py``),
float32 at the edges, sorted for TVM's frontend, made once and cached (beside the int8
copies, by the same code), a failed conversion a skip; one zoo row of a tiny classifier at
fp16 with its peers (onnxruntime and OpenVINO on the same float16 file, OpenVINO on the
fp32 file), accuracy and table; a runtime that cannot run the file a note; and the CLI
end to end on SqueezeNet, the zoo's smallest model. The tiny classifier and the CLI run
are :mod:`tests.test_bench_int8`'s."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from .test_bench_int8 import _entry, _fp32_file, run_squeezenet  # noqa: E402

MACHINE = {"cpu_model": "a CPU", "cpu": "znver4", "cpu_bf16": ["avx512_bf16"], "cores": 2,
           "threads": 1, "python": "3", "peak_gflops": 100.0}


# ---- the float16 copy --------------------------------------------------------------------------


def test_the_fp16_copy_is_float16_inside_float32_at_the_edges_and_sorted(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    from bench.fp16 import fp16_copy
    from bench.qdq import import_onnx

    src, x = _fp32_file(tmp_path)
    path, why = fp16_copy(src, "tiny", tmp_path / "cache")
    assert why is None and path.endswith(".fp16.onnx") and path.startswith(str(tmp_path / "cache"))
    model = onnx.load(path)
    edges = list(model.graph.input) + list(model.graph.output)
    assert [v.type.tensor_type.elem_type for v in edges] == [TensorProto.FLOAT] * 2
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.FLOAT16}
    known = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # in order: what TVM's frontend reads needs
        assert set(node.input) <= known, node.name
        known |= set(node.output)
    import_onnx(path)  # and it does read it
    fp32 = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    half = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert half.dtype == np.float32 and np.allclose(half, fp32, rtol=1e-2, atol=1e-2)


def test_the_fp16_copy_is_cached_beside_the_int8_one_and_remade_for_a_changed_source(
        tmp_path, monkeypatch):
    import onnx
    from onnx import numpy_helper

    from bench import fp16, qdq

    src, x = _fp32_file(tmp_path)
    cache = tmp_path / "cache"
    first, _ = fp16.fp16_copy(src, "tiny", cache)
    int8, _ = qdq.qdq_copy(src, [x], "tiny", cache)  # one directory holds both

    def no_converting(*args):
        raise AssertionError("a cached copy was converted again")

    with monkeypatch.context() as patched:
        patched.setattr(fp16, "make_copy", no_converting)
        again, why = fp16.fp16_copy(src, "tiny", cache)
    assert why is None and again == first  # from the cache
    model = onnx.load(src)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(10, 0.5, "float32"), "b"))
    onnx.save(model, src)  # a changed source: another bias
    changed, why = fp16.fp16_copy(src, "tiny", cache)
    assert why is None and changed != first
    # the stale fp16 copy went, the int8 one stays
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.rsplit("/", 1)[1] for p in (changed, int8))
    assert fp16.CACHE_DIR.parent == qdq.CACHE_DIR.parent


def test_a_failed_conversion_is_a_skip_note(tmp_path, monkeypatch):
    from bench import fp16
    from bench.case import Skip
    from bench.zoo_run import measure

    def broken(model):
        raise RuntimeError("the converter fell over")

    monkeypatch.setattr(fp16, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(fp16, "convert", broken)
    src, _ = _fp32_file(tmp_path)
    path, why = fp16.fp16_copy(src, "tiny")
    assert path is None and why == "conversion to float16 failed: RuntimeError: the converter fell over"
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written is left to reuse
    got = measure(_entry("tiny_fp16"), rounds=1, workdir=str(tmp_path), threads=1, with_peers=True,
                  peak=100.0, precision="fp16")
    assert isinstance(got, Skip)
    assert got.reason == "no fp16 copy: conversion to float16 failed: RuntimeError: the converter fell over"


# ---- one zoo row at fp16, with its peers -------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_row(tmp_path_factory):
    """The tiny classifier at --precision fp16 with every fp16 peer (float16 copy cached
    in a temporary directory)."""
    pytest.importorskip("openvino")
    from bench import fp16
    from bench.zoo_run import measure

    workdir = tmp_path_factory.mktemp("zoo")
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(fp16, "CACHE_DIR", workdir / "fp16")
        row = measure(_entry("tiny_fp16"), rounds=1, workdir=str(workdir), threads=1,
                      with_peers=True, peak=100.0, precision="fp16")
    return row


def test_fp16_row_builds_the_fp16_copy_and_runs_its_peers_on_it(fp16_row):
    row = fp16_row
    assert isinstance(row, dict), row
    assert row["precision"] == row["jitbyoc_precision"] == "fp16"
    # TVM's build sums float16 in float16, 1600x slower: built and timed, not run
    assert row["build_tvm_s"] > 0 and row["tvm_median_s"] is None
    assert row["fp16_file"].endswith(".fp16.onnx") and row["fp16_convert_s"] > 0
    assert row["fp16_import_s"] > 0 and row["qdq_file"] is None and row["lowered_gflop"] is None
    assert row["offloaded_ops"] > 0
    for peer in ("onnxruntime_fp16", "openvino_fp16"):  # the same float16 file
        assert row[f"{peer}_median_s"] > 0
        assert row[f"ratio_{peer}"] == pytest.approx(row["jitbyoc_median_s"] / row[f"{peer}_median_s"])
    assert row["onnxruntime_fp16_precision"] == "fp16"
    assert row["openvino_fp16_precision"] in ("fp16", "bf16", "fp32")  # what OpenVINO reads back
    assert row["openvino_f32_precision"] == "fp32" and row["openvino_median_s"] > 0  # the fp32 file
    assert row["onnxruntime_median_s"] is None and row["torch_median_s"] is None
    assert row["fastest_peer"] in ("onnxruntime_fp16", "openvino_fp16")
    # no narrow-product loop: % peak of the fp32 FMA loop's 100 GFLOP/s
    assert row["jitbyoc_peak_pct"] == pytest.approx(100 * row["gflop"] / 100.0 / row["jitbyoc_median_s"])


def test_fp16_row_has_every_fp16_candidates_accuracy_against_the_fp32_model(fp16_row):
    row = fp16_row
    assert row["reference"] is None and row["ok"] is None  # TVM's build not run (see above)
    assert "MISMATCH" not in (row["notes"] or "")
    for who in ("jitbyoc", "onnxruntime_fp16", "openvino_fp16"):
        assert 0 < row[f"{who}_cos_err"] < 1e-4, who  # float16 moved the logits, a little
        assert row[f"{who}_top1"] == 1.0, who
    assert row["openvino_f32_cos_err"] < 1e-10  # fp32 on the fp32 file: the reference's


def test_fp16_table_heads_the_fp16_peers_and_their_accuracy(fp16_row):
    from bench.zoo_report import format_table
    from bench.zoo_run import summarize

    text = format_table([fp16_row], [], MACHINE, summarize([fp16_row]))
    head = text.splitlines()[1]
    ov = fp16_row["openvino_fp16_precision"]
    for column in ("jitbyoc ms [fp16]", "ort fp16 ms [fp16]", f"ov fp16 ms [{ov}]", "ov f32 ms [fp32]",
                   "jit/ort fp16", "jit/ov fp16", "1-cos jit", "top1 jit", "1-cos ort fp16",
                   "1-cos ov fp16", "top1 ov fp16"):
        assert column in head, column
    assert "bf16 GFLOP" not in head and "ort ms" not in head and "qdq" not in head
    assert "% peak of 100 GFLOP/s measured" in text


def test_runtimes_that_cannot_run_the_fp16_file_are_notes(tmp_path, monkeypatch):
    """onnxruntime failing on the float16 file and OpenVINO crashing on it: the row has
    jitbyoc and TVM, and a note for each."""
    pytest.importorskip("openvino")
    import onnxruntime

    from bench import fp16, peer_openvino
    from bench.zoo_run import measure

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".fp16.onnx"):
            raise RuntimeError("no float16 kernels")
        return session(path, *args, **kwargs)

    session = onnxruntime.InferenceSession
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(peer_openvino, "probe_command", lambda *args: crash)
    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)
    monkeypatch.setattr(fp16, "CACHE_DIR", tmp_path / "fp16")
    row = measure(_entry("tiny_fp16"), rounds=1, workdir=str(tmp_path), threads=1, with_peers=True,
                  peak=100.0, precision="fp16")
    assert isinstance(row, dict), row
    assert row["jitbyoc_median_s"] > 0 and row["tvm_median_s"] is None and row["fastest_peer"] is None
    notes = row["notes"].split("; ")
    assert "onnxruntime_fp16: failed: RuntimeError: no float16 kernels" in notes
    assert any(n.startswith("openvino_fp16: crashed: SIGSEGV in the probe") for n in notes), notes


def test_a_tvm_build_failure_is_a_note_beside_jitbyocs_row(tmp_path, monkeypatch):
    """TVM's default build fails on the float16 ResNet-50 (a float32 conv2d added to its
    float16 bias in its own pipeline) where jitbyoc builds it: the row stays, with a note."""
    from bench import fp16, target
    from bench.zoo_run import measure

    def tvm_fails(mod, offload):
        raise TypeError("Binary operators must have the same datatype for both operands.")

    monkeypatch.setattr(target, "build", tvm_fails)
    monkeypatch.setattr(fp16, "CACHE_DIR", tmp_path / "fp16")
    row = measure(_entry("tiny_fp16"), rounds=1, workdir=str(tmp_path), threads=1, with_peers=False,
                  peak=100.0, precision="fp16")
    assert isinstance(row, dict), row
    assert row["jitbyoc_median_s"] > 0 and row["build_tvm_s"] is None
    assert "TVM's default build failed: TypeError: Binary operators" in row["notes"]


# ---- the CLI -----------------------------------------------------------------------------------


def test_fp16_needs_the_zoo_suite():
    from bench.__main__ import main

    assert main(["--precision", "fp16", "--model", "mlp", "--keep-cache"]) == 2


def test_fp16_zoo_runs_end_to_end_on_squeezenet(tmp_path, monkeypatch, capsys):
    """``python -m bench --suite zoo --precision fp16 --model onnx_squeezenet``
    (:func:`tests.test_bench_int8.run_squeezenet`): the light model is converted to
    float16, imported, built, compared with the fp32 model and timed (TVM's build not run:
    its float16 SqueezeNet takes seconds a call), every op offloaded (its dropout too)."""
    from bench import fp16

    monkeypatch.setattr(fp16, "CACHE_DIR", tmp_path / "fp16")
    data, stdout = run_squeezenet("fp16", tmp_path, monkeypatch, capsys)
    row = data["rows"][0]
    assert row["precision"] == "fp16" and row["reference"] is None and row["jitbyoc_median_s"] > 0
    assert row["jitbyoc_cos_err"] < 1e-4 and row["jitbyoc_top1"] == 1.0
    assert row["fp16_file"].startswith(str(tmp_path / "fp16")) and row["offload_share"] == 1.0
    assert data["settings"]["fp16"]["keep_io_types"] and "fp16_peak_gflops" not in data["machine"]
    assert "jitbyoc ms [fp16]" in stdout and "jitbyoc runs fp16" in stdout
