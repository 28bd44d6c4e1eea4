"""The packed-function entry in C: walks :func:`jitbyoc.lowering.abi.plan`."""

from __future__ import annotations

import json

from .. import kir
from . import abi
from .c import product


def emit_entry(kernel: kir.Kernel, arg_names: list[str]) -> list[str]:
    lines = [f"int32_t __tvm_ffi_{kernel.name}(void* self, const TVMFFIAny* args, int32_t num_args, "
             f"TVMFFIAny* ret) {{",
             "  char msg[1024];",
             "  (void)self; (void)ret;"]

    def fail_if(cond, message, *values):
        fmt = json.dumps(message)
        lines.append(f"  if ({cond}) {{ snprintf(msg, sizeof msg, {', '.join([fmt, *values])}); "
                     f"TVMFFIErrorSetRaisedFromCStr(\"ValueError\", msg); return -1; }}")

    for chk in abi.plan(kernel, arg_names):
        if isinstance(chk, abi.ArgCount):
            fail_if(f"num_args != {chk.expected}", chk.message, "num_args")
        elif isinstance(chk, abi.Unpack):
            i = chk.index
            lines.append(f"  const int32_t ti{i} = args[{i}].type_index;")
            fail_if(f"ti{i} != {abi.TYPE_TENSOR} && ti{i} != {abi.TYPE_DLTENSOR_PTR}", chk.message, f"ti{i}")
            lines.append(f"  const char* dl{i} = (const char*)args[{i}].v.v_ptr + "
                         f"(ti{i} == {abi.TYPE_TENSOR} ? {abi.TENSOR_DLTENSOR_OFFSET} : 0);")
        elif isinstance(chk, abi.FieldEq):
            got = f"jb_i32_at(dl{chk.index}, {chk.offset})"
            shown = [got if mask < 0 else f"(int)(((uint32_t){got} >> {shift}) & {mask})"
                     for shift, mask in chk.parts]
            fail_if(f"{got} != {chk.expected}", chk.message, *shown)
        elif isinstance(chk, abi.DimEq):
            got = f"((const int64_t*)jb_ptr_at(dl{chk.index}, {abi.DL_SHAPE}))[{chk.axis}]"
            if chk.binds:
                lines.append(f"  const int64_t {chk.expected} = {got};")
            elif isinstance(chk.expected, str):
                fail_if(f"{got} != {chk.expected}", chk.message, f"(long long){got}",
                        f"(long long){chk.expected}")
            else:
                fail_if(f"{got} != {chk.expected}", chk.message, f"(long long){got}")
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
        fail_if(cond, chk.message, str(axis), f"(long long)st{i}[{axis}]", f"(long long)({want})")
