"""Peers: the same model run by torch (eager) and by onnxruntime, when they are installed.

A peer is a zero-argument callable plus the outputs of its first call (that first call is
its warm-up and the reference for its error against TVM). Anything a peer cannot do is
returned as a note string, never raised: peers are optional.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
NAMES = ("torch", "onnxruntime")


@dataclass
class Peer:
    name: str
    run: Callable[[], Any]
    outputs: list[np.ndarray]


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


def onnxruntime_peer(case, workdir: str, name: str, threads: int | None) -> Peer | str:
    """Run the model's ONNX file (see :func:`onnx_file`) with onnxruntime's CPU provider."""
    if version("onnxruntime") is None:
        return "onnxruntime not installed"
    import onnxruntime as ort

    path = os.path.join(workdir, f"{name}.onnx")
    try:
        why = onnx_file(case, path)
    except Exception as err:  # an exporter failure costs this peer only
        log.debug("ONNX export of %s failed", name, exc_info=True)
        return f"ONNX export failed: {type(err).__name__}: {str(err)[:120]}"
    if why:
        return why
    sess = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(case.inputs):
        return f"ONNX file has {len(names)} inputs, the model {len(case.inputs)}"
    feed = dict(zip(names, case.inputs))

    def run():
        return sess.run(None, feed)

    return Peer("onnxruntime", run, as_numpy(run()))


def make_peers(case, workdir: str, name: str, threads: int | None) -> tuple[list[Peer], list[str]]:
    """Every peer that can run ``case``, and a note for each that cannot."""
    peers, notes = [], []
    makers = {"torch": lambda: torch_peer(case),
              "onnxruntime": lambda: onnxruntime_peer(case, workdir, name, threads)}
    for peer, make in makers.items():
        try:
            got = make()
        except Exception as err:
            log.debug("%s failed on %s", peer, name, exc_info=True)
            got = f"failed: {type(err).__name__}: {str(err)[:120]}"
        if isinstance(got, Peer):
            peers.append(got)
        else:
            notes.append(f"{peer}: {got}")
    return peers, notes
