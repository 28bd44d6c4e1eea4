"""OpenVINO as a peer: the ONNX file onnxruntime reads, compiled by OpenVINO's CPU plugin
with the bench's thread count (``INFERENCE_NUM_THREADS``) and otherwise its defaults.

Two candidates (:data:`CANDIDATES`): ``openvino`` at OpenVINO's default precision (bf16 on
a CPU with AVX512_BF16 or AMX, else f32) and ``openvino_f32`` with
``INFERENCE_PRECISION_HINT=f32``. The precision a compiled model runs in is read back
from it (``INFERENCE_PRECISION_HINT``), not assumed.

A crash inside OpenVINO (a SIGSEGV on DenseNet-121 in int8 was reported) would end
the whole bench, so each candidate is first compiled and run once by a probe in a child
process (``python -m bench.peer_openvino MODEL INPUTS CANDIDATE THREADS``). Only when the
probe exits cleanly is the model compiled in the bench's process; otherwise the probe's
error text, or the signal that ended it, is the candidate's note and the bench goes on.

Nothing here imports :mod:`bench.peers` (it imports this module): a candidate is returned
as ``(run, outputs, precision)``, or a string saying why not.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

CANDIDATES = {"openvino": {}, "openvino_f32": {"INFERENCE_PRECISION_HINT": "f32"}}
PROBE_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parents[1]
# OpenVINO's element type names -> the bench's precision names
PRECISIONS = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}


def config(candidate: str, threads: int | None) -> dict:
    """The compile_model config of ``candidate``: its hint, and the thread count if set."""
    cfg = dict(CANDIDATES[candidate])
    if threads:
        cfg["INFERENCE_NUM_THREADS"] = int(threads)
    return cfg


def compile_model(path: str, candidate: str, threads: int | None):
    """``ov.Core().compile_model`` of the ONNX file at ``path`` for the CPU."""
    import openvino as ov

    return ov.Core().compile_model(path, "CPU", config(candidate, threads))


def precision_of(compiled) -> str:
    """The precision ``compiled`` runs its products in: ``"bf16"``, ``"fp32"``, ..."""
    name = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    return PRECISIONS.get(name, name)


def runner(compiled, inputs: list[np.ndarray]):
    """A zero-argument callable: one synchronous inference on ``inputs``, outputs as a list.
    (``share_inputs``: OpenVINO reads the arrays in place, as onnxruntime does, instead of
    copying them into the request on every call.)"""
    request = compiled.create_infer_request()
    return lambda: list(request.infer(inputs, share_inputs=True).values())


def probe_command(path: str, inputs_path: str, candidate: str, threads: int | None) -> list[str]:
    """The child process that compiles and runs ``candidate`` once (see :func:`main`)."""
    return [sys.executable, "-m", "bench.peer_openvino", path, inputs_path, candidate,
            str(threads or 0)]


def probe_outcome(cmd: list[str]) -> str | None:
    """Run ``cmd`` (from the repository's root): None if it exits cleanly, else what went
    wrong (its last error line, or the signal that ended it)."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"probe timed out after {PROBE_TIMEOUT_S} s (compile and one run)"
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    last = lines[-1][:200] if lines else "no error text"
    if proc.returncode < 0:
        return f"crashed: {signal.Signals(-proc.returncode).name} in the probe ({last})"
    return f"failed: {last}"


def openvino_candidate(path: str, inputs: list[np.ndarray], inputs_path: str, candidate: str,
                       threads: int | None):
    """``(run, outputs, precision)`` of ``candidate`` on the ONNX file at ``path``, or why not.

    ``inputs_path`` is an ``.npz`` of ``inputs`` (written once per model) for the probe.
    """
    why = probe_outcome(probe_command(path, inputs_path, candidate, threads))
    if why:
        return why
    compiled = compile_model(path, candidate, threads)
    if len(compiled.inputs) != len(inputs):
        return f"OpenVINO's model has {len(compiled.inputs)} inputs, the model {len(inputs)}"
    run = runner(compiled, inputs)
    return run, run(), precision_of(compiled)


def main(argv: list[str]) -> int:
    """The probe: compile, run once, print the precision; a crash ends this process only.
    An error's last line on stderr says what it was (OpenVINO's messages open with lines
    of source locations, ``Exception from src/...``)."""
    path, inputs_path, candidate, threads = argv
    with np.load(inputs_path) as saved:
        inputs = [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]
    try:
        compiled = compile_model(path, candidate, int(threads))
        runner(compiled, inputs)()
    except Exception as err:
        lines = [ln.strip() for ln in str(err).splitlines()
                 if ln.strip() and not ln.startswith("Exception from src/")]
        print(f"{type(err).__name__}: {lines[-1] if lines else ''}", file=sys.stderr)
        return 1
    print(precision_of(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
