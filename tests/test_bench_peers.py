"""The bench's peers (``bench/peers.py``, ``bench/peer_openvino.py``): each runs with its
own defaults, the thread count aside; OpenVINO's crashes cost OpenVINO only; and one zoo row
at ``--precision bf16`` of a tiny classifier, with its peers, accuracy and table."""

from __future__ import annotations

import sys

import numpy as np
import pytest

SPIN_KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")
PLAIN_OPTIONS = ("enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse",
                 "execution_mode", "graph_optimization_level", "inter_op_num_threads",
                 "use_deterministic_compute", "use_per_session_threads")


def test_onnxruntime_runs_at_its_defaults_but_the_thread_count():
    ort = pytest.importorskip("onnxruntime")
    from bench.peers import session_options

    opts, default = session_options(3), ort.SessionOptions()
    assert opts.intra_op_num_threads == 3 and session_options(None).intra_op_num_threads == 0
    for name in PLAIN_OPTIONS:
        assert getattr(opts, name) == getattr(default, name), name
    for key in SPIN_KEYS:  # no config entry set: onnxruntime's own spin policy
        with pytest.raises(Exception, match="does not have configuration"):
            opts.get_session_config_entry(key)


# ---- OpenVINO: the same ONNX file, at its default precision and at f32 ---------------------


def _classifier(tmp_path):
    """A tiny ONNX classifier (4 x 64 -> 10 classes, a constant weight) as a bench Entry."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from tvm.relax.frontend.onnx import from_onnx

    from bench.case import Case
    from bench.models import Entry

    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 10)).astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(10).astype("float32"), "b")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((4, 64)).astype("float32")

    def make():
        return Case(from_onnx(model, keep_params_in_input=False), [x],
                    onnx_model=model.SerializeToString())

    return Entry("tiny_classifier", make, "a linear classifier", 1, suite="zoo")


def _cpu_has_bf16() -> bool:
    from bench.run import _bf16_flags

    return bool(_bf16_flags())


@pytest.fixture(scope="module")
def bf16_row(tmp_path_factory):
    """One zoo row at --precision bf16 with its peers (onnxruntime, both OpenVINOs)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from bench.zoo_run import measure

    workdir = tmp_path_factory.mktemp("zoo")
    return measure(_classifier(workdir), rounds=1, workdir=str(workdir), threads=1,
                   with_peers=True, peak=100.0, precision="bf16")


def test_bf16_row_lowers_jitbyoc_and_measures_its_accuracy(bf16_row):
    row = bf16_row
    assert isinstance(row, dict), row
    assert row["precision"] == row["jitbyoc_precision"] == row["tvm_precision"] == "bf16"
    assert row["lowered_gflop"] == pytest.approx(row["gflop"]) and row["gflop"] > 0
    assert row["reference"] == "tvm" and row["ok"]  # TVM's build of the same bf16 module
    assert 0 < row["jitbyoc_cos_err"] < 1e-4  # bf16 operands moved the outputs, a little
    assert row["jitbyoc_top1"] in (0.0, 0.25, 0.5, 0.75, 1.0) and row["jitbyoc_top1"] >= 0.75
    assert row["onnxruntime_cos_err"] < 1e-10 and row["onnxruntime_precision"] == "fp32"
    assert row["torch_median_s"] is None  # torch eager has no bf16 mode here
    assert row["jitbyoc_fp32_precision"] == "fp32" and row["jitbyoc_fp32_median_s"] > 0  # timed in turns
    assert row["ratio_jitbyoc_fp32"] == pytest.approx(row["jitbyoc_median_s"] / row["jitbyoc_fp32_median_s"])


def test_openvino_runs_the_onnx_file_and_says_its_precision(bf16_row):
    row = bf16_row
    expected = "bf16" if _cpu_has_bf16() else "fp32"
    assert row["openvino_precision"] == expected and row["openvino_f32_precision"] == "fp32"
    assert row["openvino_median_s"] > 0 and row["openvino_f32_median_s"] > 0
    assert row["openvino_f32_cos_err"] < 1e-10
    assert row["openvino_cos_err"] < 1e-4 and (expected == "fp32") == (row["openvino_cos_err"] < 1e-10)
    # the fastest peer runs at jitbyoc's precision: OpenVINO's default (if that is bf16) or
    # TVM's build of the same bf16 module, never onnxruntime or OpenVINO at f32
    alike = [p for p in ("openvino", "tvm") if row[f"{p}_precision"] == "bf16"]
    fastest = min(alike, key=lambda p: row[f"{p}_median_s"])
    assert row["fastest_peer"] == fastest
    assert row["ratio_fastest"] == pytest.approx(row["jitbyoc_median_s"] / row[f"{fastest}_median_s"])


def test_bf16_table_says_each_columns_precision(bf16_row):
    from bench.zoo_report import format_table
    from bench.zoo_run import summarize

    machine = {"cpu_model": "a CPU", "cpu": "znver4", "cpu_bf16": ["avx512_bf16"], "cores": 2,
               "threads": 1, "python": "3", "peak_gflops": 100.0}
    text = format_table([bf16_row], [], machine, summarize([bf16_row]))
    head = text.splitlines()[1]
    for column in ("jitbyoc ms [bf16]", "ort ms [fp32]", "ov f32 ms [fp32]", "tvm ms [bf16]",
                   "bf16 GFLOP", "1-cos jit", "top1 jit", "jit/ov"):
        assert column in head, column
    assert f"ov ms [{bf16_row['openvino_precision']}]" in head and "torch ms" not in head
    assert "(llvm cpu znver4, avx512_bf16)" in text.splitlines()[0]


def test_an_openvino_crash_is_a_note_and_the_other_peers_go_on(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from bench import peer_openvino, peers

    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(peer_openvino, "probe_command", lambda *args: crash)
    case = _classifier(tmp_path).make()
    got, notes = peers.make_peers(case, str(tmp_path), "tiny", 1, peers.ALL_NAMES)
    assert [p.name for p in got] == ["onnxruntime"]
    assert "openvino: crashed: SIGSEGV in the probe" in "; ".join(notes)
    assert "openvino_f32: crashed: SIGSEGV in the probe" in "; ".join(notes)


def test_the_probe_reports_openvinos_own_error(tmp_path):
    pytest.importorskip("openvino")
    from bench.peer_openvino import probe_command, probe_outcome

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    np.savez(tmp_path / "in.npz", np.zeros((1, 4), "float32"))
    why = probe_outcome(probe_command(str(bad), str(tmp_path / "in.npz"), "openvino", 1))
    assert why and why.startswith("failed: RuntimeError: Unable to read the model"), why


def test_bf16_needs_the_zoo_suite():
    from bench.__main__ import main

    assert main(["--precision", "bf16", "--model", "mlp", "--keep-cache"]) == 2


def _ratio_rows(n: int) -> list[dict]:
    return [{"model": f"onnx_model_{i}", "ratio_fastest": 1.02 + 0.05 * i, "fastest_peer": "onnxruntime",
             "ratio_openvino_f32": 1.1 - 0.1 * i} for i in range(n)]


@pytest.mark.parametrize("n", [1, 4, 15])
def test_the_zoo_plot_fits_its_title_labels_its_ticks_and_has_openvino_bars(n):
    """With a few models the title (the machine line) ran off both edges and the log axis
    labelled only 1; the plot now wraps the title to the figure's width, labels at least
    three ticks, and draws a bar against OpenVINO beside each against the fastest peer."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.zoo_report import ratio_figure

    title = ("zoo: jitbyoc vs peers, AMD EPYC (znver4), 2 threads, load [0.5, 0.6, 0.7], torch "
             "2.13.0+cpu, tvm 0.27.0.post1, onnxruntime 1.32.0, openvino 2026.4.1, peak 234 GFLOP/s")
    fig = ratio_figure(_ratio_rows(n), title)
    fig.canvas.draw()
    ax = fig.axes[0]
    box, edge = ax.title.get_window_extent(), fig.bbox
    assert edge.x0 <= box.x0 and box.x1 <= edge.x1, (box, edge)
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and "1" in labels, labels
    assert len(ax.containers) == 2 and all(len(c) == n for c in ax.containers)
    plt.close(fig)
