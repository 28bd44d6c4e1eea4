"""The float16 copies of the zoo's models (``python -m bench --suite zoo --precision fp16``).

One file per model, made from the ONNX file the peers read (:class:`bench.peers.ModelFiles`)
by onnxruntime's ``convert_float_to_float16`` with ``keep_io_types=True``: weights and
activations float16, the graph's inputs and outputs float32 (a Cast after each input and
before each output), so every runtime takes the bench's inputs and the accuracy columns
compare float32 outputs with the fp32 model's. The converter's default block list keeps a
few ops float32 (its casts around them are in the file). The converter appends its input
casts after the nodes that read them; the copy is sorted topologically, since TVM's ONNX
frontend reads the nodes in order. Every runtime reads the same file: jitbyoc and TVM
through TVM's ONNX frontend (jitbyoc computes each op in float32 and rounds its result to
float16, :mod:`jitbyoc.tvm.widen`), onnxruntime and OpenVINO as is.

The copies are cached as the int8 ones are (:func:`bench.qdq.cached_copy`), in
:data:`CACHE_DIR`, beside :data:`bench.qdq.CACHE_DIR`, keyed by the fp32 file, the
:data:`RECIPE` and the onnx and onnxruntime versions.
"""

from __future__ import annotations

from pathlib import Path

from . import qdq

CACHE_DIR = qdq.CACHE_DIR.parent / "fp16"
# what convert_float_to_float16 is called with (and part of every copy's cache key)
RECIPE = {"converter": "onnxruntime.transformers.float16.convert_float_to_float16",
          "keep_io_types": True, "topological_sort": True}


def convert(model):
    """``model`` (a ModelProto) converted to float16 by :data:`RECIPE`, its nodes in
    topological order."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    half = convert_float_to_float16(model, keep_io_types=True)
    OnnxModel.graph_topological_sort(half.graph)  # its input casts come last otherwise
    return half


def make_copy(fp32_path: str, out_path: Path) -> None:
    """Convert the file at ``fp32_path`` into ``out_path``, written whole or not at all."""
    import onnx

    half = convert(onnx.load(fp32_path))
    qdq.write_whole(out_path, lambda partial: onnx.save(half, partial))


def fp16_copy(fp32_path: str, name: str,
              cache_dir: Path | None = None) -> tuple[str | None, str | None]:
    """The float16 copy of the ONNX file at ``fp32_path`` (model ``name``): ``(path,
    None)``, made or found in ``cache_dir`` (default :data:`CACHE_DIR`), else ``(None,
    why not)``."""
    return qdq.cached_copy(fp32_path, name, "fp16", RECIPE,
                           lambda path: make_copy(fp32_path, path),
                           Path(cache_dir or CACHE_DIR), failed="conversion to float16")
