"""Kernel IR -> C source with the same semantics as the LLVM rendering.

The file needs no TVM header and compiles with ``cc -O2 -c``; compile with
``-ffp-contract=off`` for results bit-identical to the JIT (GCC otherwise fuses
``a*b + c`` into an FMA, which rounds once instead of twice). Like the LLVM renderer it
walks each stage once, one named temporary per node, so the two renderings line up.
"""

from __future__ import annotations

import json
import math
from functools import reduce

import numpy as np

from .. import kir
from ..dtypes import dtype as lookup_dtype
from ..ops import op_def
from . import abi

PRELUDE = r"""#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* TVM FFI packed-function ABI, spelled out so no TVM header is needed. */
typedef struct { int32_t type_index; uint32_t pad; union { int64_t v_int64; void* v_ptr; } v; } TVMFFIAny;
extern void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* message);

static inline int32_t jb_bits_f32(float x) { int32_t i; memcpy(&i, &x, 4); return i; }
static inline float jb_bits_i32(int32_t i) { float x; memcpy(&x, &i, 4); return x; }
static inline int64_t jb_bits_f64(double x) { int64_t i; memcpy(&i, &x, 8); return i; }
static inline double jb_bits_i64(int64_t i) { double x; memcpy(&x, &i, 8); return x; }
static inline int32_t jb_i32_at(const void* p, int64_t off) { int32_t v; memcpy(&v, (const char*)p + off, 4); return v; }
static inline int64_t jb_i64_at(const void* p, int64_t off) { int64_t v; memcpy(&v, (const char*)p + off, 8); return v; }
static inline void* jb_ptr_at(const void* p, int64_t off) { void* v; memcpy(&v, (const char*)p + off, sizeof v); return v; }
"""


def c_literal(value, dt: str) -> str:
    d = lookup_dtype(dt)
    if d.is_bool:
        return "1" if value else "0"
    if d.is_int:
        v = int(value)
        return f"((int32_t){v})" if d.bits == 32 else (f"INT64_C({v})" if v > -2**63 else "INT64_MIN")
    v = float(np.float32(value)) if d.bits == 32 else float(value)
    if math.isnan(v):
        text = "NAN"
    elif math.isinf(v):
        text = "INFINITY" if v > 0 else "-INFINITY"
    else:
        text = v.hex() + ("f" if d.bits == 32 else "")
    return f"(({d.c}){text})"


class Emitter:
    """Emits table ops as C statements, one temporary per value."""

    def __init__(self, lines: list[str], indent: str):
        self.lines, self.indent, self.n = lines, indent, 0

    def temp(self, dt: str, expr: str) -> str:
        name = f"t{self.n}"
        self.n += 1
        self.lines.append(f"{self.indent}const {lookup_dtype(dt).c} {name} = {expr};")
        return name

    def const(self, value, dt: str) -> str:
        return c_literal(value, dt)

    def op(self, name: str, dt: str, *args, **attrs) -> str:
        row = op_def(name, dt)
        if row.expand is not None:
            return row.expand(self, dt, *args, **attrs)
        d = lookup_dtype(dt)
        expr = row.c.format(*args, **attrs) if isinstance(row.c, str) else row.c(d, *args, **attrs)
        return self.temp(row.result_dtype(dt, attrs), expr)


def product(dims) -> str:
    static = reduce(lambda x, y: x * y, (d for d in dims if isinstance(d, int)), 1)
    return " * ".join([f"INT64_C({static})"] + [d for d in dims if isinstance(d, str)])


def emit_elementwise(lines: list[str], stage: kir.Elementwise, depth: int):
    roots = [node for _, node in stage.stores]
    bufs = kir.loads(roots) + [buf for buf, _ in stage.stores]
    layout = kir.nest_layout(stage.shape, bufs)
    pad = "  " * depth
    idx = [f"i{len(layout.extents) - 1 - k}" for k in range(len(layout.extents))]
    for k, ext in enumerate(layout.extents):
        lines.append(f"{pad}{'  ' * k}for (int64_t {idx[k]} = 0; {idx[k]} < {product(ext)}; ++{idx[k]}) {{")
    inner = pad + "  " * len(layout.extents)

    def address(buf):
        terms = [f"{i} * ({product(s)})" for i, s in zip(idx, layout.strides[buf]) if s is not None]
        return f"{buf.name}[{' + '.join(terms) or '0'}]"

    em = Emitter(lines, inner)
    values = {}
    for node in kir.walk(roots):
        if isinstance(node, kir.Load):
            raw = address(node.buf)
            values[id(node)] = em.temp(node.dtype, f"({raw} != 0)" if node.dtype == "bool" else raw)
        elif isinstance(node, kir.Const):
            values[id(node)] = em.const(node.value, node.dtype)
        else:
            values[id(node)] = em.op(node.op, node.in_dtype, *(values[id(a)] for a in node.args),
                                     **node.kwargs)
    for buf, node in stage.stores:
        lines.append(f"{inner}{address(buf)} = {values[id(node)]};")
    for k in reversed(range(len(layout.extents))):
        lines.append(f"{pad}{'  ' * k}}}")


STAGE_EMITTERS = {kir.Elementwise: emit_elementwise}


def _storage_c(dt: str) -> str:
    return "uint8_t" if dt == "bool" else lookup_dtype(dt).c


def emit_compute(kernel: kir.Kernel) -> list[str]:
    params = [f"const {_storage_c(b.dtype)}* restrict {b.name}" for b in kernel.inputs]
    params += [f"{_storage_c(b.dtype)}* restrict {b.name}" for b in kernel.outputs]
    params += [f"int64_t {s}" for s in kernel.sym_vars]
    lines = [f"static void {kernel.name}_compute({', '.join(params) or 'void'}) {{"]
    for stage in kernel.stages:
        STAGE_EMITTERS[type(stage)](lines, stage, 1)
    lines.append("}")
    return lines


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
    lines.append(f"  {kernel.name}_compute({', '.join(ptrs + kernel.sym_vars)});")
    lines += ["  return 0;", "}"]
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


def emit_c(kernel: kir.Kernel, arg_names: list[str]) -> str:
    """The kernel as one C translation unit: ``<name>_compute`` plus ``__tvm_ffi_<name>``."""
    return "\n".join([PRELUDE, *emit_compute(kernel), "", *emit_entry(kernel, arg_names), ""])
