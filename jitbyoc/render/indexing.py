"""Loop and index helpers for kernels written against the :mod:`.portable` facade.

They only call facade methods, so one helper serves both renderers: thread-pool
thresholds, row-major unravelling, dot products of indices and strides, folds
(reductions along a loop, of the kinds :mod:`jitbyoc.ir.folds` defines), and
:class:`Ints`, the integer layer both facades share.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..ir.folds import identity


def unravel(e, flat, extents) -> list:
    """Row-major indices of ``flat`` (assumed in range) in ``extents`` (facade values)."""
    out = []
    for k in range(len(extents) - 1, 0, -1):
        out.append(e.let(e.rem(flat, extents[k])))
        flat = e.let(e.div(flat, extents[k]))
    return ([flat] if extents else []) + out[::-1]


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
    """Integer arithmetic shared by both facades: static sizes stay Python ints and fold
    (so ``x + 0``, ``x * 1`` and products of static dims emit nothing); the rest goes to
    the renderer's ``_add``/``_sub``/``_mul``/``_div``/``_rem`` (C semantics: truncating)."""

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
        return d if isinstance(d, int) else self.ctx.dim(d)

    def product(self, dims):
        acc = 1
        for d in dims:
            acc = self.mul(acc, self.dim(d))
        return acc

    def as_float(self, v, dt: str):
        """An int64 count as a ``dt`` value (a constant when static)."""
        return self.const(v, dt) if isinstance(v, int) else self.op("astype", "int64", v, to=dt)


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
