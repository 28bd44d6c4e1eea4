"""Loop and index helpers for kernels written against the :mod:`.portable` facade.

They only call facade methods, so one helper serves both renderers: thread-pool
thresholds, row-major unravelling, dot products of indices and strides, and folds
(reductions along a loop) with their identities.
"""

from __future__ import annotations

from ..dtypes import dtype as lookup_dtype

IDENTITY = {"sum": 0, "prod": 1, "max": float("-inf"), "min": float("inf")}
PARALLEL_MIN_ELEMENTS = 1 << 15  # below this a stage runs on the calling thread
# Pure copies are bound by memory bandwidth, not arithmetic: measured on 2 cores, a thread
# pool gains nothing below a few MiB and a launch costs more than a copy that fits in L2.
COPY_MIN_ELEMENTS = 1 << 18


def threaded(shape, minimum: int | None = None) -> bool:
    """Whether work over ``shape`` is worth TVM's thread pool (symbolic: assume so)."""
    static = 1
    for d in shape:
        if isinstance(d, str):
            return True
        static *= d
    return static >= (PARALLEL_MIN_ELEMENTS if minimum is None else minimum)


def unravel(e, flat, extents) -> list:
    """Row-major indices of ``flat`` (assumed in range) in ``extents`` (facade values)."""
    out = []
    for k in range(len(extents) - 1, 0, -1):
        out.append(e.let(e.rem(flat, extents[k])))
        flat = e.let(e.div(flat, extents[k]))
    return ([flat] if extents else []) + out[::-1]


def fold(e, kind: str, dt: str, count, value, start=0):
    """``value(k)`` for k in [start, count) combined by ``kind`` (see :data:`IDENTITY`)."""
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


def identity(kind: str, dt: str):
    """The value a ``kind`` reduction starts from (the dtype's extreme for integer max/min)."""
    d = lookup_dtype(dt)
    if d.is_float or kind in ("sum", "prod"):
        return IDENTITY[kind]
    return -(1 << (d.bits - 1)) if kind == "max" else (1 << (d.bits - 1)) - 1
