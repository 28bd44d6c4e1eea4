"""The only module that touches TVM's runtime: compiled regions -> a TVM ``llvm`` module.

jitbyoc compiles each region to machine code with llvmlite's target machine (host CPU,
FP-op fusion off, NaNs honoured). TVM's own LLVM JIT runs with FP-op fusion set to
"fast" and NaNs assumed away, which would turn ``a*b + c`` into an FMA and break the
bit-for-bit agreement with TVM and with the C rendering. So the module handed to TVM
carries our assembly as module-level ``asm`` plus, per *use* of a region's code, a
one-call IR trampoline ``__tvm_ffi_<symbol>`` that TVM's JIT can find and that hands the
code that use's names table (the user's names, as data: see
:mod:`jitbyoc.toolchain.llvm_entry`); TVM assembles it in process (no C compiler), scopes
it to the build that imports it, and ``export_library`` writes it out as object code like
any TVM LLVM module.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass

import tvm
import tvm_ffi

from ..render import isa
from ..render.abi import ir_bytes, names_table
from . import cpu_check, jit, thread_defaults
from .c_entry import emit_c_unit
from .llvm_entry import entry_symbol

# assembler directives that must not repeat in (or do not belong to) the shared object
_DROP = re.compile(r'^[ \t]*(?:\.file|\.ident|\.addrsig|\.globl|\.section\t"\.note\.GNU-stack")[^\n]*(?:\n|$)',
                   re.MULTILINE)
_LOCAL = re.compile(r"\.L([\w.$]+)")


@dataclass(frozen=True)
class Code:
    """Compiled code: its assembly, and the library engines it calls (known from its
    rendered module, and cached with the assembly: :mod:`jitbyoc.toolchain.driver`)."""
    asm: str
    calls: frozenset[str] = frozenset()


def tvm_target_flag() -> str:
    """The ``tvm_target`` module flag TVM's JIT reads to pick triple, CPU and features."""
    m = isa.current()
    return json.dumps({"kind": "llvm", "mtriple": m.triple, "mcpu": m.cpu,
                       "mattr": [f for f in m.features.split(",") if f]})


def _escape(text: str) -> str:
    return text.replace("\\", "\\5C").replace('"', "\\22")


def _module_asm(symbol: str, asm: str) -> list[str]:
    """Assembly with its symbols made local and its local labels prefixed so several
    regions can share one object file."""
    text = _DROP.sub("", asm)
    text = _escape(_LOCAL.sub(lambda m: f".L{symbol}_{m.group(1)}", text))
    return [f'module asm "{line}"' for line in text.splitlines()]


def _trampoline(symbol: str, code: str, texts: list[str], checked: bool) -> str:
    """``__tvm_ffi_<symbol>``: calls the code's entry (declared once per module by
    :func:`module_text`) with this use's names table (after the CPU check,
    :mod:`.cpu_check`, when the module has one)."""
    offsets, blob = names_table(texts)
    words = ", ".join(f"i64 {o}" for o in offsets)
    ty = f"{{ [{len(offsets)} x i64], [{len(blob)} x i8] }}"
    entry = entry_symbol(code)
    call = f'  %r = tail call i32 @{entry}(ptr %self, ptr %args, i32 %n, ptr %ret, ptr @"{symbol}.names")'
    body = cpu_check.guard(call) if checked else [call, "  ret i32 %r"]
    return "\n".join([f'@"{symbol}.names" = private unnamed_addr constant {ty} '
                      f'{{ [{len(offsets)} x i64] [{words}], [{len(blob)} x i8] c"{ir_bytes(blob)}" }}, align 8',
                      f"define i32 @__tvm_ffi_{symbol}(ptr %self, ptr %args, i32 %n, ptr %ret) {{",
                      "entry:", *body, "}"])


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


def module_text(codes: dict[str, Code], engines: dict[str, Code], uses: dict[str, tuple]) -> str:
    """The module TVM loads: the assembly of each region's code (by code symbol) and of
    each library engine, and a trampoline per use (symbol -> (code symbol, names table))."""
    _check_labels({s: c.asm for s, c in {**codes, **engines}.items()})
    for symbol, code in {**codes, **engines}.items():
        missing = code.calls - engines.keys()
        if missing:  # TVM's JIT would resolve the call to address 0
            raise RuntimeError(f"jitbyoc: '{symbol}' calls library engines {sorted(missing)} "
                               f"that are not in the module")
    parts = [f'target triple = "{isa.current().triple}"', f'target datalayout = "{jit.data_layout()}"']
    for symbol, code in {**engines, **codes}.items():
        parts += _module_asm(symbol, code.asm)
    check = cpu_check.module_ir(isa.current())
    if check:
        parts.append(check)
    threads = thread_defaults.module_ir(isa.current())
    if threads:
        parts.append(threads)
    for code in dict.fromkeys(code for code, _ in uses.values()):  # once: uses may share code
        parts.append(f"declare i32 @{entry_symbol(code)}(ptr, ptr, i32, ptr, ptr)")
    for symbol, (code, texts) in uses.items():
        parts.append(_trampoline(symbol, code, texts, bool(check)))
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


def c_source_module(regions) -> tvm.runtime.Module:
    """The regions as a TVM C source module (a ``target="c"`` build): ``export_library``
    compiles it with the rest of the model, with the user's C compiler."""
    create = tvm.get_global_func("runtime.CSourceModuleCreate")
    return create(emit_c_unit(regions), "c", [r.symbol for r in regions], [])


def tvm_module(codes: dict[str, Code], engines: dict[str, Code], uses: dict[str, tuple]) -> tvm.runtime.Module:
    """One TVM runtime module exposing a packed function per use (see :func:`module_text`)."""
    return load_llvm_module(module_text(codes, engines, uses))
