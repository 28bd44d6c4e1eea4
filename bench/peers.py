"""Peers: the same model run by torch (eager), onnxruntime and OpenVINO, when installed.

A peer is a zero-argument callable plus the outputs of its first call (that first call is
its warm-up and the reference for its error against TVM), and the precision it runs in.
Anything a peer cannot do is returned as a note string, never raised: peers are optional.
onnxruntime and OpenVINO (:mod:`bench.peer_openvino`) read the same ONNX file, written
once per model (:class:`ModelFiles`); ``onnxruntime_int8`` and ``openvino_int8`` read its
int8 QDQ copy (:mod:`bench.qdq`), ``onnxruntime_fp16`` and ``openvino_fp16`` its float16
copy (:mod:`bench.fp16`). Every peer runs with its own defaults, the thread count aside.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import fp16, qdq
from .peer_openvino import CANDIDATES as OPENVINO, openvino_candidate

log = logging.getLogger(__name__)
NAMES = ("torch", "onnxruntime")  # the default suite's peers
ALL_NAMES = NAMES + tuple(OPENVINO)  # "openvino" (its default precision), "openvino_f32"
# the peers that run the model's int8 QDQ copy (:mod:`bench.qdq`) instead; precision "int8"
INT8_NAMES = ("onnxruntime_int8", "openvino_int8")
# the peers that run its float16 copy (:mod:`bench.fp16`): onnxruntime's precision "fp16",
# OpenVINO's what it reads back (it runs the file in its inference precision)
FP16_NAMES = ("onnxruntime_fp16", "openvino_fp16")
# the ModelFiles attribute of each precision's file
FILES = {"fp32": "onnx", "int8": "qdq", "fp16": "fp16"}


@dataclass
class Peer:
    name: str
    run: Callable[[], Any]
    outputs: list[np.ndarray]
    precision: str = "fp32"  # what its products run in ("bf16": OpenVINO's default on some CPUs)


def version(package: str) -> str | None:
    """The installed version of ``package``, or None if it cannot be imported."""
    try:
        return getattr(importlib.import_module(package), "__version__", "?")
    except ImportError:
        return None


def as_numpy(out) -> list[np.ndarray]:
    """Flatten a TVM tensor/tuple, torch tensor/tuple or onnxruntime list into numpy arrays."""
    if isinstance(out, np.ndarray):
        return [out]
    if hasattr(out, "numpy"):
        return [np.asarray(out.detach().numpy() if hasattr(out, "detach") else out.numpy())]
    if isinstance(out, (list, tuple)) or hasattr(out, "__len__"):
        return [a for item in out for a in as_numpy(item)]
    raise TypeError(f"cannot turn {type(out).__name__} into numpy arrays")


def set_torch_threads(threads: int | None) -> None:
    if threads and version("torch"):
        import torch

        torch.set_num_threads(threads)


def torch_peer(case) -> Peer | str:
    """Run ``case.torch_module`` eagerly under ``torch.inference_mode``."""
    if version("torch") is None:
        return "torch not installed"
    if case.torch_module is None:
        return "no torch form of this model"
    import torch

    tensors = [torch.from_numpy(np.array(a)) for a in case.inputs]

    def run():
        with torch.inference_mode():
            return case.torch_module(*tensors)

    return Peer("torch", run, as_numpy(run()))


def onnx_file(case, path: str) -> str | None:
    """Write the model's ONNX file to ``path``: its own, or exported from its torch form.

    Returns None on success, else why there is no file.
    """
    if case.onnx_model is not None:
        with open(path, "wb") as f:
            f.write(case.onnx_model)
        return None
    if case.torch_module is None or version("torch") is None:
        return "no ONNX or torch form of this model"
    import torch

    args = tuple(torch.from_numpy(np.array(a)) for a in case.inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(case.torch_module, args, path, dynamo=False, opset_version=17,
                          input_names=[f"in{i}" for i in range(len(args))])
    return None


def session_options(threads: int | None):
    """onnxruntime's options for a timed session: ``threads`` intra-op threads (0: its
    default) and quiet logs; everything else is onnxruntime's default (its idle workers
    spin for a while after a call: the block timer's settle pause lets them stop before
    the next candidate's block)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or 0
    opts.log_severity_level = 3
    return opts


class ModelFiles:
    """The files of one model that peers read, written on first use: the ONNX file
    (:func:`onnx_file`), its int8 QDQ copy (:func:`bench.qdq.qdq_copy`, cached in
    ``qdq_dir``, default :data:`bench.qdq.CACHE_DIR`), its float16 copy
    (:func:`bench.fp16.fp16_copy`, in ``fp16_dir``, default :data:`bench.fp16.CACHE_DIR`)
    and its inputs as ``.npz`` (for OpenVINO's probe)."""

    def __init__(self, case, workdir: str, name: str, qdq_dir=None, fp16_dir=None):
        self.case, self.name, self.qdq_dir, self.fp16_dir = case, name, qdq_dir, fp16_dir
        self.onnx_path, self.inputs_path = model_paths(workdir, name)

    @functools.cached_property
    def onnx(self) -> tuple[str | None, str | None]:
        """``(path, None)`` once the ONNX file is written, else ``(None, why not)``."""
        try:
            why = onnx_file(self.case, self.onnx_path)
        except Exception as err:  # an exporter failure costs the ONNX peers only
            log.debug("ONNX export to %s failed", self.onnx_path, exc_info=True)
            return None, f"ONNX export failed: {type(err).__name__}: {str(err)[:120]}"
        return (None, why) if why else (self.onnx_path, None)

    @functools.cached_property
    def qdq(self) -> tuple[str | None, str | None]:
        """``(path, None)`` of the int8 QDQ copy of :attr:`onnx`, else ``(None, why not)``."""
        return self._copy(lambda path: qdq.qdq_copy(path, self.case.inputs, self.name, self.qdq_dir))

    @functools.cached_property
    def fp16(self) -> tuple[str | None, str | None]:
        """``(path, None)`` of the float16 copy of :attr:`onnx`, else ``(None, why not)``."""
        return self._copy(lambda path: fp16.fp16_copy(path, self.name, self.fp16_dir))

    def _copy(self, make) -> tuple[str | None, str | None]:
        path, why = self.onnx
        return (None, why) if why else make(path)

    def path(self, precision: str = "fp32") -> tuple[str | None, str | None]:
        """The file of ``precision`` (a key of :data:`FILES`): :attr:`onnx`, :attr:`qdq`, ..."""
        return getattr(self, FILES[precision])

    @functools.cached_property
    def inputs(self) -> str:
        np.savez(self.inputs_path, *self.case.inputs)
        return self.inputs_path


def model_paths(workdir: str, name: str) -> tuple[str, str]:
    """Where :class:`ModelFiles` writes model ``name``'s ONNX file and inputs (to remove them)."""
    return os.path.join(workdir, f"{name}.onnx"), os.path.join(workdir, f"{name}.inputs.npz")


def peer_name(name: str, precision: str) -> str:
    """The name of peer ``name`` on the file of ``precision``: ``onnxruntime_int8``, ..."""
    return name if precision == "fp32" else f"{name}_{precision}"


def onnxruntime_peer(files: ModelFiles, threads: int | None, precision: str = "fp32") -> Peer | str:
    """Run the model's file of ``precision`` (its ONNX file, QDQ or float16 copy) with
    onnxruntime's CPU provider."""
    if version("onnxruntime") is None:
        return "onnxruntime not installed"
    import onnxruntime as ort

    path, why = files.path(precision)
    if why:
        return why
    case = files.case
    sess = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(case.inputs):
        return f"ONNX file has {len(names)} inputs, the model {len(case.inputs)}"
    feed = dict(zip(names, case.inputs))

    def run():
        return sess.run(None, feed)

    return Peer(peer_name("onnxruntime", precision), run, as_numpy(run()), precision)


def openvino_peer(files: ModelFiles, candidate: str, threads: int | None,
                  precision: str = "fp32") -> Peer | str:
    """OpenVINO's ``candidate`` (a key of :data:`OPENVINO`) on the model's file of
    ``precision``: its ONNX file, its QDQ copy, which OpenVINO runs in int8
    (``openvino_int8``), or its float16 copy (``openvino_fp16``), which it runs in its
    inference precision (read back: bf16 on a CPU with AVX512_BF16, else f32)."""
    if version("openvino") is None:
        return "openvino not installed"
    path, why = files.path(precision)
    if why:
        return why
    got = openvino_candidate(path, files.case.inputs, files.inputs, candidate, threads)
    if isinstance(got, str):
        return got
    run, outputs, ran_in = got
    # int8: its products run in int8; the precision read back is its float ops'
    return Peer(peer_name(candidate, precision), run, outputs, "int8" if precision == "int8" else ran_in)


def make_peers(case, workdir: str, name: str, threads: int | None,
               names: tuple[str, ...] = NAMES,
               files: ModelFiles | None = None) -> tuple[list[Peer], list[str]]:
    """Every peer of ``names`` (see :data:`ALL_NAMES`, :data:`INT8_NAMES`,
    :data:`FP16_NAMES`) that can run ``case``, in that order, and a note for each that
    cannot. ``files``: the model's files, if already made."""
    peers, notes = [], []
    files = files or ModelFiles(case, workdir, name)
    makers = {"torch": lambda: torch_peer(case),
              **{c: functools.partial(openvino_peer, files, c, threads) for c in OPENVINO}}
    for p in FILES:  # onnxruntime on each file, OpenVINO's default on the copies
        makers[peer_name("onnxruntime", p)] = functools.partial(onnxruntime_peer, files, threads, p)
        if p != "fp32":
            makers[peer_name("openvino", p)] = functools.partial(openvino_peer, files, "openvino",
                                                                  threads, p)
    for peer in names:
        try:
            got = makers[peer]()
        except Exception as err:
            log.debug("%s failed on %s", peer, name, exc_info=True)
            got = f"failed: {type(err).__name__}: {str(err)[:120]}"
        if isinstance(got, Peer):
            peers.append(got)
        else:
            notes.append(f"{peer}: {got}")
    return peers, notes
