"""Gathers by index tensors: ``index_tensor``, ``gather_elements``, ``gather_nd`` and ``one_hot``.

``index_tensor`` is NumPy advanced indexing ``x[i0, i1, ...]`` with integer index tensors
that broadcast against each other; the result is their broadcast shape followed by the
dims of ``x`` they do not index. ``gather_elements`` reads, at every position of its
index tensor, ``x`` at that position with the ``axis`` coordinate replaced by the index
(ONNX GatherElements, ``torch.gather``). For both, negative indices count from the end
as NumPy's, and an index outside ``[-n, n)`` wraps around (TVM leaves it undefined).
``one_hot`` writes ``on`` where the index equals the position along the new ``axis`` and
``off`` elsewhere (TVM's semantics: a negative index matches nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.ir.prim import FloatImm, IntImm

from ..ir import kir
from ..ir.dtypes import ALL, HALF, INTS
from ..ir.relax_types import broadcast_problem, dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import dot, each_row, unravel, where_nonempty, wrapped
from ..render.loops import threaded
from ..render.portable import PortableStage


@dataclass(eq=False)
class IndexTensor(PortableStage, kir.KernelStage):
    """``inputs``: ``x``, then the index tensors."""

    def emit(self, e) -> None:
        x, *indices = self.inputs
        out, m = self.out, len(indices)
        lead = out.shape[:out.ndim - (x.ndim - m)]

        def body(e, lo, hi):
            width = e.product(x.shape[m:])
            with e.loop(hi, lo, "p") as p:
                pos = unravel(e, p, [e.dim(d) for d in lead])
                dst = e.let(e.mul(p, width))
                with where_nonempty(e, e.product(x.shape[:m]), out, dst, width):
                    src = 0
                    for j, ind in enumerate(indices):
                        strides = [0 if d == 1 else e.product(ind.shape[k + 1:])
                                   for k, d in enumerate(ind.shape)]
                        at = dot(e, pos[len(lead) - ind.ndim:], strides)
                        n = e.dim(x.shape[j])
                        src = e.add(e.mul(src, n), wrapped(e, e.let(e.index(e.load(ind, at), ind.dtype)), n))
                    src = e.let(e.mul(src, width))
                    with e.loop(width, 0, "j") as j:
                        e.copy(out, e.add(dst, j), x, e.add(src, j))
                if self.epilogue is not None:
                    rest = x.shape[m:]
                    e.epilogue(self, pos + [0] * len(rest), [1] * len(pos) + [e.dim(d) for d in rest])

        e.parallel(e.product(lead), body, threaded(out.shape, "copy"))

    @staticmethod
    def reference(x: np.ndarray, *indices: np.ndarray) -> np.ndarray:
        return x[tuple(indices)]


def _check(call) -> str | None:
    x, tup = call.args
    if not isinstance(tup, relax.Tuple) or not tup.fields:
        return "relax.index_tensor: the indices are not a literal tuple of tensors"
    problem = tensor_problem(x.ty, ALL) or tensor_problem(call.ty, ALL) or \
        next((p for p in (tensor_problem(i.ty, INTS) for i in tup.fields) if p), None)
    if problem:
        return f"relax.index_tensor: {problem}"
    xd, od, m = dims(x.ty), dims(call.ty), len(tup.fields)
    if m > len(xd) or 0 in xd:
        return "relax.index_tensor: more indices than dims, or an empty input"
    lead = od[:len(od) - (len(xd) - m)]
    problem = next((p for p in (broadcast_problem(dims(i.ty), lead) for i in tup.fields) if p), None)
    return f"relax.index_tensor: {problem}" if problem else None


@register("relax.index_tensor", 2, _check)
def _build(fe, call, out):
    return IndexTensor((fe.buffer(call.args[0]), *[fe.buffer(i) for i in call.args[1].fields]), out)


@dataclass(eq=False)
class GatherElements(PortableStage, kir.KernelStage):
    """``inputs``: ``x``, then the index tensor (of the result's shape)."""
    axis: int = 0

    def emit(self, e) -> None:
        x, ind = self.inputs
        out, axis = self.out, self.axis

        def row(e, r, pos):  # sized in its own function (a threaded body's: see ArgReduce.sizes)
            strides = [e.product(x.shape[k + 1:]) for k in range(x.ndim)]
            n, width = e.dim(x.shape[axis]), e.dim(out.shape[-1])
            with where_nonempty(e, n, out, e.let(e.mul(r, width)), width), e.loop(width, 0, "k") as k:
                at = e.let(e.add(e.mul(r, width), k))
                coords = pos + [k]
                coords[axis] = wrapped(e, e.index(e.load(ind, at), ind.dtype), n)
                e.copy(out, at, x, dot(e, coords, strides))
            if self.epilogue is not None:
                e.epilogue(self, pos + [0], [1] * len(pos) + [width])

        each_row(e, out.shape, row, threaded(out.shape, "copy"))

    @staticmethod
    def reference(x: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
        n = x.shape[axis]
        return np.take_along_axis(_fit(x, indices.shape, axis), (indices % n + n) % n, axis=axis)


def _fit(x: np.ndarray, shape, axis: int) -> np.ndarray:
    """``x`` cut to ``shape`` in every dim but ``axis`` (the index tensor may be smaller)."""
    return x[tuple(slice(None) if k == axis else slice(0, d) for k, d in enumerate(shape))]


def _check_gather_elements(call) -> str | None:
    x, ind = call.args
    problem = tensor_problem(x.ty, ALL) or tensor_problem(ind.ty, INTS) or tensor_problem(call.ty, ALL)
    if problem:
        return f"relax.gather_elements: {problem}"
    xd, idd = dims(x.ty), dims(ind.ty)
    if not xd or len(xd) != len(idd) or 0 in xd or 0 in idd:
        return "relax.gather_elements: index rank differs from the input's, or an empty tensor"
    axis = int(call.attrs.axis) % len(xd)
    if any(isinstance(a, int) and isinstance(b, int) and b > a for k, (a, b) in enumerate(zip(xd, idd)) if k != axis):
        return "relax.gather_elements: the index tensor is larger than the input off the axis"
    return None


@register("relax.gather_elements", 2, _check_gather_elements)
def _build_gather_elements(fe, call, out):
    x, ind = (fe.buffer(a) for a in call.args)
    return GatherElements((x, ind), out, axis=int(call.attrs.axis) % x.ndim)


@dataclass(eq=False)
class OneHot(PortableStage, kir.KernelStage):
    """``inputs``: the indices; ``on``/``off`` are the two values, ``axis`` the new dim."""
    on: float = 1.0
    off: float = 0.0
    axis: int = -1

    def emit(self, e) -> None:
        (ind,), out, axis = self.inputs, self.out, self.axis
        dt = out.dtype
        on, off = e.const(self.on, dt), e.const(self.off, dt)

        def row(e, r, pos):
            strides = [e.product(ind.shape[k + 1:]) for k in range(ind.ndim)]
            width = e.dim(out.shape[-1])
            with e.loop(width, 0, "k") as k:
                coords = pos + [k]
                at = dot(e, coords[:axis] + coords[axis + 1:], strides)
                hit = e.eq(e.index(e.load(ind, at), ind.dtype), coords[axis])
                e.store(out, e.add(e.mul(r, width), k), e.select(hit, on, off))
            if self.epilogue is not None:
                e.epilogue(self, pos + [0], [1] * len(pos) + [width])

        each_row(e, out.shape, row, threaded(out.shape, "copy"))

    @staticmethod
    def reference(indices: np.ndarray, on=1.0, off=0.0, depth: int = 1, axis: int = -1, dtype="float32"):
        hits = np.expand_dims(indices, axis) == np.arange(depth).reshape(
            [depth if k == axis % (indices.ndim + 1) else 1 for k in range(indices.ndim + 1)])
        return np.where(hits, on, off).astype(dtype)


def _check_one_hot(call) -> str | None:
    ind, on, off = call.args
    problem = tensor_problem(ind.ty, INTS) or tensor_problem(call.ty, ALL | HALF)  # literals: no bfloat16
    if problem:
        return f"relax.one_hot: {problem}"
    if not all(isinstance(v, (IntImm, FloatImm)) for v in (on, off)):
        return "relax.one_hot: on/off values are not constants"
    if 0 in dims(call.ty):
        return "relax.one_hot: empty result"
    return None


@register("relax.one_hot", 3, _check_one_hot)
def _build_one_hot(fe, call, out):
    _, on, off = call.args
    value = int if isinstance(on, IntImm) else float
    return OneHot((fe.buffer(call.args[0]),), out, on=value(on.value), off=value(off.value),
                  axis=int(call.attrs.axis) % out.ndim)


@dataclass(eq=False)
class GatherND(PortableStage, kir.KernelStage):
    """``inputs``: ``x`` and the indices ``(..., m)``; with ``batch_dims`` b the first b
    dims of both are a shared batch. Each index tuple selects the block of ``x`` after its
    b + m leading dims (ONNX GatherND)."""
    batch_dims: int = 0

    def emit(self, e) -> None:
        x, ind = self.inputs
        out, b, m = self.out, self.batch_dims, ind.shape[-1]
        lead = ind.shape[:-1]

        def body(e, lo, hi):
            strides = [e.product(x.shape[k + 1:]) for k in range(b + m)]
            width = e.product(x.shape[b + m:])
            with e.loop(hi, lo, "p") as p:
                batch = unravel(e, p, [e.dim(d) for d in lead])[:b]
                dst = e.let(e.mul(p, width))
                with where_nonempty(e, e.product(x.shape[b:b + m]), out, dst, width):
                    coords = [wrapped(e, e.index(e.load(ind, e.add(e.mul(p, m), k)), ind.dtype),
                                      e.dim(x.shape[b + k])) for k in range(m)]
                    src = e.let(dot(e, batch + coords, strides))
                    with e.loop(width, 0, "j") as j:
                        e.copy(out, e.add(dst, j), x, e.add(src, j))
                if self.epilogue is not None:
                    pos = unravel(e, p, [e.dim(d) for d in lead])
                    e.epilogue(self, pos + [0] * (out.ndim - len(lead)),
                               [1] * len(lead) + [e.dim(d) for d in out.shape[len(lead):]])

        e.parallel(e.product(lead), body, threaded(out.shape, "copy"))

    @staticmethod
    def reference(x: np.ndarray, indices: np.ndarray, batch_dims: int = 0) -> np.ndarray:
        b, m = batch_dims, indices.shape[-1]
        out = np.empty(indices.shape[:-1] + x.shape[b + m:], x.dtype)
        for pos in np.ndindex(*indices.shape[:-1]):
            at = tuple((int(i) % n + n) % n for i, n in zip(indices[pos], x.shape[b:]))
            out[pos] = x[pos[:b] + at]
        return out


def _check_gather_nd(call) -> str | None:
    x, ind = call.args
    problem = tensor_problem(x.ty, ALL) or tensor_problem(ind.ty, INTS) or tensor_problem(call.ty, ALL)
    if problem:
        return f"relax.gather_nd: {problem}"
    xd, idd, b = dims(x.ty), dims(ind.ty), int(call.attrs.batch_dims)
    if not idd or not isinstance(idd[-1], int) or not 1 <= idd[-1] <= len(xd) - b or 0 in xd + idd:
        return "relax.gather_nd: the index depth is not a static 1..rank, or an empty tensor"
    if xd[:b] != idd[:b]:
        return "relax.gather_nd: batch dims of data and indices differ"
    return None


@register("relax.gather_nd", 2, _check_gather_nd)
def _build_gather_nd(fe, call, out):
    return GatherND(tuple(fe.buffer(a) for a in call.args), out, batch_dims=int(call.attrs.batch_dims))
