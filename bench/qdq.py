"""The int8 copies of the zoo's models (``python -m bench --suite zoo --precision int8``).

One QDQ file per model, made from the ONNX file the peers read (:class:`bench.peers.ModelFiles`)
by onnxruntime's ``quantize_static``: QDQ format (``QuantizeLinear``/``DequantizeLinear``
pairs around float ops), per-channel int8 weights, uint8 activations, calibrated (MinMax,
onnxruntime's default) on four random batches drawn as the bench draws the model's inputs:
standard normal floats, integers in the range of the bench's own input (BERT's token ids),
from a generator seeded by the model's name. A Softmax that makes the graph's output
stays float (:func:`output_softmax`: quantized, a classifier's probabilities round to 0). A model older than opset 13 is converted to
opset 13 first (``onnx.version_converter``): per-channel QDQ needs it. Every runtime reads
the same file: jitbyoc and TVM through TVM's ONNX frontend, onnxruntime and OpenVINO as is.

The copies are cached in :data:`CACHE_DIR` (under ``bench/results``, which git ignores),
named by the model and a hash of the fp32 file's bytes, the recipe, the calibration
batches and the onnx and onnxruntime versions: a changed source file, recipe or quantizer
makes a new copy, which replaces the model's older ones. A copy is written under a
temporary name and renamed when complete, so an interrupted run leaves nothing to reuse.
:func:`cached_copy` does that for any copy of a model's ONNX file (:mod:`bench.fp16`'s
float16 copies too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
CACHE_DIR = Path(__file__).resolve().parent / "results" / "qdq"
OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (an axis) need opset 13
CALIBRATION_BATCHES = 4
# what quantize_static is called with (and part of every copy's cache key)
RECIPE = {"quant_format": "QDQ", "per_channel": True, "activation_type": "QUInt8",
          "weight_type": "QInt8", "calibrate_method": "MinMax", "calibration_batches":
          CALIBRATION_BATCHES, "min_opset": OPSET, "output_softmax": "float"}


def calibration_batches(inputs: list[np.ndarray], name: str,
                        count: int = CALIBRATION_BATCHES) -> list[list[np.ndarray]]:
    """``count`` random batches shaped like ``inputs``, seeded by ``name``: floats standard
    normal (as the bench draws images), integers uniform between the min and max of the
    bench's own input (BERT's token ids)."""
    rng = np.random.default_rng(zlib.crc32(f"{name}/calibration".encode()))

    def draw(x: np.ndarray) -> np.ndarray:
        if np.issubdtype(x.dtype, np.integer):
            return rng.integers(int(x.min()), int(x.max()) + 1, x.shape).astype(x.dtype)
        return rng.standard_normal(x.shape).astype(x.dtype)

    return [[draw(np.asarray(x)) for x in inputs] for _ in range(count)]


def cache_key(fp32_path: str, recipe: dict, batches: list[list[np.ndarray]] = ()) -> str:
    """The hash a copy made by ``recipe`` (from ``batches``) is cached under (see the
    module docstring)."""
    import onnx
    import onnxruntime

    digest = hashlib.sha256()
    with open(fp32_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    digest.update(json.dumps(recipe, sort_keys=True).encode())
    digest.update(f"onnx {onnx.__version__} onnxruntime {onnxruntime.__version__}".encode())
    for batch in batches:
        for x in batch:
            digest.update(f"{x.dtype}{x.shape}".encode())
            digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()[:20]


def opset_of(model) -> int:
    """The model's default-domain (``ai.onnx``) opset."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def at_least_opset(model, opset: int = OPSET):
    """``model``, converted to ``opset`` by ``onnx.version_converter`` if it is older."""
    from onnx import version_converter

    return model if opset_of(model) >= opset else version_converter.convert_version(model, opset)


def graph_input_names(model) -> list[str]:
    """The model's real inputs (graph inputs that are not initializers), in order."""
    weights = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in weights]


def quantize(model, out_path: str, batches: list[list[np.ndarray]]) -> None:
    """``quantize_static`` of ``model`` (an opset >= 13 ModelProto) to ``out_path``, by
    :data:`RECIPE`, calibrated on ``batches``."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                          QuantType, quantize_static)

    names = graph_input_names(model)
    if any(len(b) != len(names) for b in batches):
        raise ValueError(f"the ONNX file has {len(names)} inputs, the batches {len(batches[0])}")

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.left = iter([dict(zip(names, b)) for b in batches])

        def get_next(self):
            return next(self.left, None)

    logging.disable(logging.WARNING)  # its advice to pre-process, on the root logger
    try:
        quantize_static(model, out_path, Batches(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
                        nodes_to_exclude=output_softmax(model))
    finally:
        logging.disable(logging.NOTSET)


def output_softmax(model) -> list[str]:
    """The names of the Softmax nodes that make a graph output. They stay float:
    onnxruntime's quantizer fixes a softmax output's range to [0, 1] in steps of 1/255,
    so a classifier's probabilities (about 1/1000 each with the zoo's random weights)
    quantize to 0 and its accuracy columns would compare zeros (SqueezeNet: 1-cos 0.35,
    top-1 0 % for every int8 runtime alike). Its time is a thousand elements."""
    outputs = {o.name for o in model.graph.output}
    return [n.name for n in model.graph.node if n.op_type == "Softmax" and set(n.output) & outputs]


def write_whole(out_path: Path, write) -> None:
    """``write(path)`` to a temporary name beside ``out_path``, renamed to it when complete:
    written whole or not at all."""
    fd, partial = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".partial", dir=out_path.parent)
    os.close(fd)
    try:
        write(partial)
        os.replace(partial, out_path)
    finally:
        Path(partial).unlink(missing_ok=True)


def make_copy(fp32_path: str, out_path: Path, batches: list[list[np.ndarray]]) -> None:
    """Quantize the file at ``fp32_path`` into ``out_path``, written whole or not at all."""
    import onnx

    model = at_least_opset(onnx.load(fp32_path))
    write_whole(out_path, lambda partial: quantize(model, partial, batches))


def cached_copy(fp32_path: str, name: str, kind: str, recipe: dict, make, cache_dir: Path,
                batches: list[list[np.ndarray]] = (), *,
                failed: str = "quantization") -> tuple[str | None, str | None]:
    """The ``kind`` copy (``qdq``, ``fp16``) of model ``name``'s ONNX file at ``fp32_path``,
    made by ``make(path)`` by ``recipe`` (from ``batches``), or found in ``cache_dir``:
    ``(path, None)``, else ``(None, "<failed> failed: ...")``. A new copy replaces the
    model's older ones."""
    try:
        path = cache_dir / f"{name}.{cache_key(fp32_path, recipe, batches)}.{kind}.onnx"
        if path.exists():
            log.debug("%s: %s copy from the cache, %s", name, kind, path)
            return str(path), None
        cache_dir.mkdir(parents=True, exist_ok=True)
        log.info("%s: making its %s copy in %s", name, kind, path)
        make(path)
    except Exception as err:  # the model is skipped at this precision, the bench goes on
        log.debug("making the %s copy of %s failed", kind, fp32_path, exc_info=True)
        return None, f"{failed} failed: {type(err).__name__}: {str(err)[:160]}"
    for stale in cache_dir.glob(f"{name}.*.{kind}.onnx"):  # the same model's older copies
        if stale != path:
            stale.unlink(missing_ok=True)
    return str(path), None


def qdq_copy(fp32_path: str, inputs: list[np.ndarray], name: str,
             cache_dir: Path | None = None) -> tuple[str | None, str | None]:
    """The int8 QDQ copy of the ONNX file at ``fp32_path``: ``(path, None)``, made or found
    in ``cache_dir`` (default :data:`CACHE_DIR`), else ``(None, why not)``.

    Parameters
    ----------
    fp32_path : str
        The model's ONNX file (the peers' fp32 file).
    inputs : list of numpy.ndarray
        The bench's inputs of the model: the calibration batches are drawn like them.
    name : str
        The model's name: names the copy and seeds the calibration batches.
    cache_dir : Path, optional
        Where copies are kept.
    """
    batches = calibration_batches(inputs, name)
    return cached_copy(fp32_path, name, "qdq", RECIPE,
                       lambda path: make_copy(fp32_path, path, batches),
                       Path(cache_dir or CACHE_DIR), batches)


def import_onnx(path: str):
    """The ONNX file at ``path`` (a QDQ or float16 copy) as a Relax module, through TVM's
    ONNX frontend (as the zoo imports its ONNX models: weights as constants)."""
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    return from_onnx(onnx.load(path), keep_params_in_input=False)
