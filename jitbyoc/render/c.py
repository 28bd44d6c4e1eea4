"""Kernel IR -> C source with the same semantics as the LLVM rendering.

Stages, temporaries, threads (``TVMBackendParallelLaunch``) and fused epilogues mirror
:mod:`jitbyoc.render.llvm` one for one; kernels emit through the same :class:`Ctx`
methods (``parallel_for``, ``epilogue``) with C expressions in place of LLVM values.

The file needs no TVM header and compiles with ``cc -O2 -c``; compile with
``-ffp-contract=off`` for results bit-identical to the JIT (GCC otherwise fuses
``a*b + c`` into an FMA, which rounds once instead of twice). Like the LLVM renderer it
walks each stage once, one named temporary per node, so the two renderings line up.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

from ..ir import bfloat, kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.errors import RenderError, error_context
from ..ir.ops import op_def
from . import isa
from .indexing import CInts, Indexing, dot
from .loops import threaded

PRELUDE = r"""#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* C99, and C++ too: TVM's export_library compiles C sources with g++. */
#ifdef __cplusplus
#define restrict __restrict__
#define JB_EXPORT extern "C"
extern "C" {
#else
#define JB_EXPORT
#endif
/* TVM FFI packed-function ABI, spelled out so no TVM header is needed. */
typedef struct { int32_t type_index; uint32_t pad; union { int64_t v_int64; void* v_ptr; } v; } TVMFFIAny;
extern void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* message);
typedef struct { void* sync_handle; int32_t num_task; } TVMParallelGroupEnv;
extern int TVMBackendParallelLaunch(int (*f)(int, TVMParallelGroupEnv*, void*), void* cdata, int n);
extern void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int code, int bits);
extern int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr);
#ifdef __cplusplus
}
#endif

static inline int32_t jb_bits_f32(float x) { int32_t i; memcpy(&i, &x, 4); return i; }
static inline float jb_bits_i32(int32_t i) { float x; memcpy(&x, &i, 4); return x; }
static inline int64_t jb_bits_f64(double x) { int64_t i; memcpy(&i, &x, 8); return i; }
static inline double jb_bits_i64(int64_t i) { double x; memcpy(&x, &i, 8); return x; }
static inline int32_t jb_i32_at(const void* p, int64_t off) { int32_t v; memcpy(&v, (const char*)p + off, 4); return v; }
static inline int64_t jb_i64_at(const void* p, int64_t off) { int64_t v; memcpy(&v, (const char*)p + off, 8); return v; }
static inline void* jb_ptr_at(const void* p, int64_t off) { void* v; memcpy(&v, (const char*)p + off, sizeof v); return v; }
""" + bfloat.C_HELPERS


def c_literal(value, dt: str) -> str:
    d = lookup_dtype(dt)
    if d.is_bool:
        return "1" if value else "0"
    if d.is_bfloat:
        return f"((uint16_t){bfloat.bits(value):#06x})"
    v = d.held(value)
    if d.is_int:
        if d.bits < 64:
            return f"(({d.c}){v})"
        if not d.signed:
            return f"UINT64_C({v % 2**64})"
        return f"INT64_C({v})" if v > -2**63 else "INT64_MIN"
    if math.isnan(v):
        text = "NAN"
    elif math.isinf(v):
        text = "INFINITY" if v > 0 else "-INFINITY"
    else:
        text = v.hex() + d.c_suffix
    return f"(({d.c}){text})"


class Emitter:
    """Emits table ops as C statements, one temporary per value."""

    def __init__(self, ctx: "Ctx"):
        self.ctx = ctx
        self.fused = isa.has_fma()  # as the LLVM emitter: C's fma rounds once, as llvm.fma
        self.literals: dict[str, object] = {}  # a literal's text -> the number it stands for

    def temp(self, dt: str, expr: str) -> str:
        return self.ctx.let(lookup_dtype(dt).c, expr)

    def const(self, value, dt: str) -> str:
        text = c_literal(value, dt)
        self.literals[text] = value
        return text

    def known(self, value):
        """Mirror of :meth:`jitbyoc.render.llvm.Emitter.known`."""
        return self.literals.get(value) if isinstance(value, str) else None

    def loaded(self, raw: str, dt: str) -> str:
        """A loaded element (an lvalue) as a named value: bytes of a bool become 0/1."""
        return self.temp(dt, lookup_dtype(dt).loaded_c(raw))

    def op(self, name: str, dt: str, *args, **attrs) -> str:
        row = op_def(name, dt)
        if row.expand is not None:
            return row.expand(self, dt, *args, **attrs)
        d = lookup_dtype(dt)
        expr = row.c.format(*args, **attrs) if isinstance(row.c, str) else row.c(d, *args, **attrs)
        return self.temp(row.result_dtype(dt, attrs), expr)


def storage_c(dt: str) -> str:
    return lookup_dtype(dt).storage_c


evaluate = kir.evaluate


class Ctx(Indexing):
    """What a stage emits with: output lines, buffers by name, outlined functions; index
    arithmetic as :class:`jitbyoc.render.llvm.Ctx` (from :mod:`.indexing`)."""

    def __init__(self, name: str, bufs: list, syms: list, functions: list, depth: int = 1):
        self.name, self.bufs, self.syms, self.functions = name, bufs, syms, functions
        self.lines: list[str] = []
        self.depth = depth
        self.n = 0
        self.em = Emitter(self)

    @property
    def ints(self) -> CInts:
        """The index arithmetic over this ctx, made per use (as :class:`jitbyoc.render.llvm.Ctx`'s)."""
        return CInts(self)

    def line(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def let(self, ctype: str, expr: str) -> str:
        name = f"t{self.n}"
        self.n += 1
        self.line(f"const {ctype} {name} = {expr};")
        return name

    @contextmanager
    def block(self, header: str):
        self.line(header + " {")
        self.depth += 1
        yield
        self.depth -= 1
        self.line("}")

    @contextmanager
    def loop(self, var: str, count: str, start: str = "0"):
        with self.block(f"for (int64_t {var} = {start}; {var} < {count}; ++{var})"):
            yield var

    def element(self, buf: kir.Buffer, offset: str) -> str:
        return f"{buf.storage.name}[{offset}]"  # a view addresses its base

    def parallel_for(self, count: str, body, extra=()) -> None:
        """Mirror of :meth:`jitbyoc.render.llvm.Ctx.parallel_for`."""
        k = len(self.functions)
        fname, sname = f"{self.name}_par{k}", f"{self.name}_par{k}_t"
        fields = [f"{storage_c(b.dtype)}* {b.name}" for b in self.bufs] + \
            [f"int64_t {s}" for s in self.syms] + ["int64_t n"] + [f"int64_t x{j}" for j in range(len(extra))]
        child = Ctx(self.name, self.bufs, self.syms, self.functions)
        for f in fields:
            child.line(f"{f.replace('* ', '* restrict ')} = c->{f.split()[-1]};")
        child.line(" ".join(f"(void){f.split()[-1]};" for f in fields))
        child.line("const int64_t lo = c->n * task / env->num_task;")
        child.line("const int64_t hi = c->n * (task + 1) / env->num_task;")
        body(child, "lo", "hi", [f"x{j}" for j in range(len(extra))])
        child.line("return 0;")
        self.functions.append("\n".join(
            [f"typedef struct {{ {'; '.join(fields)}; }} {sname};",
             f"static int {fname}(int task, TVMParallelGroupEnv* env, void* cdata) {{",
             f"  const {sname}* c = ({sname}*)cdata;", *child.lines, "}", ""]))
        init = [f"({storage_c(b.dtype)}*){b.name}" for b in self.bufs] + list(self.syms) + [count] + list(extra)
        with self.block(""):
            self.line(f"{sname} c = {{{', '.join(init)}}};")
            self.line(f"if (TVMBackendParallelLaunch({fname}, &c, 0) != 0) return -1;")

    def epilogue(self, stage: kir.KernelStage, origin, extent) -> None:
        """Mirror of :meth:`jitbyoc.render.llvm.Ctx.epilogue`."""
        stores = stage.epilogue_stores()
        if not stores:
            return
        out = stage.out
        k = len(self.lines)
        idx = [f"e{k}_{j}" for j in range(out.ndim)]
        with _nest(self, idx, extent):
            pos = [f"({o} + {i})" for o, i in zip(origin, idx)]
            offset = self.offset(out.shape, pos)
            values = evaluate(self.em, [e for _, e in stores],
                              lambda buf: self.element(buf, self.offset(buf.shape, pos[out.ndim - buf.ndim:], True)),
                              self.element(out, offset), self.element)
            for buf, expr in stores:
                self.line(f"{self.element(buf, offset)} = {values[id(expr)]};")


@contextmanager
def _nest(ctx: Ctx, names, counts, starts=None):
    if not names:
        yield
        return
    with ctx.loop(names[0], counts[0], (starts or ["0"])[0]):
        with _nest(ctx, names[1:], counts[1:], (starts or [])[1:] or None):
            yield


def emit_elementwise(ctx: Ctx, stage: kir.Elementwise) -> None:
    roots = [node for _, node in stage.stores]
    bufs = kir.loads(roots) + [buf for buf, _ in stage.stores]
    layout = kir.nest_layout(stage.shape, bufs)
    k = len(ctx.lines)
    idx = [f"i{k}_{j}" for j in range(len(layout.extents))]

    def nest(c: Ctx, lo, hi, _extra):
        counts = [hi] + [c.product(ext) for ext in layout.extents[1:]]
        with _nest(c, idx, counts, [lo] + ["0"] * (len(idx) - 1)):
            def address(buf):
                walked = [(i, c.ints.product(s)) for i, s in zip(idx, layout.strides[buf]) if s is not None]
                return c.element(buf, c.ints.i(dot(c.ints, [i for i, _ in walked], [s for _, s in walked])))

            values = evaluate(c.em, roots, address, lookup=c.element)
            for buf, node in stage.stores:
                c.line(f"{address(buf)} = {values[id(node)]};")

    outer = ctx.product(layout.extents[0]) if layout.extents else "1"
    if layout.extents and threaded([d for ext in layout.extents for d in ext], "elementwise"):
        ctx.parallel_for(outer, nest)
    else:
        nest(ctx, "0", outer, ())


def alloc_workspace(ctx: Ctx, name: str, dtype: str, count: str) -> None:
    """``name``: room for ``count`` elements of ``dtype`` from TVM's workspace pool; the
    function returns -1 when there is none (TVM's allocator has set the error)."""
    d, ctype = lookup_dtype(dtype), storage_c(dtype)
    ctx.line(f"{ctype}* restrict {name} = ({ctype}*)TVMBackendAllocWorkspace("
             f"1, 0, (uint64_t)({count}) * {d.nbytes}, {d.dl_code}, {d.storage_bits});")
    ctx.line(f"if (!{name}) return -1;")


def free_workspace(ctx: Ctx, name: str) -> None:
    ctx.line(f"TVMBackendFreeWorkspace(1, 0, {name});")


def emit_compute(kernel: kir.Kernel, functions: list) -> list[str]:
    params = [f"const {storage_c(b.dtype)}* restrict {b.name}" for b in kernel.inputs]
    params += [f"{storage_c(b.dtype)}* restrict {b.name}" for b in kernel.outputs]
    params += [f"int64_t {s}" for s in kernel.sym_vars]
    ctx = Ctx(kernel.name, kernel.params + kernel.temps, kernel.sym_vars, functions)
    allocated = kir.allocated_temps(kernel)
    for t in allocated:
        alloc_workspace(ctx, t.name, t.dtype, ctx.product(t.shape))
    for t in kir.placed_in_order(kernel):  # inside another buffer: no restrict
        dest, offset = kernel.placed[t]
        ctx.line(f"{storage_c(t.dtype)}* {t.name} = {dest.name} + INT64_C({int(offset)});")
    for stage in kernel.stages:
        with error_context(RenderError, kernel.name, f"{kir.describe(stage)} in C"):
            if isinstance(stage, kir.Elementwise):
                emit_elementwise(ctx, stage)
            else:
                stage.emit_c(ctx)
    for t in reversed(allocated):
        free_workspace(ctx, t.name)
    ctx.line("return 0;")
    return [f"static int32_t {kernel.name}_compute({', '.join(params) or 'void'}) {{", *ctx.lines, "}"]
