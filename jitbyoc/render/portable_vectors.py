"""Vector ops of the :mod:`.portable` facade, parameterized by a lane count.

A kernel asks :meth:`lanes` how many elements of a dtype one vector holds (the widths of
:func:`jitbyoc.render.vectors.lanes` in LLVM, 1 in C) and writes its loops as strips of
that many elements: a whole strip has no mask, the tail strip a lane mask. In C every
width is 1, so a strip loop is a plain loop, a vector load an element access, a splat the
value itself and a lane fold nothing: the C rendering is the scalar code of the same loop
structure. Width 1 in LLVM is the same scalar code (strided rows). Element types are
numeric (no bool): values are as stored.
"""

from __future__ import annotations

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.folds import FOLDS, identity
from ..ir.llvmtypes import I32
from . import vectors
from .c import storage_c
from .llvm import Emitter


class LLVMVectors:
    """Mixin of :class:`.portable.LLVM` (``self.b``, ``self.ctx``, ``self.i``, ``self.loop``)."""

    def lanes(self, dt: str) -> int:
        return vectors.lanes(dt)

    def address(self, buf, off):
        """A pointer to element ``off`` of ``buf``: where a row that :meth:`vload` reads starts."""
        return self.ctx.element(buf, self.i(off))

    def strips(self, start, stop, width: int, body, name: str = "k") -> None:
        """``body(i, mask)`` for the strips of ``width`` elements of [start, stop):
        :func:`jitbyoc.render.vectors.strips`; width 1, a loop named ``name``."""
        if width == 1:
            with self.loop(stop, start, name) as k:
                body(k, None)
        else:
            vectors.strips(self.b, self.i(start), self.i(stop), width, body)

    def _at(self, ptr, off, dt: str):
        return self.b.gep(ptr, [self.i(off)], source_etype=lookup_dtype(dt).ir)

    def vload(self, ptr, off, dt: str, width: int, mask=None, fill=0):
        """``width`` elements from ``ptr + off``; lanes off the ``mask`` read ``fill``."""
        v = vectors.vload(self.b, self._at(ptr, off, dt), dt, mask, width)
        return v if mask is None else self.b.select(mask, v, self.vconst(fill, dt, width))

    def vstore(self, ptr, off, v, dt: str, mask=None) -> None:
        vectors.vstore(self.b, v, self._at(ptr, off, dt), dt, mask)

    def splat(self, v, width: int):
        return v if width == 1 else vectors.splat(self.b, v, width)

    def vop(self, width: int, name: str, dt: str, *args, **attrs):
        """The table op ``name`` on ``width``-lane values (:meth:`op` lane by lane)."""
        return Emitter(self.b, width).op(name, dt, *args, **attrs)

    def vconst(self, value, dt: str, width: int):
        return Emitter(self.b, width).const(value, dt)

    def fold_lanes(self, kind: str, dt: str, count, width: int, step):
        """Fold ``acc = step(acc, i, mask)`` over the strips of [0, count) from ``kind``'s
        identity (:data:`jitbyoc.ir.folds.FOLDS`) into ``width`` lanes, then the lanes into
        a scalar with ``kind``'s op (halving shuffles: log2(width) steps)."""
        b = self.b
        with b.goto_entry_block():  # a static slot mem2reg promotes: in a loop, an alloca grows the stack
            acc = b.alloca(self.vconst(identity(kind, dt), dt, width).type)
        b.store(self.vconst(identity(kind, dt), dt, width), acc)
        self.strips(0, count, width, lambda i, mask: b.store(step(b.load(acc), i, mask), acc))
        v, op = b.load(acc), FOLDS[kind].op
        while width > 1:
            width //= 2
            lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width))))
            hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(width, 2 * width))))
            v = self.vop(width, op, dt, lo, hi) if width > 1 else \
                self.op(op, dt, b.extract_element(lo, I32(0)), b.extract_element(hi, I32(0)))
        return v


class CVectors:
    """Mixin of :class:`.portable.C`: every width is 1."""

    def lanes(self, dt: str) -> int:
        return 1

    def address(self, buf, off):
        name = self._name("row")
        self.ctx.line(f"{storage_c(buf.dtype)} *{name} = &{self.ctx.element(buf, self.i(off))};")
        return name

    def strips(self, start, stop, width: int, body, name: str = "k") -> None:
        with self.loop(stop, start, name) as k:
            body(k, None)

    def vload(self, ptr, off, dt: str, width: int, mask=None, fill=0):
        return self.em.loaded(f"{ptr}[{self.i(off)}]", dt)

    def vstore(self, ptr, off, v, dt: str, mask=None) -> None:
        self.ctx.line(f"{ptr}[{self.i(off)}] = {v};")

    def splat(self, v, width: int):
        return v

    def vop(self, width: int, name: str, dt: str, *args, **attrs):
        return self.op(name, dt, *args, **attrs)

    def vconst(self, value, dt: str, width: int):
        return self.const(value, dt)

    def fold_lanes(self, kind: str, dt: str, count, width: int, step):
        acc = self.var(dt, self.const(identity(kind, dt), dt))
        with self.loop(count, 0, "k") as k:
            self.set(acc, step(self.get(acc), k, None))
        return self.get(acc)
