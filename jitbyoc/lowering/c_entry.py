"""The packed-function entry in C: walks :func:`jitbyoc.lowering.abi.plan`.

The user's names are data: they sit in one array of escaped string literals
(``jb_names``, the names table of :func:`jitbyoc.lowering.abi.strings`) and reach the
messages as ``%s`` arguments; every identifier is jitbyoc's.
"""

from __future__ import annotations

from .. import kir
from . import abi
from .c import PRELUDE, emit_compute, product


def c_string(text: str) -> str:
    """``text`` as a C string literal: printable ASCII as is, everything else (quotes,
    backslashes, ``?`` against trigraphs, control characters, UTF-8 bytes) in octal."""
    safe = {c for c in range(0x20, 0x7F)} - {ord('"'), ord("\\"), ord("?")}
    data = text.encode("utf-8", "backslashreplace")
    return '"' + "".join(chr(c) if c in safe else f"\\{c:03o}" for c in data) + '"'


def emit_c(kernel: kir.Kernel, symbol: str, texts: list[str]) -> str:
    """The kernel as one C translation unit: ``<name>_compute`` plus ``__tvm_ffi_<symbol>``
    reporting errors with the names table ``texts`` (:func:`.abi.strings`)."""
    functions: list[str] = []
    compute = emit_compute(kernel, functions)
    return "\n".join([PRELUDE, *functions, *compute, "", *emit_entry(kernel, symbol, texts), ""])


def emit_entry(kernel: kir.Kernel, symbol: str, texts: list[str]) -> list[str]:
    lines = [f"static const char* const jb_names_{symbol}[] = {{",
             *[f"  {c_string(t)}," for t in texts], "};",
             f"int32_t __tvm_ffi_{symbol}(void* self, const TVMFFIAny* args, int32_t num_args, "
             f"TVMFFIAny* ret) {{",
             "  char msg[1024];",
             f"  const char* const* names = jb_names_{symbol};",
             "  (void)self; (void)ret;"]

    def fail_if(cond, chk, *values):
        texts_ = [f"names[{k}]" for k in chk.strings]
        if isinstance(chk, abi.DimEq) and isinstance(chk.expected, str):  # %s %s got %s bound
            values = (values[0], texts_[2], values[1])
        args = [c_string(chk.message), *texts_[:2 if isinstance(chk, abi.DimEq) else 1], *values]
        lines.append(f"  if ({cond}) {{ snprintf(msg, sizeof msg, {', '.join(args)}); "
                     f"TVMFFIErrorSetRaisedFromCStr(\"ValueError\", msg); return -1; }}")

    for chk in abi.plan(kernel):
        if isinstance(chk, abi.ArgCount):
            fail_if(f"num_args != {chk.expected}", chk, "num_args")
        elif isinstance(chk, abi.Unpack):
            i = chk.index
            lines.append(f"  const int32_t ti{i} = args[{i}].type_index;")
            fail_if(f"ti{i} != {abi.TYPE_TENSOR} && ti{i} != {abi.TYPE_DLTENSOR_PTR}", chk, f"ti{i}")
            lines.append(f"  const char* dl{i} = (const char*)args[{i}].v.v_ptr + "
                         f"(ti{i} == {abi.TYPE_TENSOR} ? {abi.TENSOR_DLTENSOR_OFFSET} : 0);")
        elif isinstance(chk, abi.FieldEq):
            got = f"jb_i32_at(dl{chk.index}, {chk.offset})"
            shown = [got if mask < 0 else f"(int)(((uint32_t){got} >> {shift}) & {mask})"
                     for shift, mask in chk.parts]
            fail_if(f"{got} != {chk.expected}", chk, *shown)
        elif isinstance(chk, abi.DimEq):
            got = f"((const int64_t*)jb_ptr_at(dl{chk.index}, {abi.DL_SHAPE}))[{chk.axis}]"
            if chk.binds:
                lines.append(f"  const int64_t {chk.expected} = {got};")
            elif isinstance(chk.expected, str):
                fail_if(f"{got} != {chk.expected}", chk, f"(long long){got}", f"(long long){chk.expected}")
            else:
                fail_if(f"{got} != {chk.expected}", chk, f"(long long){got}")
        elif isinstance(chk, abi.Contiguous):
            _emit_contiguous(lines, chk, kernel.params[chk.index], fail_if)
    ptrs = [f"(void*)((char*)jb_ptr_at(dl{i}, {abi.DL_DATA}) + jb_i64_at(dl{i}, {abi.DL_BYTE_OFFSET}))"
            for i in range(len(kernel.params))]
    lines.append(f"  return {kernel.name}_compute({', '.join(ptrs + kernel.sym_vars)});")
    lines.append("}")
    return lines


def _emit_contiguous(lines, chk, buf: kir.Buffer, fail_if):
    i = chk.index
    lines.append(f"  const int64_t* st{i} = (const int64_t*)jb_ptr_at(dl{i}, {abi.DL_STRIDES});")
    for axis in range(buf.ndim):
        if buf.shape[axis] == 1:
            continue
        want = product(buf.shape[axis + 1:])
        cond = f"st{i} && st{i}[{axis}] != {want}"
        if isinstance(buf.shape[axis], str):
            cond += f" && {buf.shape[axis]} != 1"
        fail_if(cond, chk, str(axis), f"(long long)st{i}[{axis}]", f"(long long)({want})")
