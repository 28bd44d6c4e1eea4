"""What a zoo entry makes: a :class:`Case` to build, or a :class:`Skip` saying why not.
(A leaf: the zoo and the frontends both make them.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm


@dataclass
class Case:
    """A model ready to build: the Relax module, its inputs, and what its peers run."""

    mod: tvm.IRModule
    inputs: list[np.ndarray]
    torch_module: Any = None  # torch.nn.Module taking the same inputs, or None
    onnx_model: bytes | None = None  # the ONNX file itself, when the model came from ONNX


@dataclass
class Skip:
    """Why a model cannot run here (shown in the table's notes)."""

    reason: str
