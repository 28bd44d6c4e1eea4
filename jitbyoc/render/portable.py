"""Write a kernel once, render it twice: one facade over both renderers' ``Ctx``.

The layout, reduction and normalization kernels only need int64 index arithmetic, loops,
loads and stores, accumulators, table ops and the shared services (``parallel`` over
TVM's thread pool, ``epilogue``, ``workspace``/``free`` from TVM's workspace pool).
:class:`LLVM` offers them over llvmlite values and :class:`C` over C expressions with the
same method names, so a stage writes ``emit(self, e)`` once and both renderings have the
same structure by construction. Integers are given as ``int`` or as values of the facade.
Vector ops with a lane count (strips, masked loads and stores, lane folds) are in
:mod:`.portable_vectors`: in C every width is 1.
"""

from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.folds import FOLDS
from ..ir.llvmtypes import I32, I64
from . import c as c_render
from .indexing import CInts, LLVMInts
from .llvm import Emitter
from .loops import copy_bytes, for_range, free_workspace, workspace
from .portable_vectors import CVectors, LLVMVectors


def _round(pairs, lo_mask, hi_mask):
    """One shuffle round of the 8x8 transpose: rows 2k and 2k+1 of the next round are the
    low and high interleaves of the pair ``pairs[k]`` of this round's rows."""
    return [(a, b, mask) for a, b in pairs for mask in (lo_mask, hi_mask)]


# 8x8 transpose: interleave single lanes, then lane pairs, then lane quads. Each round
# lists (row a, row b, shuffle mask) per next-round row; after the last round, row k
# holds the transposed row TRANSPOSE8_ORDER[k] (checked in tests/test_kernel_layout.py).
TRANSPOSE8_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
TRANSPOSE8 = [
    _round([(0, 1), (2, 3), (4, 5), (6, 7)], [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]),
    _round([(0, 2), (1, 3), (4, 6), (5, 7)], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]),
    _round([(0, 4), (1, 5), (2, 6), (3, 7)], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),
]


class LLVM(LLVMVectors, LLVMInts):
    """The facade over :class:`jitbyoc.render.llvm.Ctx`."""

    def __init__(self, ctx):
        self.ctx, self.b, self.em = ctx, ctx.b, ctx.em

    # ---- int64 index arithmetic (folding: :class:`.indexing.LLVMInts`) -----------------
    def lt(self, x, y):
        return self.b.icmp_signed("<", self.i(x), self.i(y))

    def eq(self, x, y):
        return self.b.icmp_signed("==", self.i(x), self.i(y))

    def min(self, x, y):
        return self.b.select(self.lt(x, y), self.i(x), self.i(y))

    def max(self, x, y):
        return self.b.select(self.lt(x, y), self.i(y), self.i(x))

    def wrapping(self):
        """This facade with plain (wrapping) adds, subtractions and products, not ``nsw``:
        for arithmetic whose machine code must stay what it was before the facade."""
        plain = LLVM(self.ctx)
        plain.flags = ()
        return plain

    def index(self, v, dt: str):
        """A loaded integer of dtype ``dt`` as an int64 index."""
        d = lookup_dtype(dt)
        if d.bits == 64:
            return v
        return self.b.sext(v, I64) if d.signed else self.b.zext(v, I64)

    # ---- memory, loops, accumulators -----------------------------------------------------
    def load(self, buf, off):
        """The element as a value of its dtype (bool: i1)."""
        return self.em.loaded(self.ctx.load(buf, self.i(off)), buf.dtype)

    def store(self, buf, off, v) -> None:
        self.ctx.store(buf, self.i(off), v)

    def copy(self, dst, doff, src, soff) -> None:
        """Move one element's storage (any dtype, bool included) from ``src`` to ``dst``;
        where ``dst`` holds another dtype, its ``astype`` (a permute that also casts)."""
        if dst.dtype != src.dtype:
            self.store(dst, doff, self.op("astype", src.dtype, self.load(src, soff), to=dst.dtype))
            return
        self.b.store(self.ctx.load(src, self.i(soff)), self.ctx.element(dst, self.i(doff)))

    def copy_run(self, dst, doff, src, soff, count) -> None:
        """Move ``count`` consecutive elements of one dtype: one ``llvm.memcpy`` (no loop
        left for the loop vectorizer)."""
        copy_bytes(self.b, self.ctx.element(dst, self.i(doff)), self.ctx.element(src, self.i(soff)),
                   self.b.mul(self.i(count), I64(lookup_dtype(src.dtype).nbytes)))

    @contextmanager
    def loop(self, count, start=0, name="i"):
        with for_range(self.b, self.i(count), name, start=self.i(start)) as k:
            yield k

    def var(self, dt: str, init):
        """A mutable scalar of dtype ``dt`` (a stack slot that mem2reg promotes)."""
        typ = lookup_dtype(dt).ir
        with self.b.goto_block(self.b.function.entry_basic_block):
            slot = self.b.alloca(typ)
        self.b.store(init, slot)
        return slot

    def get(self, slot):
        return self.b.load(slot)

    def set(self, slot, v) -> None:
        self.b.store(v, slot)

    @contextmanager
    def when(self, cond):
        with self.b.if_then(cond):
            yield

    @contextmanager
    def if_else(self, cond):
        """Yields ``(then, otherwise)`` context managers, as llvmlite's ``if_else``."""
        with self.b.if_else(cond) as (then, otherwise):
            yield then, otherwise

    def transpose8(self, dst, doff, dstride, src, soff, sstride) -> None:
        """``dst[doff + i*dstride + j] = src[soff + j*sstride + i]`` for i, j < 8: eight
        row loads, three rounds of shuffles, eight row stores (any 8-lane element type)."""
        elem = lookup_dtype(src.dtype).storage_ir
        vec, align = ir.VectorType(elem, 8), lookup_dtype(src.dtype).nbytes
        rows = [self.b.load(self.ctx.element(src, self.add(soff, self.mul(k, sstride))),
                            typ=vec, align=align) for k in range(8)]
        for shuffles in TRANSPOSE8:
            rows = [self.b.shuffle_vector(rows[a], rows[b], ir.Constant(
                        ir.VectorType(I32, 8), mask)) for a, b, mask in shuffles]
        cast = Emitter(self.b, 8) if dst.dtype != src.dtype else None  # as copy()
        for row, k in zip(rows, TRANSPOSE8_ORDER):
            if cast is not None:
                row = cast.op("astype", src.dtype, row, to=dst.dtype)
            self.b.store(row, self.ctx.element(dst, self.add(doff, self.mul(k, dstride))),
                         align=lookup_dtype(dst.dtype).nbytes)

    # ---- values ------------------------------------------------------------------------------
    def op(self, name: str, dt: str, *args, **attrs):
        return self.em.op(name, dt, *args, **attrs)

    def const(self, value, dt: str):
        return self.em.const(value, dt)

    def select(self, cond, x, y):
        return self.b.select(cond, x, y)

    def reduce(self, kind: str, dt: str, acc, x):
        """``acc <kind> x`` (:data:`jitbyoc.ir.folds.FOLDS`)."""
        return FOLDS[kind].llvm(self.b, lookup_dtype(dt), acc, x)

    def or_(self, x, y):
        """Either of two conditions."""
        return self.b.or_(x, y)

    # ---- services ----------------------------------------------------------------------------
    def parallel(self, count, body, threads, extra=()) -> None:
        """``body(e, lo, hi, *extra)`` over [0, count): on TVM's thread pool when
        ``threads`` (``extra``, int64 values, passed along to the tasks)."""
        if threads:
            self.ctx.parallel_for(self.i(count), lambda c, lo, hi, x: body(LLVM(c), lo, hi, *x),
                                  [self.i(v) for v in extra], threads=threads)
        else:
            body(self, self.i(0), self.i(count), *extra)

    def workspace(self, dt: str, count):
        """Room for ``count`` elements of ``dt`` from TVM's workspace pool (the function
        returns -1 when there is none): :func:`jitbyoc.render.loops.workspace`."""
        return workspace(self.ctx, dt, self.i(count))

    def free(self, ptr) -> None:
        free_workspace(self.ctx, ptr)

    def epilogue(self, stage, origin, extent) -> None:
        self.ctx.epilogue(stage, [self.i(o) for o in origin], [self.i(x) for x in extent])


class C(CVectors, CInts):
    """The facade over :class:`jitbyoc.render.c.Ctx`; values are C expressions."""

    def __init__(self, ctx):
        self.ctx, self.em = ctx, ctx.em

    # ---- int64 index arithmetic (folding: :class:`.indexing.CInts`) --------------------
    def lt(self, x, y):
        return f"({self.i(x)} < {self.i(y)})"

    def eq(self, x, y):
        return f"({self.i(x)} == {self.i(y)})"

    def min(self, x, y):
        return f"({self.lt(x, y)} ? {self.i(x)} : {self.i(y)})"

    def max(self, x, y):
        return f"({self.lt(x, y)} ? {self.i(y)} : {self.i(x)})"

    def wrapping(self):
        return self

    def index(self, v, dt: str):
        return f"((int64_t){v})"

    def _name(self, stem: str) -> str:
        """A fresh C name; the underscore keeps it apart from the ctx's ``t<n>`` temporaries."""
        self.ctx.n += 1
        return f"{stem}_{self.ctx.n}"

    def load(self, buf, off):
        return self.em.loaded(self.ctx.element(buf, self.i(off)), buf.dtype)

    def store(self, buf, off, v) -> None:
        self.ctx.line(f"{self.ctx.element(buf, self.i(off))} = {v};")

    def copy(self, dst, doff, src, soff) -> None:
        value = self.ctx.element(src, self.i(soff))
        if dst.dtype != src.dtype:
            value = self.op("astype", src.dtype, self.load(src, soff), to=dst.dtype)
        self.ctx.line(f"{self.ctx.element(dst, self.i(doff))} = {value};")

    def copy_run(self, dst, doff, src, soff, count) -> None:
        to, frm = self.ctx.element(dst, self.i(doff)), self.ctx.element(src, self.i(soff))
        size = f"(size_t)({self.i(count)}) * sizeof({self.ctx.element(src, '0')})"
        self.ctx.line(f"memcpy(&{to}, &{frm}, {size});")

    @contextmanager
    def loop(self, count, start=0, name="i"):
        var = self._name(name)
        with self.ctx.loop(var, self.i(count), self.i(start)):
            yield var

    def var(self, dt: str, init):
        name = self._name("acc")
        self.ctx.line(f"{lookup_dtype(dt).c} {name} = {init};")
        return name

    def get(self, slot):
        return slot

    def set(self, slot, v) -> None:
        self.ctx.line(f"{slot} = {v};")

    @contextmanager
    def when(self, cond):
        with self.ctx.block(f"if ({cond})"):
            yield

    @contextmanager
    def if_else(self, cond):
        yield self.ctx.block(f"if ({cond})"), self.ctx.block("else")

    def transpose8(self, dst, doff, dstride, src, soff, sstride) -> None:
        """Mirror of :meth:`LLVM.transpose8` (plain loops)."""
        with self.loop(8, 0, "ti") as i:
            with self.loop(8, 0, "tj") as j:
                self.copy(dst, self.add(doff, self.add(self.mul(i, dstride), j)),
                          src, self.add(soff, self.add(self.mul(j, sstride), i)))

    def op(self, name: str, dt: str, *args, **attrs):
        return self.em.op(name, dt, *args, **attrs)

    def const(self, value, dt: str):
        return self.em.const(value, dt)

    def select(self, cond, x, y):
        return f"({cond} ? {x} : {y})"

    def reduce(self, kind: str, dt: str, acc, x):
        """Mirror of :meth:`LLVM.reduce`."""
        return FOLDS[kind].c(lookup_dtype(dt), acc, x)

    def or_(self, x, y):
        return f"({x} || {y})"

    def parallel(self, count, body, threads, extra=()) -> None:
        if threads:
            self.ctx.parallel_for(self.i(count), lambda c, lo, hi, x: body(C(c), lo, hi, *x),
                                  [self.i(v) for v in extra])
        else:
            body(self, self.i(0), self.i(count), *extra)

    def workspace(self, dt: str, count):
        """Mirror of :meth:`LLVM.workspace`."""
        name = self._name("ws")
        c_render.alloc_workspace(self.ctx, name, dt, self.i(count))
        return name

    def free(self, ptr) -> None:
        c_render.free_workspace(self.ctx, ptr)

    def epilogue(self, stage, origin, extent) -> None:
        self.ctx.epilogue(stage, [self.i(o) for o in origin], [self.i(x) for x in extent])


class PortableStage:
    """Mixin: a :class:`~jitbyoc.ir.kir.KernelStage` that implements ``emit(e)`` once."""

    def moves_bytes(self) -> bool:
        """Whether the stage's copies can move bytes (``copy_run``: one memcpy a run): every
        input has the result's dtype, of whole bytes an element (no cast on the way)."""
        return (all(x.dtype == self.out.dtype for x in self.inputs)
                and lookup_dtype(self.out.dtype).storage_bits % 8 == 0)

    def emit_llvm(self, ctx) -> None:
        self.emit(LLVM(ctx))

    def emit_c(self, ctx) -> None:
        self.emit(C(ctx))
