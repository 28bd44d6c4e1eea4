"""Index-range copies: strided_slice, flip, split and take (embedding lookup); concat
and stack are :mod:`.concat`.

flip is a slice stepping back. strided_slice and each output of split are one
:class:`Slice` stage: every output row (all dims but the last) starts at a computed input
offset and reads with a fixed step, so unit-step slices copy contiguous runs. take
copies, for every index, the contiguous block of ``x`` after ``axis`` (a whole embedding
row when ``axis == 0``).

Out-of-range take indices, by ``mode`` (TVM's default build, checked by experiment):
``clip`` clamps to ``[0, n - 1]`` and ``wrap`` wraps Python-style (``-1`` is the last),
exactly as TVM does; ``nan`` yields NaN, as TVM does. ``fast`` (TVM's default) does no
check in TVM, so an out-of-range index reads outside the tensor (garbage or a crash);
jitbyoc clamps it like ``clip`` instead: identical for every in-range index, and never
out of bounds. All results are exact (elements are only moved).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.ir.prim import IntImm

from ..ir import kir
from ..ir.dtypes import ALL, FLOATS, INTS, STORED
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import clamped, dot, unravel, where_nonempty, wrapped
from ..render.loops import threaded
from ..render.portable import PortableStage

TAKE_MODES = ("fast", "clip", "wrap", "nan")


@dataclass(eq=False)
class Slice(PortableStage, kir.KernelStage):
    """``out[p] = x[begin + p * step]`` per dim (``begin``/``step`` hold one int per dim)."""
    begin: tuple = ()
    step: tuple = ()

    def emit(self, e) -> None:
        x, out = self.inputs[0], self.out
        rows = out.shape[:-1]

        def body(e, lo, hi):
            n = e.dim(out.shape[-1])
            strides = [e.product(x.shape[d + 1:]) for d in range(x.ndim)]
            first = e.let(dot(e, self.begin, strides))
            with e.loop(hi, lo, "row") as r:
                idx = unravel(e, r, [e.dim(d) for d in rows])
                src = e.let(e.add(first, dot(e, idx, [e.mul(s, t) for s, t in
                                                      zip(self.step, strides)])))
                dst = e.let(e.mul(r, n))
                with e.loop(n, 0, "k") as k:
                    e.copy(out, e.add(dst, k), x, e.add(src, e.mul(k, self.step[-1])))
                if self.epilogue is not None:
                    e.epilogue(self, idx + [0], [1] * len(idx) + [n])

        e.parallel(e.product(rows), body, threaded(out.shape, "copy"))

    @staticmethod
    def reference(x: np.ndarray, begin, step, shape) -> np.ndarray:
        return x[np.ix_(*[b + s * np.arange(n) for b, s, n in zip(begin, step, shape)])]


def _ints(expr) -> list[int] | None:
    """The static ints of a tuple/shape of PrimValues, or None."""
    values = getattr(expr, "fields", None) or getattr(expr, "values", None) or []
    out = []
    for v in values:
        v = v if isinstance(v, IntImm) else getattr(v, "value", None)  # IntImm or PrimValue
        if not isinstance(v, IntImm):
            return None
        out.append(int(v))
    return out


def _slice_plan(call):
    """(begin, step) per dim of ``x`` for a strided_slice, or a reason string. On a
    symbolic axis the slice must be declared in bounds (``assume_inbound``: the frontends'
    slices are, once :mod:`jitbyoc.tvm.prepare` proved them so), its begin a static
    non-negative int and its step positive; the result's (symbolic) length says how far
    to read, and ``end`` may be symbolic there."""
    x, axes, begin, end = call.args[:4]
    shape, out = dims(x.ty), dims(call.ty)
    axes, begin = _ints(axes), _ints(begin)
    steps = _ints(call.args[4]) if len(call.args) > 4 else [1] * len(axes or [])
    ends = _ints(end) or [None] * len(getattr(end, "fields", None) or getattr(end, "values", None) or [])
    if axes is None or begin is None or steps is None or len(ends) != len(axes):
        return "begin/strides are not static integers"
    first, step = [0] * len(shape), [1] * len(shape)
    for a, b, e, s in zip(axes, begin, ends, steps):
        a %= len(shape)
        if isinstance(shape[a], int) and isinstance(out[a], int) and e is not None and s != 0:
            rng = range(*slice(b, e, s).indices(shape[a]))
            if len(rng) != out[a]:
                return f"axis {a}: cannot reproduce TVM's result length {out[a]}"
            first[a], step[a] = (rng.start if len(rng) else 0), s
        elif not call.attrs.assume_inbound:  # TVM clamps: FuseOpsByPattern fails on the
            # if_then_else that clamping a compound dim puts in the composite's types
            return f"axis {a} is symbolic (or its end is) and the slice may run out of bounds"
        elif b >= 0 and s > 0:
            first[a], step[a] = b, s
        else:
            return f"axis {a} is symbolic (or its end is) and the slice starts from its end or steps back"
    return tuple(first), tuple(step)


def _check_slice(call) -> str | None:
    for ty in (call.args[0].ty, call.ty):
        problem = tensor_problem(ty, STORED)
        if problem:
            return f"relax.strided_slice: {problem}"
    if not dims(call.ty):
        return "relax.strided_slice: rank-0 input"
    if 0 in dims(call.ty):
        return "relax.strided_slice: empty result"
    plan = _slice_plan(call)
    return f"relax.strided_slice: {plan}" if isinstance(plan, str) else None


@register("relax.strided_slice", 4, _check_slice)
def _build_slice(fe, call, out):
    begin, step = _slice_plan(call)
    return Slice((fe.buffer(call.args[0]),), out, begin=begin, step=step)


def _check_split(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, STORED)
    if problem:
        return f"relax.split: {problem}"
    if not isinstance(call.ty, relax.TupleType):
        return "relax.split: result is not a tuple"
    axis = int(call.attrs.axis) % max(len(dims(x.ty)), 1)
    for t in call.ty.fields:
        problem = tensor_problem(t, STORED)
        if problem:
            return f"relax.split result: {problem}"
        if not isinstance(dims(t)[axis], int) or dims(t)[axis] == 0:
            return "relax.split: sections along the split axis are symbolic or empty"
    return None


@register("relax.split", 1, _check_split)
def _build_split(fe, call, out):
    x = fe.buffer(call.args[0])
    axis = int(call.attrs.axis) % x.ndim
    stages, at = [], 0
    for o in out:
        begin = tuple(at if d == axis else 0 for d in range(x.ndim))
        stages.append(Slice((x,), o, begin=begin, step=(1,) * x.ndim))
        at += o.shape[axis]
    return stages


@dataclass(eq=False)
class Take(PortableStage, kir.KernelStage):
    """``out = take(inputs[0], inputs[1], axis, mode)``: for every outer index and every
    index ``i`` in ``inputs[1]``, the block ``x[outer, i, ...]``. Out-of-range indices are
    clamped (never read out of bounds), and in mode "fast" an index from -n to -1 counts
    from the end, as in PyTorch: TVM's torch frontend turns ``x[:, idx]`` into a "fast"
    take of the raw indices (Falcon's multi-query attention takes index -1), where TVM's
    own build reads out of bounds."""
    axis: int = 0
    mode: str = "fast"

    def emit(self, e) -> None:
        (x, ind), out = self.inputs, self.out
        outer = x.shape[:self.axis]

        def body(e, lo, hi):
            n = e.dim(x.shape[self.axis])
            width, count = e.product(x.shape[self.axis + 1:]), e.product(ind.shape)
            with e.loop(hi, lo, "row") as r:
                o, k = e.let(e.div(r, count)), e.let(e.rem(r, count))
                dst = e.let(e.mul(r, width))
                fill = float("nan") if self.mode == "nan" else 0
                with where_nonempty(e, n, out, dst, width, fill):
                    self._copy_block(e, e.let(e.index(e.load(ind, k), ind.dtype)), o, n, width, dst)
                if self.epilogue is not None:
                    pos = unravel(e, o, [e.dim(d) for d in outer]) + \
                        unravel(e, k, [e.dim(d) for d in ind.shape])
                    rest = x.shape[self.axis + 1:]
                    e.epilogue(self, pos + [0] * len(rest),
                               [1] * len(pos) + [e.dim(d) for d in rest])

        e.parallel(e.mul(e.product(outer), e.product(ind.shape)), body,
                   threaded(out.shape, "copy"))

    def _copy_block(self, e, raw, o, n, width, dst) -> None:
        """``out[dst:dst + width]`` from block ``raw`` (of ``n``) of outer index ``o``."""
        x, i = self.inputs[0], raw
        if self.mode == "wrap":
            i = wrapped(e, i, n)
        elif self.mode == "fast":  # an index from -n counts from the end (see class doc)
            i = e.let(e.select(e.lt(i, 0), e.add(i, n), i))
        i = clamped(e, i, n)
        src = e.let(e.mul(e.add(e.mul(o, n), i), width))
        with e.loop(width, 0, "j") as j:
            if self.mode == "nan":
                v = e.select(e.eq(i, raw), e.load(x, e.add(src, j)),
                             e.const(float("nan"), x.dtype))
                e.store(self.out, e.add(dst, j), v)
            else:
                e.copy(self.out, e.add(dst, j), x, e.add(src, j))

    @staticmethod
    def reference(x: np.ndarray, indices: np.ndarray, axis: int = 0, mode: str = "fast"):
        n = x.shape[axis]
        if mode == "fast":
            indices = np.where(indices < 0, indices + n, indices)
        i = np.mod(indices, n) if mode == "wrap" else np.clip(indices, 0, n - 1)
        out = np.take(x, i, axis=axis)
        if mode == "nan":
            bad = (indices < 0) | (indices >= n)
            mask = bad.reshape((1,) * axis + bad.shape + (1,) * (x.ndim - axis - 1))
            out = np.where(mask, np.array(np.nan, x.dtype), out)
        return out


def _check_take(call) -> str | None:
    x, ind = call.args
    mode = str(call.attrs.mode)
    problem = tensor_problem(x.ty, FLOATS if mode == "nan" else STORED) or \
        tensor_problem(ind.ty, INTS) or tensor_problem(call.ty, STORED)
    if problem:
        return f"relax.take: {problem}"
    if mode not in TAKE_MODES:
        return f"relax.take: mode {mode!r} (supported: {list(TAKE_MODES)})"
    if not dims(x.ty) or (call.attrs.axis is None and len(dims(x.ty)) != 1):
        return "relax.take: axis=None needs a 1-D input"
    if 0 in dims(x.ty) or 0 in dims(call.ty):
        return "relax.take: empty input or result"
    return None


@register("relax.take", 2, _check_take)
def _build_take(fe, call, out):
    mode, shape = str(call.attrs.mode), dims(call.args[0].ty)
    if len(shape) == 1 and isinstance(shape[0], int) and (mode in ("clip", "fast") or _wraps_by_mask(mode, shape[0])):
        return _looked_up(fe, call, shape[0], mode)
    x, ind = fe.buffer(call.args[0]), fe.buffer(call.args[1])
    axis = 0 if call.attrs.axis is None else int(call.attrs.axis) % x.ndim
    return Take((x, ind), out, axis=axis, mode=str(call.attrs.mode))


def _looked_up(fe, call, n: int, mode: str):
    """A take from a 1-D table of static length ``n``: a :class:`~jitbyoc.ir.kir.Lookup`,
    an elementwise value that fuses into the loops and epilogues around it (a byte
    function as a table: :mod:`jitbyoc.tvm.tables`), the index clamped as :class:`Take`
    clamps it. An index type that cannot hold ``n`` (int8 indices into a table of 512)
    is widened first, or the bounds below would wrap."""
    index = fe.value(call.args[1])
    dt = index.dtype
    if n > np.iinfo(dt).max:
        index, dt = kir.Op("astype", (index,), dt, "int64", (("to", "int64"),)), "int64"

    def op(name, *args, out=dt):
        return kir.Op(name, args, dt, out)

    if _wraps_by_mask(mode, n):  # Python's i % n, in two's complement
        return kir.Lookup(fe.table(call.args[0]), op("bitand", index, kir.Const(n - 1, dt)))
    if mode == "fast":  # from -n, an index counts from the end
        negative = op("less", index, kir.Const(0, dt), out="bool")
        index = kir.Op("where", (negative, op("add", index, kir.Const(n, dt)), index), dt, dt)
    clamped = op("maximum", op("minimum", index, kir.Const(n - 1, dt)), kir.Const(0, dt))
    return kir.Lookup(fe.table(call.args[0]), clamped, _rows(index) if mode == "clip" else ())


# integer types that hold a uint8's 0..255; base + byte cannot wrap where a renderer reads
# one row (0 <= base <= n - 256, and n fits the index type: _looked_up widens it otherwise)
WIDER = ("int16", "int32", "int64", "uint16", "uint32", "uint64")


def _rows(index) -> tuple:
    """``(byte, base)`` when ``index`` is ``base + byte``, ``byte`` a uint8 widened (a
    table of a byte per channel, :mod:`jitbyoc.tvm.channel_tables`): see
    :attr:`~jitbyoc.ir.kir.Lookup.rows`."""
    if not (isinstance(index, kir.Op) and index.op == "add"):
        return ()
    for byte, base in (index.args, index.args[::-1]):
        if isinstance(byte, kir.Op) and byte.op == "astype" and byte.in_dtype == "uint8" and byte.dtype in WIDER:
            return byte, base
    return ()


def _wraps_by_mask(mode: str, n: int) -> bool:
    """Whether a ``wrap`` take from ``n`` entries is a mask of the index's low bits (``n``
    a power of two): a lookup of a nibble's value (:mod:`jitbyoc.tvm.weights`'s int4)."""
    return mode == "wrap" and n & (n - 1) == 0


def _check_flip(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, ALL)
    if problem:
        return f"relax.flip: {problem}"
    shape = dims(x.ty)
    if not shape:
        return "relax.flip: rank-0 input"
    n = shape[int(call.attrs.axis) % len(shape)]
    if not isinstance(n, int) or n == 0:
        return f"relax.flip: the flipped dim {n} is symbolic or empty"
    return None


@register("relax.flip", 1, _check_flip)
def _build_flip(fe, call, out):
    """A slice that starts at the last index of ``axis`` and steps back."""
    x = fe.buffer(call.args[0])
    axis = int(call.attrs.axis) % x.ndim
    begin, step = [0] * x.ndim, [1] * x.ndim
    begin[axis], step[axis] = x.shape[axis] - 1, -1
    return Slice((x,), out, begin=tuple(begin), step=tuple(step))
