"""``scatter_elements`` and ``scatter_nd``.

``scatter_elements``: a copy of ``data`` into which ``updates`` are written (or combined
with ``reduction``) at the positions ``indices`` name along ``axis`` (ONNX ScatterElements,
``torch.scatter``).

Done as TVM's ``topi.scatter_elements`` does it: the copy, then, for every position off
the axis (in parallel: they write disjoint columns), the indices along the axis in order,
so a repeated index leaves the last update ("update") or folds them all in order. A
negative index counts from the end; one outside ``[-n, n)`` wraps (TVM's is undefined).
``scatter_nd`` (ONNX ScatterND): see :class:`ScatterND`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import ALL, FLOATS, INTS, NUMERIC
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import dot, unravel, where_nonempty, wrapped
from ..render.loops import threaded
from ..render.portable import PortableStage

# reduction -> (the row that folds an update into the element, the dtypes it takes)
REDUCTIONS = {"update": (None, ALL), "add": ("add", NUMERIC), "mul": ("multiply", NUMERIC),
              "min": ("minimum", NUMERIC), "max": ("maximum", NUMERIC), "mean": ("add", FLOATS)}


def _fold(stage, e, dst, src) -> None:
    """``out[dst]`` = the update ``updates[src]`` folded into it by the stage's reduction."""
    out, upd = stage.out, stage.inputs[2]
    row = REDUCTIONS[stage.reduction][0]
    if row is None:
        e.copy(out, dst, upd, src)
        return
    dt = out.dtype
    value = e.op(row, dt, e.load(out, dst), e.load(upd, src))
    if stage.reduction == "mean":
        value = e.op("divide", dt, value, e.const(2, dt))
    e.store(out, dst, value)


@dataclass(eq=False)
class ScatterElements(PortableStage, kir.KernelStage):
    """``inputs``: ``data``, ``indices``, ``updates`` (``indices``' shape)."""
    axis: int = 0
    reduction: str = "update"

    def emit(self, e) -> None:
        data, ind, _ = self.inputs
        out, a = self.out, self.axis

        def copy(e, lo, hi):
            with e.loop(hi, lo, "p") as p:
                e.copy(out, p, data, p)

        e.parallel(e.product(out.shape), copy, threaded(out.shape, "copy"))

        def sizes(e):  # in the threaded body's own function too (see ArgReduce.sizes)
            return e.dim(out.shape[a]), e.dim(ind.shape[a]), e.product(ind.shape[a + 1:])

        def scatter(e, lo, hi):
            n_out, n_ind, after = sizes(e)
            with e.loop(hi, lo, "t") as t:
                i, j = e.let(e.div(t, after)), e.let(e.rem(t, after))
                first_in = e.let(e.add(e.mul(i, e.mul(n_ind, after)), j))
                first_out = e.let(e.add(e.mul(i, e.mul(n_out, after)), j))
                with where_nonempty(e, n_out), e.loop(n_ind, 0, "k") as k:
                    src = e.let(e.add(first_in, e.mul(k, after)))
                    at = wrapped(e, e.index(e.load(ind, src), ind.dtype), n_out)
                    _fold(self, e, e.let(e.add(first_out, e.mul(at, after))), src)

        e.parallel(e.mul(e.product(ind.shape[:a]), sizes(e)[2]), scatter, threaded(ind.shape, "copy"))
        if self.epilogue is not None:
            with e.loop(e.product(out.shape), 0, "q") as q:
                e.epilogue(self, unravel(e, q, [e.dim(d) for d in out.shape]), [1] * out.ndim)

    @staticmethod
    def reference(data, indices, updates, axis: int = 0, reduction: str = "update") -> np.ndarray:
        out = data.copy()
        n = data.shape[axis]
        fold = {"update": lambda x, u: u, "add": lambda x, u: x + u, "mul": lambda x, u: x * u,
                "min": min, "max": max, "mean": lambda x, u: (x + u) / 2}[reduction]
        # TVM's order: along the axis innermost
        order = sorted(np.ndindex(*indices.shape), key=lambda p: p[:axis] + p[axis + 1:] + (p[axis],))
        with np.errstate(over="ignore"):  # integer products wrap, as in C
            for pos in order:
                dst = pos[:axis] + ((int(indices[pos]) % n + n) % n,) + pos[axis + 1:]
                out[dst] = fold(out[dst], updates[pos])
        return out


def _check(call) -> str | None:
    data, ind, upd = call.args
    reduction = str(call.attrs.reduction)
    if reduction not in REDUCTIONS:
        return f"relax.scatter_elements: reduction {reduction!r} is left to TVM"
    allowed = REDUCTIONS[reduction][1]
    problem = tensor_problem(data.ty, allowed) or tensor_problem(ind.ty, INTS) or \
        tensor_problem(upd.ty, allowed) or tensor_problem(call.ty, allowed)
    if problem:
        return f"relax.scatter_elements: {problem}"
    dd, idd, ud = dims(data.ty), dims(ind.ty), dims(upd.ty)
    if not dd or idd != ud or len(dd) != len(idd) or 0 in dd or 0 in idd or str(upd.ty.dtype) != str(data.ty.dtype):
        return "relax.scatter_elements: indices and updates differ in shape or rank from each other or data"
    axis = int(call.attrs.axis) % len(dd)
    if [d for k, d in enumerate(dd) if k != axis] != [d for k, d in enumerate(idd) if k != axis]:
        return "relax.scatter_elements: indices differ from data off the axis (TVM assumes they do not)"
    return None


@register("relax.scatter_elements", 3, _check)
def _build(fe, call, out):
    data, ind, upd = (fe.buffer(a) for a in call.args)
    return ScatterElements((data, ind, upd), out, axis=int(call.attrs.axis) % data.ndim,
                           reduction=str(call.attrs.reduction))


@dataclass(eq=False)
class ScatterND(PortableStage, kir.KernelStage):
    """``inputs``: ``data``, ``indices`` (``(..., m)``: ``m`` leading coordinates of
    ``data`` per update), ``updates`` (``indices.shape[:-1] + data.shape[m:]``). The
    updates go in order, one after another (a repeated index: the last one, or all of
    them folded), each block of ``data.shape[m:]`` in parallel, as in TVM's scatter_nd."""
    reduction: str = "update"

    def emit(self, e) -> None:
        data, ind, _ = self.inputs
        out, m = self.out, ind.shape[-1]
        strides = [e.product(out.shape[k + 1:]) for k in range(m)]
        width = e.product(out.shape[m:])

        def copy(e, lo, hi):
            with e.loop(hi, lo, "p") as p:
                e.copy(out, p, data, p)

        e.parallel(e.product(out.shape), copy, threaded(out.shape, "copy"))
        with where_nonempty(e, e.product(out.shape[:m])), \
                e.loop(e.product(ind.shape[:-1]), 0, "u") as u:
            coords = [wrapped(e, e.index(e.load(ind, e.add(e.mul(u, m), k)), ind.dtype),
                              e.dim(out.shape[k])) for k in range(m)]
            dst, src = e.let(dot(e, coords, strides)), e.let(e.mul(u, width))
            with e.loop(width, 0, "j") as j:
                _fold(self, e, e.add(dst, j), e.add(src, j))
        if self.epilogue is not None:
            with e.loop(e.product(out.shape), 0, "q") as q:
                e.epilogue(self, unravel(e, q, [e.dim(d) for d in out.shape]), [1] * out.ndim)

    @staticmethod
    def reference(data, indices, updates, reduction: str = "update") -> np.ndarray:
        out, m = data.copy(), indices.shape[-1]
        fold = {"update": lambda x, u: u, "add": np.add, "mul": np.multiply, "min": np.minimum,
                "max": np.maximum}[reduction]
        flat_i, flat_u = indices.reshape(-1, m), updates.reshape((-1,) + data.shape[m:])
        with np.errstate(over="ignore"):
            for idx, u in zip(flat_i, flat_u):
                at = tuple((int(i) % n + n) % n for i, n in zip(idx, data.shape))
                out[at] = fold(out[at], u)
        return out


def _check_nd(call) -> str | None:
    data, ind, upd = call.args
    reduction = str(call.attrs.reduction)
    if reduction not in REDUCTIONS or reduction == "mean":
        return f"relax.scatter_nd: reduction {reduction!r} is left to TVM"
    allowed = REDUCTIONS[reduction][1]
    problem = tensor_problem(data.ty, allowed) or tensor_problem(ind.ty, INTS) or tensor_problem(upd.ty, allowed)
    if problem:
        return f"relax.scatter_nd: {problem}"
    dd, idd, ud = dims(data.ty), dims(ind.ty), dims(upd.ty)
    if not dd or not idd or not isinstance(idd[-1], int) or not 1 <= idd[-1] <= len(dd) or 0 in dd + idd:
        return "relax.scatter_nd: the index depth is not a static 1..rank, or an empty tensor"
    if ud != idd[:-1] + dd[idd[-1]:] or str(upd.ty.dtype) != str(data.ty.dtype):
        return "relax.scatter_nd: updates do not have indices.shape[:-1] + data.shape[m:]"
    return None


@register("relax.scatter_nd", 3, _check_nd)
def _build_nd(fe, call, out):
    return ScatterND(tuple(fe.buffer(a) for a in call.args), out, reduction=str(call.attrs.reduction))
