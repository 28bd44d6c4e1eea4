"""Hand-written kernels: one file each, each registering its rules.

A kernel file defines a :class:`~jitbyoc.ir.kir.KernelStage` subclass with ``emit_llvm``,
``emit_c`` and a numpy ``reference``, and registers the rule of each Relax op it takes
with :func:`jitbyoc.ir.rules.register`: the pattern arity, a check function returning why
a call cannot be taken (or None), and a builder that turns the Relax call into the stage.
The lowering materializes operands with ``fe.buffer(expr)``; elementwise ops that follow
a kernel are fused into its epilogue afterwards (see :func:`jitbyoc.lower.fuse_epilogues`).

Importing this package imports every kernel file, so the rule registry is complete. A
file that fails to import is logged and skipped: its ops stay with TVM instead of
breaking every build.
"""

from __future__ import annotations

import importlib
import logging
import sys

KERNEL_MODULES = ("matmul", "conv2d", "pool2d", "softmax", "norm", "reduce", "layout", "slicing", "concat",
                  "fold_permutes", "fold_slices", "weight_matmul", "generate", "scan", "gather", "inference",
                  "argreduce", "scatter", "pad",
                  "conv_transpose", "pool3d", "grid_sample", "roi_align", "attention", "resize")
FAILED: dict[str, str] = {}  # kernel module -> why it could not be imported


def load_all() -> None:
    """Import every kernel module once (see the module docstring)."""
    for name in KERNEL_MODULES:
        module = f"{__name__}.{name}"
        if module in sys.modules or name in FAILED:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                FAILED[name] = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - a broken kernel must not break the rest
            FAILED[name] = f"{type(err).__name__}: {err}"
        if name in FAILED:
            logging.getLogger("jitbyoc").error("jitbyoc: kernel module %s failed to import (%s); "
                                               "its ops stay with TVM", name, FAILED[name])


load_all()
