"""The only module that touches TVM's runtime: compiled regions -> a TVM ``llvm`` module.

jitbyoc compiles each region to machine code with llvmlite's target machine (host CPU,
FP-op fusion off, NaNs honoured). TVM's own LLVM JIT runs with FP-op fusion set to
"fast" and NaNs assumed away, which would turn ``a*b + c`` into an FMA and break the
bit-for-bit agreement with TVM and with the C rendering. So the module handed to TVM
carries our assembly as module-level ``asm`` plus, per region, a one-jump IR trampoline
``__tvm_ffi_<symbol>`` that TVM's JIT can find; TVM assembles it in process (no C
compiler), scopes it to the build that imports it, and ``export_library`` writes it out
as object code like any TVM LLVM module.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import tvm
import tvm_ffi

from . import jit, library

# assembler directives that must not repeat in (or do not belong to) the shared object
_DROP = re.compile(r'^[ \t]*(?:\.file|\.ident|\.addrsig|\.globl|\.section\t"\.note\.GNU-stack")[^\n]*(?:\n|$)',
                   re.MULTILINE)
_LOCAL = re.compile(r"\.L([\w.$]+)")


def tvm_target_flag() -> str:
    """The ``tvm_target`` module flag TVM's JIT reads to pick triple, CPU and features."""
    h = jit.host()
    return json.dumps({"kind": "llvm", "mtriple": h["triple"], "mcpu": h["cpu"],
                       "mattr": [f for f in h["features"].split(",") if f]})


def _escape(text: str) -> str:
    return text.replace("\\", "\\5C").replace('"', "\\22")


def impl_symbol(symbol: str) -> str:
    return f"jitbyoc_impl_{symbol}"


def _module_asm(symbol: str, asm: str) -> list[str]:
    """The region's assembly with its entry renamed, made local, and its local labels
    prefixed so several regions can share one object file."""
    text = _DROP.sub("", asm).replace(f"__tvm_ffi_{symbol}", impl_symbol(symbol))
    text = _escape(_LOCAL.sub(lambda m: f".L{symbol}_{m.group(1)}", text))
    return [f'module asm "{line}"' for line in text.splitlines()]


def _trampoline(symbol: str) -> str:
    impl = impl_symbol(symbol)
    return (f"declare i32 @{impl}(ptr, ptr, i32, ptr)\n"
            f"define i32 @__tvm_ffi_{symbol}(ptr %self, ptr %args, i32 %n, ptr %ret) {{\n"
            f"  %r = musttail call i32 @{impl}(ptr %self, ptr %args, i32 %n, ptr %ret)\n"
            f"  ret i32 %r\n}}")


_LABEL = re.compile(r"^([A-Za-z_$][\w.$]*):", re.MULTILINE)


def _check_labels(asm_by_symbol: dict[str, str]) -> None:
    """Regions share one object file, so their (non-``.L``) labels must differ. TVM's
    assembler ends the whole process on a duplicate; fail here with a Python error."""
    owner: dict[str, str] = {}
    for symbol, asm in asm_by_symbol.items():
        for label in set(_LABEL.findall(asm)):
            if label in owner:
                raise RuntimeError(f"jitbyoc: regions '{owner[label]}' and '{symbol}' both define "
                                   f"the assembly label '{label}'; kernels must name helper "
                                   f"functions after their region")
            owner[label] = symbol


def module_text(asm_by_symbol: dict[str, str], engines: dict[str, str] | None = None) -> str:
    """The module TVM loads: each region's and each library engine's assembly, and a
    trampoline per region."""
    engines = engines or {}
    _check_labels({**asm_by_symbol, **engines})
    for symbol, asm in asm_by_symbol.items():
        missing = library.references(asm) - engines.keys()
        if missing:  # TVM's JIT would resolve the call to address 0
            raise RuntimeError(f"jitbyoc: region '{symbol}' calls library engines {sorted(missing)} "
                               f"that are not in the module")
    h = jit.host()
    parts = [f'target triple = "{h["triple"]}"', f'target datalayout = "{jit.data_layout()}"']
    for symbol, asm in engines.items():
        parts += _module_asm(symbol, asm)
    for symbol, asm in asm_by_symbol.items():
        parts += _module_asm(symbol, asm)
        parts.append(_trampoline(symbol))
    parts += ["!llvm.module.flags = !{!0}",
              f'!0 = !{{i32 2, !"tvm_target", !"{_escape(tvm_target_flag())}"}}']
    return "\n".join(parts) + "\n"


def load_llvm_module(ir_text: str) -> tvm.runtime.Module:
    fd, path = tempfile.mkstemp(suffix=".ll", prefix="jitbyoc_")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ir_text)
        # tvm.runtime.load_module keeps every module alive for the life of the process
        # (about 0.8 MB of JIT state each); ours live exactly as long as their builds.
        return tvm_ffi.load_module(path, keep_module_alive=False)
    finally:
        os.unlink(path)


def tvm_module(asm_by_symbol: dict[str, str], engines: dict[str, str] | None = None) -> tvm.runtime.Module:
    """One TVM runtime module exposing every region's packed function."""
    return load_llvm_module(module_text(asm_by_symbol, engines))
