"""The integer-index layer, one for both renderers and every kernel.

:class:`Ints` is int64 index arithmetic that folds static sizes (Python ints) and emits
the rest through a renderer's primitives: :class:`LLVMInts` (llvmlite i64 values) and
:class:`CInts` (``int64_t`` C expressions). The portable facades are :class:`Ints`;
the renderers' ``Ctx`` get theirs as ``ctx.ints`` and their ``dim``/``product``/
``unravel``/``offset`` from :class:`Indexing`. The helpers below only call facade
methods, so one helper serves both renderers: thread-pool thresholds, row-major
unravelling and offsets, dot products of indices and strides, and folds (reductions
along a loop, of the kinds :mod:`jitbyoc.ir.folds` defines).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import reduce

from llvmlite import ir

from ..ir.folds import identity
from ..ir.llvmtypes import I64


def unravel(e, flat, extents, wrap: bool = False) -> list:
    """Row-major indices of ``flat`` in ``extents`` (facade values): ``flat`` is assumed
    in range, or with ``wrap`` the outermost index is taken modulo its extent as well."""
    out = []
    for k in range(len(extents) - 1, 0, -1):
        out.append(e.let(e.rem(flat, extents[k])))
        flat = e.let(e.div(flat, extents[k]))
    if wrap and extents:
        flat = e.let(e.rem(flat, extents[0]))
    return ([flat] if extents else []) + out[::-1]


def offset(e, shape, pos, broadcast: bool = False):
    """Row-major offset of ``pos`` (facade values) in ``shape`` (ints and symbolic
    names); with ``broadcast``, size-1 dims read 0."""
    off = 0
    for d, p in zip(shape, pos):
        off = e.add(e.mul(off, e.dim(d)), 0 if broadcast and d == 1 else p)
    return off


def fold(e, kind: str, dt: str, count, value, start=0):
    """``value(k)`` for k in [start, count) combined by ``kind`` (a key of
    :data:`jitbyoc.ir.folds.FOLDS`)."""
    return folds(e, kind, dt, count, [value], start)[0]


def folds(e, kind: str, dt: str, count, values, start=0) -> list:
    """:func:`fold` of several ``values`` in one loop: independent accumulators, so rows
    folded together stream from memory side by side."""
    accs = [e.var(dt, e.const(identity(kind, dt), dt)) for _ in values]
    with e.loop(count, start, "k") as k:
        for acc, value in zip(accs, values):
            e.set(acc, e.reduce(kind, dt, e.get(acc), value(k)))
    return [e.get(acc) for acc in accs]


def div_ceil(e, x, y: int):
    """``ceil(x / y)`` of ``x >= 0`` (a facade value) and a static ``y > 0``: how many
    blocks of ``y`` cover ``x``."""
    return e.div(e.add(x, y - 1), y)


def dot(e, idx, strides):
    """``sum(idx[k] * strides[k])`` (facade values)."""
    acc = 0
    for i, s in zip(idx, strides):
        acc = e.add(acc, e.mul(i, s))
    return acc


def product(e, values):
    """``values[0] * values[1] * ...`` (facade values; 1 for none)."""
    acc = 1
    for v in values:
        acc = e.mul(acc, v)
    return acc


def _is(v, k: int) -> bool:
    return isinstance(v, int) and v == k


class Ints:
    """Integer arithmetic: static sizes stay Python ints and fold (so ``x + 0``, ``x * 1``,
    ``x * 0`` and products of static dims emit nothing); the rest goes to the renderer's
    ``i`` (an int as a value), ``_add``/``_sub``/``_mul``/``_div``/``_rem`` (C semantics:
    truncating), ``let`` and ``sym`` (a symbolic size's value)."""

    def add(self, x, y):
        if isinstance(x, int) and isinstance(y, int):
            return x + y
        if _is(x, 0) or _is(y, 0):
            return y if _is(x, 0) else x
        return self._add(self.i(x), self.i(y))

    def sub(self, x, y):
        if isinstance(x, int) and isinstance(y, int):
            return x - y
        return x if _is(y, 0) else self._sub(self.i(x), self.i(y))

    def mul(self, x, y):
        if isinstance(x, int) and isinstance(y, int):
            return x * y
        if _is(x, 0) or _is(y, 0):
            return 0
        if _is(x, 1) or _is(y, 1):
            return y if _is(x, 1) else x
        return self._mul(self.i(x), self.i(y))

    def div(self, x, y):
        if isinstance(x, int) and isinstance(y, int) and x >= 0 and y > 0:
            return x // y
        return x if _is(y, 1) else self._div(self.i(x), self.i(y))

    def rem(self, x, y):
        if isinstance(x, int) and isinstance(y, int) and x >= 0 and y > 0:
            return x % y
        return 0 if _is(y, 1) else self._rem(self.i(x), self.i(y))

    def dim(self, d):
        return d if isinstance(d, int) else self.sym(d)

    def product(self, dims):
        """The product of ``dims`` (ints and symbolic names), the static ones folded first."""
        acc = reduce(lambda x, y: x * y, (d for d in dims if isinstance(d, int)), 1)
        for d in dims:
            if not isinstance(d, int):
                acc = self.mul(acc, self.dim(d))
        return acc

    def as_float(self, v, dt: str):
        """An int64 count as a ``dt`` value (a constant when static)."""
        return self.const(v, dt) if isinstance(v, int) else self.op("astype", "int64", v, to=dt)


class LLVMInts(Ints):
    """:class:`Ints` over llvmlite i64 values of ``ctx`` (a :class:`jitbyoc.render.llvm.Ctx`):
    adds, subtractions and products are ``nsw`` (``flags`` empty: plain, wrapping)."""
    flags: tuple = ("nsw",)

    def __init__(self, ctx):
        self.ctx, self.b = ctx, ctx.b

    def i(self, v):
        return ir.Constant(I64, v) if isinstance(v, int) else v

    def _add(self, x, y):
        return self.b.add(x, y, flags=list(self.flags))

    def _sub(self, x, y):
        return self.b.sub(x, y, flags=list(self.flags))

    def _mul(self, x, y):
        return self.b.mul(x, y, flags=list(self.flags))

    def _div(self, x, y):
        return self.b.sdiv(x, y)

    def _rem(self, x, y):
        return self.b.srem(x, y)

    def let(self, v):
        return self.i(v)

    def sym(self, name: str):
        return self.ctx.syms[name]


class CInts(Ints):
    """:class:`Ints` over ``int64_t`` C expressions; ``let`` names a value in ``ctx`` (a
    :class:`jitbyoc.render.c.Ctx`; none needed for arithmetic alone)."""

    def __init__(self, ctx=None):
        self.ctx = ctx

    def i(self, v) -> str:
        return f"INT64_C({v})" if isinstance(v, int) else v

    def _add(self, x, y):
        return f"({x} + {y})"

    def _sub(self, x, y):
        return f"({x} - {y})"

    def _mul(self, x, y):
        return f"({x} * {y})"

    def _div(self, x, y):
        return f"({x} / {y})"

    def _rem(self, x, y):
        return f"({x} % {y})"

    def let(self, v):
        return v if isinstance(v, int) else self.ctx.let("int64_t", v)

    def sym(self, name: str) -> str:
        return name  # a size is a C variable of its name


class Indexing:
    """Mixin for the renderers' ``Ctx``: the index methods kernels and engines call on a
    ctx (sizes: ints and symbolic names), through its :class:`Ints` ``self.ints`` and
    always answered in the renderer's values (a static result too)."""

    def dim(self, d):
        return self.ints.i(self.ints.dim(d))

    def product(self, dims):
        return self.ints.i(self.ints.product(dims))

    def unravel(self, flat, dims) -> list:
        """Row-major indices of ``flat`` in ``dims``, the outermost taken modulo its dim."""
        ints = self.ints
        return [ints.i(v) for v in unravel(ints, flat, [ints.dim(d) for d in dims], wrap=True)]

    def offset(self, shape, pos, broadcast=False):
        """Row-major offset of ``pos`` in ``shape``; with ``broadcast``, size-1 dims read 0."""
        return self.ints.i(offset(self.ints, shape, pos, broadcast))


def each_row(e, shape, body, threads: bool) -> None:
    """``body(e, row, pos)`` for each row of ``shape`` (an index of all dims but the last;
    ``pos``: its coordinates), rows split across the thread pool when ``threads``."""
    def run(e, lo, hi):
        with e.loop(hi, lo, "row") as r:
            body(e, r, unravel(e, r, [e.dim(d) for d in shape[:-1]]))
    e.parallel(e.product(shape[:-1]), run, threads)


def clamped(e, i, n):
    """``i`` clamped into ``[0, n)``, the nearest edge for one outside it."""
    return e.let(e.max(e.min(i, e.sub(n, 1)), 0))


def wrapped(e, raw, n):
    """An index in ``[0, n)``: negative ones count from the end, others wrap around. With
    ``n`` 0 (a symbolic axis empty at run time) it is 0 and must not be read: see
    ``where_nonempty``."""
    if not (isinstance(n, int) and n > 0):
        n = e.let(e.max(n, 1))
    return e.let(e.rem(e.add(e.rem(raw, n), n), n))


@contextmanager
def where_nonempty(e, n, out=None, dst=0, width=1, fill=0):
    """Runs its body where the indexed axis's size ``n`` is positive. At ``n`` 0 every index
    is out of range and nothing may be read or written; a gather then fills its ``width``
    results at ``out[dst:]`` with ``fill`` (TVM's own build reads out of bounds)."""
    with e.if_else(e.lt(0, n)) as (then, otherwise):
        with then:
            yield
        with otherwise:
            if out is not None:
                with e.loop(width, 0, "z") as z:
                    e.store(out, e.add(dst, z), e.const(fill, out.dtype))
