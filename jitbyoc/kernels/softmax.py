"""softmax and log_softmax over any axis.

The tensor is viewed as (outer, L, inner) around the axis; each of the outer*inner rows
is reduced on its own: max, then the sum of exp(x - max) (exp from :mod:`jitbyoc.ir.vecmath`,
so it vectorizes), then one scaling pass. Rows are split across TVM's thread pool.

Accuracy: the sum is accumulated with reassociation allowed, so LLVM sums in vector
lanes and the C rendering sums in order; both are within ``L * eps`` relative of the
exact sum, and results agree to about 1e-6 relative (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.llvm import Emitter
from ..render.loops import for_range, threaded
from ..render.vectors import lanes, splat, strips, vload, vstore


@dataclass(eq=False)
class Softmax(kir.KernelStage):
    axis: int = -1
    log: bool = False

    def split(self):
        shape = self.out.shape
        return shape[:self.axis], shape[self.axis], shape[self.axis + 1:]

    # ---- LLVM ----------------------------------------------------------------------------------
    def needs_loop_vectorizer(self) -> bool:
        return bool(self.split()[2])  # rows along the last axis are written as vectors

    def emit_llvm(self, ctx) -> None:
        outer, length, inner = self.split()
        rows = ctx.product(outer + inner)
        body = self._llvm_rows if inner else self._llvm_vector_rows
        if threaded(self.out.shape, "rows"):
            ctx.parallel_for(rows, body)
        else:
            body(ctx, ir.Constant(I64, 0), rows, ())
        if inner:
            ctx.epilogue(self, [0] * self.out.ndim, list(self.out.shape))

    def _llvm_rows(self, c, lo, hi, _extra) -> None:
        b, em = c.b, c.em
        (x,), out, dt = self.inputs, self.out, self.out.dtype
        outer, length, inner = self.split()
        n_inner, n = c.product(inner), c.dim(length)
        with for_range(b, hi, "row", start=lo) as r:
            base = b.add(b.mul(b.sdiv(r, n_inner), b.mul(n, n_inner)), b.srem(r, n_inner))

            def at(k):
                return b.add(base, b.mul(k, n_inner))

            m = self._reduce(c, n, lambda k, acc: em.op("maximum", dt, acc, c.load(x, at(k))),
                             em.const(float("-inf"), dt))

            def add_exp(k, acc):
                shifted = em.op("subtract", dt, c.load(x, at(k)), m)
                e = em.op("exp", dt, shifted)
                if not self.log:
                    c.store(out, at(k), e)
                return b.fadd(acc, e, flags=("reassoc",))

            s = self._reduce(c, n, add_exp, em.const(0, dt))
            shift = em.op("add", dt, m, em.op("log", dt, s)) if self.log else \
                em.op("divide", dt, em.const(1, dt), s)
            with for_range(b, n, "k") as k:
                v = em.op("subtract", dt, c.load(x, at(k)), shift) if self.log else \
                    em.op("multiply", dt, c.load(out, at(k)), shift)
                c.store(out, at(k), v)
            if not inner:
                c.epilogue(self, c.unravel(r, outer) + [0], [1] * len(outer) + [length])

    def _llvm_vector_rows(self, c, lo, hi, _extra) -> None:
        """Rows along the last (contiguous) axis on explicit vectors (:func:`vector_row`)."""
        b, n = c.b, c.dim(self.split()[1])
        (x,), out, outer = self.inputs, self.out, self.split()[0]
        with for_range(b, hi, "row", start=lo) as r:
            vector_row(b, self.out.dtype, c.element(x, b.mul(r, n)), c.element(out, b.mul(r, n)), n, self.log)
            c.epilogue(self, c.unravel(r, outer) + [0], [1] * len(outer) + [self.split()[1]])

    @staticmethod
    def _reduce(c, n, step, init):
        b = c.b
        with b.goto_entry_block():  # a static slot mem2reg promotes, even inside the row loop
            acc = b.alloca(init.type)
        b.store(init, acc)
        with for_range(b, n, "k") as k:
            b.store(step(k, b.load(acc)), acc)
        return b.load(acc)

    # ---- C -----------------------------------------------------------------------------------
    def emit_c(self, ctx) -> None:
        outer, length, inner = self.split()
        rows = ctx.product(outer + inner)
        if threaded(self.out.shape, "rows"):
            ctx.parallel_for(rows, self._c_rows)
        else:
            self._c_rows(ctx, "0", rows, ())
        if inner:
            ctx.epilogue(self, ["0"] * self.out.ndim, [ctx.dim(d) for d in self.out.shape])

    def _c_rows(self, c, lo, hi, _extra) -> None:
        (x,), out, dt = self.inputs, self.out, self.out.dtype
        outer, length, inner = self.split()
        em, ni, n = c.em, c.product(inner), c.dim(length)
        ctype = lookup_dtype(dt).c
        with c.loop("row", hi, lo):
            c.line(f"const int64_t base = (row / ({ni})) * ({n}) * ({ni}) + row % ({ni});")
            at = f"base + k * ({ni})"
            c.line(f"{ctype} m = -INFINITY, s = 0;")
            with c.loop("k", n):
                c.line(f"m = {em.op('maximum', dt, 'm', c.element(x, at))};")
            with c.loop("k", n):
                e = em.op("exp", dt, em.op("subtract", dt, c.element(x, at), "m"))
                if not self.log:
                    c.line(f"{c.element(out, at)} = {e};")
                c.line(f"s += {e};")
            shift = em.op("add", dt, "m", em.op("log", dt, "s")) if self.log else \
                em.op("divide", dt, em.const(1, dt), "s")
            with c.loop("k", n):
                v = em.op("subtract", dt, c.element(x, at), shift) if self.log else \
                    em.op("multiply", dt, c.element(out, at), shift)
                c.line(f"{c.element(out, at)} = {v};")
            if not inner:
                c.epilogue(self, c.unravel("row", outer) + ["0"], ["1"] * len(outer) + [n])

    @staticmethod
    def reference(x: np.ndarray, axis: int = -1, log: bool = False) -> np.ndarray:
        shifted = x - x.max(axis=axis, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=axis, keepdims=True)
        return (shifted - np.log(s) if log else e / s).astype(x.dtype)


def vector_row(b, dt: str, src, dst, n, log: bool = False) -> None:
    """(log_)softmax of the ``n`` contiguous elements at ``src`` into ``dst`` (may be
    ``src``) on explicit vectors: the max, the sum of exponentials and the scaling each
    one pass of whole vectors and a masked tail. Also the row step of fused attention."""
    width = lanes(dt)
    em, scalar = Emitter(b, width), Emitter(b)

    def strip_load(ptr, i, mask, fill):
        v = vload(b, b.gep(ptr, [i], source_etype=lookup_dtype(dt).ir), dt, mask)
        return v if mask is None else b.select(mask, v, em.const(fill, dt))

    def strip_store(v, i, mask):
        vstore(b, v, b.gep(dst, [i], source_etype=lookup_dtype(dt).ir), dt, mask)

    m = lanes_reduce(b, em, "maximum", dt, n, float("-inf"),
                      lambda acc, i, mask: em.op("maximum", dt, acc, strip_load(src, i, mask, "-inf")))

    def add_exp(acc, i, mask):
        e = em.op("exp", dt, em.op("subtract", dt, strip_load(src, i, mask, 0), splat(b, m, width)))
        if not log:
            strip_store(e, i, mask)
        return b.fadd(acc, b.select(mask, e, em.const(0, dt)) if mask is not None else e,
                      flags=("reassoc",))

    s = lanes_reduce(b, em, "add", dt, n, 0, add_exp)
    if log:
        shift = splat(b, b.fadd(m, scalar.op("log", dt, s)), width)
        strips(b, I64(0), n, width, lambda i, mask: strip_store(
            b.fsub(strip_load(src, i, mask, 0), shift), i, mask))
    else:
        scale = splat(b, scalar.op("divide", dt, scalar.const(1, dt), s), width)
        strips(b, I64(0), n, width, lambda i, mask: strip_store(
            b.fmul(strip_load(dst, i, mask, 0), scale), i, mask))


def lanes_reduce(b, em, op: str, dt: str, n, init, step):
    """Fold ``step(acc, i, mask)`` over the strips of ``[0, n)`` into one vector, then its
    lanes into a scalar with ``op`` (halving shuffles: log2(lanes) steps)."""
    with b.goto_entry_block():  # a static slot mem2reg promotes: in a loop, an alloca grows the stack
        acc = b.alloca(em.const(init, dt).type)
    b.store(em.const(init, dt), acc)
    strips(b, I64(0), n, em.lanes, lambda i, mask: b.store(step(b.load(acc), i, mask), acc))
    v, width = b.load(acc), em.lanes
    while width > 1:
        width //= 2
        lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width))))
        hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width, 2 * width))))
        v = Emitter(b, width).op(op, dt, lo, hi) if width > 1 else \
            Emitter(b).op(op, dt, b.extract_element(lo, I32(0)), b.extract_element(hi, I32(0)))
    return v


def _check(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, FLOATS)
    if problem:
        return f"{call.op.name}: {problem}"
    if not dims(x.ty):
        return f"{call.op.name}: rank-0 input"
    return None


def _builder(log: bool):
    def build(fe, call, out):
        x = fe.buffer(call.args[0])
        axis = int(call.attrs.axis) % x.ndim
        return Softmax((x,), out, axis=axis, log=log)
    return build


register("relax.nn.softmax", 1, _check)(_builder(False))
register("relax.nn.log_softmax", 1, _check)(_builder(True))
