"""The only module that touches TVM's runtime: optimized LLVM IR -> a TVM ``llvm`` module.

TVM parses the IR and JIT-compiles it in process with its own LLVM (same major version
as llvmlite's); the module is imported by the executable that uses it, so its symbols
are scoped to that build, and ``export_library`` writes it out as object code.
"""

from __future__ import annotations

import json
import os
import tempfile

import tvm

from . import jit


def tvm_target_flag() -> str:
    """The ``tvm_target`` module flag TVM's JIT reads to pick triple, CPU and features."""
    h = jit.host()
    return json.dumps({"kind": "llvm", "mtriple": h["triple"], "mcpu": h["cpu"],
                       "mattr": [f for f in h["features"].split(",") if f]})


def load_llvm_module(ir_text: str) -> tvm.runtime.Module:
    fd, path = tempfile.mkstemp(suffix=".ll", prefix="jitbyoc_")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ir_text)
        return tvm.runtime.load_module(path)
    finally:
        os.unlink(path)
