"""Vector ops of the :mod:`.portable` facade, parameterized by a lane count.

A kernel asks :meth:`lanes` how many elements of a dtype one vector holds (the widths of
:func:`jitbyoc.render.vectors.lanes` in LLVM, 1 in C) and writes its loops as strips of
that many elements: a whole strip has no mask, the tail strip a lane mask. In C every
width is 1, so a strip loop is a plain loop, a vector load an element access, a splat the
value itself and a lane fold nothing: the C rendering is the scalar code of the same loop
structure. Width 1 in LLVM is the same scalar code (strided rows). Loads and stores move
elements as stored; :meth:`evaluate` computes expression trees on lanes, and
:meth:`loaded`/:meth:`stored` convert between stored elements and values (a bool's byte
and its i1 in LLVM).
"""

from __future__ import annotations

from llvmlite import ir

from ..ir import kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.folds import FOLDS, identity
from ..ir.llvmtypes import I1, I32
from . import vectors
from .c import storage_c
from .llvm import Emitter


class LLVMVectors:
    """Mixin of :class:`.portable.LLVM` (``self.b``, ``self.ctx``, ``self.i``, ``self.loop``)."""

    def lanes(self, dt: str) -> int:
        return vectors.lanes(dt)

    def address(self, src, off, dt: str | None = None):
        """A pointer to element ``off`` of ``src`` (a buffer, or a pointer to elements of
        ``dt``): where a row that :meth:`vload` reads starts."""
        return self._at(src, off, dt or src.dtype)

    def pointer(self, buf):
        """``buf``'s base pointer: elements addressed from it may lie before the buffer
        (no ``inbounds``), as long as masked-off lanes are the only ones that do."""
        return self.ctx.ptrs[buf.storage]

    def strips(self, start, stop, width: int, body, name: str = "k") -> None:
        """``body(i, mask)`` for the strips of ``width`` elements of [start, stop):
        :func:`jitbyoc.render.vectors.strips`; width 1, a loop named ``name``."""
        if width == 1:
            with self.loop(stop, start, name) as k:
                body(k, None)
        else:
            vectors.strips(self.b, self.i(start), self.i(stop), width, body)

    def _at(self, src, off, dt: str):
        """Element ``off`` of ``src``: a buffer (in bounds) or a pointer."""
        if isinstance(src, kir.Buffer):
            return self.ctx.element(src, self.i(off))
        return self.b.gep(src, [self.i(off)], source_etype=lookup_dtype(dt).storage_ir)

    def vload(self, src, off, dt: str, width: int, mask=None, fill=0):
        """``width`` elements from element ``off`` of ``src`` (a buffer or a pointer);
        lanes off the ``mask`` read ``fill`` (None: whatever, e.g. lanes only stored
        back under the same mask) and touch no memory."""
        v = vectors.vload(self.b, self._at(src, off, dt), dt, mask, width)
        return v if mask is None or fill is None else self.b.select(mask, v, self.vconst(fill, dt, width))

    def vbroadcast(self, src, off, dt: str, width: int):
        """Element ``off`` of ``src`` (as stored) in each of ``width`` lanes."""
        return self.splat(self.b.load(self._at(src, off, dt), typ=lookup_dtype(dt).storage_ir), width)

    def vload_every(self, src, off, dt: str, width: int, stride: int, lanes=None, fill=0):
        """Lane ``k`` reads element ``off + k * stride`` of ``src``: one load of the span,
        every ``stride``-th element picked by a shuffle. With ``lanes`` (a static
        ``(first, last)``), lanes outside ``[first, last)`` hold ``fill`` and the load is
        masked to the span the others read."""
        b, wide = self.b, width * stride
        mask = None
        if lanes is not None:
            loaded = [lanes[0] * stride <= k <= (lanes[1] - 1) * stride for k in range(wide)]
            mask = None if all(loaded) else ir.Constant(ir.VectorType(I1, wide), loaded)
        v = vectors.vload(b, self._at(src, off, dt), dt, mask, wide)
        if stride > 1:
            every = ir.Constant(ir.VectorType(I32, width), [k * stride for k in range(width)])
            v = b.shuffle_vector(v, v, every)
        if lanes is not None and tuple(lanes) != (0, width):
            inside = ir.Constant(ir.VectorType(I1, width), [lanes[0] <= k < lanes[1] for k in range(width)])
            v = b.select(inside, v, self.vconst(fill, dt, width))
        return v

    def vstore(self, dst, off, v, dt: str, mask=None) -> None:
        vectors.vstore(self.b, v, self._at(dst, off, dt), dt, mask)

    def prefetch(self, buf, off, locality: int = 3) -> None:
        """Ask for the cache line of element ``off`` of ``buf`` (past its end: harmless),
        into the caches ``locality`` names (LLVM's: 3 every level, 2 L2 and out...)."""
        vectors.prefetch(self.b, self.b.gep(self.pointer(buf), [self.i(off)],
                                            source_etype=lookup_dtype(buf.dtype).storage_ir), locality=locality)

    def lane_mask(self, count, width: int):
        """The first ``count`` of ``width`` lanes (:func:`jitbyoc.render.vectors.lane_mask`;
        an int ``count``: a constant)."""
        return vectors.lane_mask(self.b, count, width)

    def lanes_where(self, flags):
        """A constant mask: lane ``k`` set where ``flags[k]`` (None when every lane is)."""
        return None if all(flags) else ir.Constant(ir.VectorType(I1, len(flags)), [bool(f) for f in flags])

    def lanes_of(self, dt: str, width: int, fill, values):
        """A ``width``-lane value: lane ``k`` the ``k``-th of ``values`` (consumed lane by
        lane), the lanes after them ``fill``."""
        v = ir.Constant(ir.VectorType(lookup_dtype(dt).ir, width), [fill] * width)
        for k, x in enumerate(values):
            v = self.b.insert_element(v, x, I32(k))
        return v

    def vvar(self, dt: str, width: int):
        """A mutable ``width``-lane slot (no value yet): :meth:`set`, :meth:`get`."""
        with self.b.goto_block(self.b.function.entry_basic_block):
            return self.b.alloca(self.vconst(0, dt, width).type)

    def keep_scalar(self, index) -> None:
        """Tag the finished loop of ``index`` so LLVM's loop vectorizer leaves it alone."""
        module = self.ctx.module
        flag = module.add_metadata([ir.MetaDataString(module, "llvm.loop.vectorize.enable"), I1(0)])
        loop_id = module.add_metadata([flag, index.name])  # unique placeholder, then self-reference
        loop_id.operands = (loop_id, flag)
        latch = index.incomings[1][1]
        latch.terminator.set_metadata("llvm.loop", loop_id)

    def splat(self, v, width: int):
        return v if width == 1 else vectors.splat(self.b, v, width)

    def vop(self, width: int, name: str, dt: str, *args, **attrs):
        """The table op ``name`` on ``width``-lane values (:meth:`op` lane by lane)."""
        return Emitter(self.b, width).op(name, dt, *args, **attrs)

    def evaluate(self, width: int, roots, load, acc=None) -> dict:
        """:func:`jitbyoc.ir.kir.evaluate` of expression trees on ``width``-lane values:
        ``load(buf)`` gives a buffer's lanes as stored, ``acc`` stands for the Acc."""
        return kir.evaluate(Emitter(self.b, width), roots, load, acc, self.ctx.lookup)

    def loaded(self, raw, dt: str):
        """Lanes as stored (a load of ``dt``) as values: bytes of a bool become i1."""
        return self.em.loaded(raw, dt)

    def stored(self, v, dt: str):
        """Values (lanes) of ``dt`` as stored: what :meth:`vstore` takes."""
        return lookup_dtype(dt).stored_llvm(self.b, v)

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
        return self.fold_vector(kind, dt, b.load(acc), width)

    def fold_vector(self, kind: str, dt: str, v, width: int):
        """The ``width`` lanes of ``v`` folded into a scalar with ``kind``'s op (halving
        shuffles: log2(width) steps)."""
        b, op = self.b, FOLDS[kind].op
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

    def address(self, src, off, dt: str | None = None):
        name = self._name("row")
        self.ctx.line(f"{storage_c(dt or src.dtype)} *{name} = &{self._at(src, off)};")
        return name

    def pointer(self, buf):
        return buf.storage.name

    def strips(self, start, stop, width: int, body, name: str = "k") -> None:
        with self.loop(stop, start, name) as k:
            body(k, None)

    def _at(self, src, off) -> str:
        return self.ctx.element(src, self.i(off)) if isinstance(src, kir.Buffer) else f"{src}[{self.i(off)}]"

    def vload(self, src, off, dt: str, width: int, mask=None, fill=0):
        return self.em.loaded(self._at(src, off), dt)

    def vbroadcast(self, src, off, dt: str, width: int):
        return self._at(src, off)

    def vload_every(self, src, off, dt: str, width: int, stride: int, lanes=None, fill=0):
        return self.vload(src, off, dt, width)  # one lane: inside, or the caller skips the load

    def vstore(self, dst, off, v, dt: str, mask=None) -> None:
        self.ctx.line(f"{self._at(dst, off)} = {v};")

    def prefetch(self, buf, off, locality: int = 3) -> None:
        pass  # the C rendering leaves it to the compiler and the hardware

    def lane_mask(self, count, width: int):
        return None

    def lanes_where(self, flags):
        return None

    def lanes_of(self, dt: str, width: int, fill, values):
        first = next(iter(values), None)
        return self.const(fill, dt) if first is None else first

    def vvar(self, dt: str, width: int):
        name = self._name("acc")
        self.ctx.line(f"{lookup_dtype(dt).c} {name};")
        return name

    def keep_scalar(self, index) -> None:
        pass

    def splat(self, v, width: int):
        return v

    def vop(self, width: int, name: str, dt: str, *args, **attrs):
        return self.op(name, dt, *args, **attrs)

    def evaluate(self, width: int, roots, load, acc=None) -> dict:
        return kir.evaluate(self.em, roots, load, acc, self.ctx.element)

    def loaded(self, raw, dt: str):
        return self.em.loaded(raw, dt)

    def stored(self, v, dt: str):
        return v  # C converts a bool to its byte

    def vconst(self, value, dt: str, width: int):
        return self.const(value, dt)

    def fold_vector(self, kind: str, dt: str, v, width: int):
        return v

    def fold_lanes(self, kind: str, dt: str, count, width: int, step):
        acc = self.var(dt, self.const(identity(kind, dt), dt))
        with self.loop(count, 0, "k") as k:
            self.set(acc, step(self.get(acc), k, None))
        return self.get(acc)
