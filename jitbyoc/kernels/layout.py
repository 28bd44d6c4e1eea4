"""Layout ops: reshape and friends as views, broadcasts and fills as values, permute_dims
as a tiled transpose (concat, split and slices are in :mod:`.slicing`).

reshape, flatten, expand_dims and squeeze move no data: the result is a *view* of its
operand's storage (:func:`jitbyoc.ir.kir.view`). An operand that is still an unmaterialized
elementwise expression whose loads all have the operand's own shape is re-indexed instead
(each load becomes a load of a view), so ``add -> reshape -> multiply`` stays one loop nest.
broadcast_to, full_like, zeros_like and ones_like are values too: loads broadcast wherever
they are evaluated, so nothing is materialized unless a kernel needs the full tensor.

permute_dims merges output dims that stay adjacent in the input, then either copies rows
(the innermost dim is unmoved: contiguous reads and writes) or transposes ``TILE x TILE``
tiles of the two dims that are innermost in the input and in the output, so every cache
line read or written is used whole while it is hot. Tiles/rows run on TVM's thread pool.

All of these only move elements, so results are exact for every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.ir.expr import Var as SizeVar
from tvm.ir.prim import IntImm

from ..ir import kir
from ..ir.dtypes import ALL, STORED
from ..ir.relax_types import broadcast_problem, dim, dims, same_element_count, tensor_problem
from ..ir.rules import register
from ..render.indexing import div_ceil, dot, product, unravel
from ..render.loops import threaded
from ..render.portable import PortableStage

TILE = 32


def _stride(e, shape, axis):
    return e.product(shape[axis + 1:])


# ---- views ---------------------------------------------------------------------------------------

def reshaped(fe, arg, shape):
    """The value of Relax expression ``arg`` under ``shape`` (same element count), no copy."""
    node = fe.value(arg)
    own = tuple(dims(arg.ty))
    loads = [n for n in kir.walk([node]) if isinstance(n, kir.Load)]
    if all(n.buf.shape == own for n in loads):  # no broadcasting: flat indices line up
        return kir.substitute(node, {n: kir.Load(kir.view(n.buf, shape)) for n in loads})
    return kir.Load(kir.view(fe.buffer(arg), shape))


def _check_view(call) -> str | None:
    x = call.args[0]
    for what, ty in (("input", x.ty), ("result", call.ty)):
        problem = tensor_problem(ty, STORED)
        if problem:
            return f"{call.op.name} {what}: {problem}"
    if any(isinstance(d, SizeVar) and dim(d) not in dims(x.ty) for d in call.ty.shape.values):
        # sizes a match_cast made at run time (ONNX Unsqueeze/Squeeze with axes as an
        # input): the element count is the frontend's to keep, as in TVM's build, which
        # also copies by flat index. Only the region's arguments can show such sizes: a
        # region that does not output the result fails to lower, and the op stays with TVM.
        return None
    if not same_element_count(x.ty, call.ty):
        return f"{call.op.name}: cannot prove that {x.ty.shape} and {call.ty.shape} hold as many elements"
    return None


def _build_view(fe, call, out):
    return reshaped(fe, call.args[0], out.shape)


for _name, _arity in (("relax.reshape", 2), ("relax.flatten", 1), ("relax.expand_dims", 1),
                      ("relax.squeeze", 1)):
    register(_name, _arity, _check_view)(_build_view)


# ---- broadcasts and fills: values that broadcast where they are used --------------------------

def _check_broadcast(call) -> str | None:
    name, x = call.op.name, call.args[0]
    problem = tensor_problem(x.ty, ALL) or tensor_problem(call.ty, ALL)
    if problem:
        return f"{name}: {problem}"
    if name == "relax.full_like":
        problem = tensor_problem(call.args[1].ty, ALL)
        if problem or dims(call.args[1].ty):
            return f"{name}: the fill value is not a scalar tensor ({problem or 'rank > 0'})"
    if name == "relax.broadcast_to":
        # a size the input lacks ((1, 1, 64) -> (n, 1, 64): ViT's class token for a dynamic
        # batch) is fine where another argument of the region shows it (the concat with the
        # patches); a region without one fails to lower, and the op stays with TVM
        problem = broadcast_problem(dims(x.ty), dims(call.ty))
        if problem:  # the user's sizes (n, 16 * n), not jitbyoc's names for them
            shown = ", ".join(str(v.value) if isinstance(v, IntImm) else str(v) for v in call.ty.shape.values)
            return f"{name}: {problem} (target shape ({shown}))"
    return None


@register("relax.broadcast_to", 2, _check_broadcast)
def _build_broadcast(fe, call, out):
    # a load broadcasts NumPy-style against whatever shape it is evaluated at, and
    # fe.buffer() materializes the full shape only for a kernel that needs it
    return fe.value(call.args[0])


def _build_fill(fe, call, out):
    dt = out.dtype
    if call.op.name == "relax.full_like":
        fill = fe.value(call.args[1])
        if fill.dtype == dt:
            return fill
        return kir.Op("astype", (fill,), fill.dtype, dt, (("to", dt),))
    return kir.Const(0 if call.op.name == "relax.zeros_like" else 1, dt)


register("relax.full_like", 2, _check_broadcast)(_build_fill)
register("relax.zeros_like", 1, _check_broadcast)(_build_fill)
register("relax.ones_like", 1, _check_broadcast)(_build_fill)


# ---- permute_dims ---------------------------------------------------------------------------------

@dataclass(eq=False)
class Permute(PortableStage, kir.KernelStage):
    """``out = permute_dims(x, axes)`` of the window of ``x = inputs[0]`` that starts at
    ``begin`` (one int per input dim; empty: at 0) and spans ``out``'s sizes: output dim
    ``j`` is input dim ``axes[j]``, ``out[i] = x[begin + scatter(i, axes)]``. The window's
    innermost input dim of more than one element is read whole (:mod:`.fold_slices`
    makes windows so: a slice of a permute's result).

    Kernel passes may recognise this stage by its class and fields (``inputs == (x,)``,
    ``axes``, no ``begin``) and fold it into a consumer's indexing."""
    axes: tuple = ()
    begin: tuple = ()

    def extents(self) -> list:
        """Per input dim, how many of its elements the window spans."""
        ext = [1] * self.inputs[0].ndim
        for j, a in enumerate(self.axes):
            ext[a] = self.out.shape[j]
        return ext

    def groups(self) -> list[list[int]]:
        """Output dims in runs that are also adjacent, in order, in the input. Without an
        epilogue dims of one element drop out and runs are merged (bigger rows and tiles);
        with one every dim stands alone, so each row or tile is a box of ``out`` for
        ``ctx.epilogue``. A dim joins a run only where the window spans it whole."""
        merge = self.epilogue is None
        shape, ext = self.inputs[0].shape, self.extents()
        real = [j for j, a in enumerate(self.axes) if not (merge and ext[a] == 1)] or [len(self.axes) - 1]

        def after(a):  # the input dim that follows a in memory, dims of size 1 skipped
            a += 1
            while a < len(shape) and merge and shape[a] == 1:
                a += 1
            return a

        out: list[list[int]] = []
        for j in real:
            a = self.axes[j]
            if merge and out and after(self.axes[out[-1][-1]]) == a and ext[a] == shape[a]:
                out[-1].append(j)
            else:
                out.append([j])
        return out

    def start(self, e):
        """The window's first element, a flat index of the input (facade value)."""
        x = self.inputs[0]
        if not any(self.begin):
            return 0
        return dot(e, list(self.begin), [_stride(e, x.shape, a) for a in range(x.ndim)])

    def plan(self, e, groups):
        """Extent, input stride and output stride of each group (facade values)."""
        x, out = self.inputs[0], self.out
        return ([e.product([out.shape[j] for j in g]) for g in groups],
                [_stride(e, x.shape, self.axes[g[-1]]) for g in groups],
                [_stride(e, out.shape, g[-1]) for g in groups])

    def work(self) -> str:
        """The thread pool's bound (:data:`~jitbyoc.render.loops.THREAD_MIN`): a pure copy's,
        or an elementwise nest's where each element is also cast."""
        return "copy" if self.moves_bytes() else "elementwise"

    def needs_loop_vectorizer(self) -> bool:
        # tiles are transposed as vectors; rows are memcpy calls; edge tiles gather; rows
        # that also cast (:mod:`.fold_slices`) are loops to vectorize
        return not self.moves_bytes()

    def emit(self, e) -> None:
        groups = self.groups()
        inner = max(self.axes[g[-1]] for g in groups)  # the input's innermost dim left
        last_in = next(k for k, g in enumerate(groups) if self.axes[g[-1]] == inner)
        if last_in == len(groups) - 1:
            self._rows(e, groups)
        else:
            self._tiles(e, groups, last_in)

    def _rows(self, e, groups) -> None:
        """The innermost dim is unmoved: copy whole contiguous rows."""
        x, out = self.inputs[0], self.out

        def body(e, lo, hi):
            ext, ins, _ = self.plan(e, groups)
            n, outer = ext[-1], ext[:-1]
            with e.loop(hi, lo, "row") as r:
                idx = unravel(e, r, outer)
                src, dst = e.let(e.add(self.start(e), dot(e, idx, ins))), e.let(e.mul(r, n))
                if self.moves_bytes():
                    e.copy_run(out, dst, x, src, n)
                else:
                    with e.loop(n, 0, "k") as k:
                        e.copy(out, e.add(dst, k), x, e.add(src, k))
                if self.epilogue is not None:  # groups are single dims here
                    e.epilogue(self, idx + [0], [1] * len(idx) + [e.dim(out.shape[-1])])

        e.parallel(product(e, self.plan(e, groups)[0][:-1]), body,
                   threaded(out.shape, self.work()))

    def _tiles(self, e, groups, b) -> None:
        """Transpose TILE x TILE tiles of group ``a`` (innermost in ``out``) and group
        ``b`` (innermost in the input), for every index of the other groups."""
        out = self.out
        a = len(groups) - 1
        batch = [k for k in range(len(groups)) if k not in (a, b)]

        def tiling(e):
            ext, ins, outs = self.plan(e, groups)
            na, nb = (e.let(div_ceil(e, ext[k], TILE)) for k in (a, b))
            return ext, ins, outs, na, nb

        def body(e, lo, hi):
            ext, ins, outs, na, nb = tiling(e)
            with e.loop(hi, lo, "tile") as t:
                ia, rest = e.let(e.rem(t, na)), e.let(e.div(t, na))
                ib, bi = e.let(e.rem(rest, nb)), e.let(e.div(rest, nb))
                bidx = unravel(e, bi, [ext[k] for k in batch])
                src0 = e.let(e.add(self.start(e), dot(e, bidx, [ins[k] for k in batch])))
                dst0 = e.let(dot(e, bidx, [outs[k] for k in batch]))
                a0, b0 = e.let(e.mul(ia, TILE)), e.let(e.mul(ib, TILE))
                a1, b1 = e.let(e.min(e.add(a0, TILE), ext[a])), e.let(e.min(e.add(b0, TILE), ext[b]))
                edge = e.lt(e.min(e.sub(ext[a], a0), e.sub(ext[b], b0)), TILE)
                with e.if_else(edge) as (partial, full):
                    with partial:
                        self._tile_elements(e, src0, dst0, a0, a1, b0, b1, ins[a], outs[b])
                    with full:
                        self._tile_blocks(e, src0, dst0, a0, b0, ins[a], outs[b])
                if self.epilogue is not None:  # groups are single dims here
                    pos, size = [0] * out.ndim, [1] * out.ndim
                    for k, i in zip(batch, bidx):
                        pos[groups[k][0]] = i
                    pos[groups[a][0]], size[groups[a][0]] = a0, e.sub(a1, a0)
                    pos[groups[b][0]], size[groups[b][0]] = b0, e.sub(b1, b0)
                    e.epilogue(self, pos, size)

        ext, _, _, na, nb = tiling(e)
        e.parallel(e.mul(product(e, [ext[k] for k in batch]), e.mul(na, nb)), body,
                   threaded(out.shape, self.work()))

    def _tile_elements(self, e, src0, dst0, a0, a1, b0, b1, in_a, out_b) -> None:
        """An edge tile, element by element: contiguous writes, strided reads."""
        x, out = self.inputs[0], self.out
        with e.loop(b1, b0, "jb") as jb:
            s, d = e.let(e.add(src0, jb)), e.let(e.add(dst0, e.mul(jb, out_b)))
            with e.loop(a1, a0, "ja") as ja:
                e.copy(out, e.add(d, ja), x, e.add(s, e.mul(ja, in_a)))

    def _tile_blocks(self, e, src0, dst0, a0, b0, in_a, out_b) -> None:
        """A whole tile as 8x8 blocks transposed in registers (rows in, rows out), four
        at a time so that every 64-byte line read or written is used whole at once (rows
        a power-of-two apart share cache sets and would not survive to a second visit)."""
        x, out = self.inputs[0], self.out
        with e.loop(TILE // 16, 0, "kb") as kb, e.loop(TILE // 16, 0, "ka") as ka:
            for db, da in ((0, 0), (0, 8), (8, 0), (8, 8)):
                jb = e.let(e.add(b0, e.add(e.mul(kb, 16), db)))
                ja = e.let(e.add(a0, e.add(e.mul(ka, 16), da)))
                e.transpose8(out, e.add(dst0, e.add(e.mul(jb, out_b), ja)), out_b,
                             x, e.add(src0, e.add(e.mul(ja, in_a), jb)), in_a)

    @staticmethod
    def reference(x: np.ndarray, axes, begin=(), shape=None) -> np.ndarray:
        """numpy's transpose of the window at ``begin`` spanning ``shape`` (the result's)."""
        if begin:
            span = [1] * x.ndim
            for j, a in enumerate(axes):
                span[a] = shape[j]
            x = x[tuple(slice(b, b + n) for b, n in zip(begin, span))]
        return np.ascontiguousarray(np.transpose(x, axes))


def _permute_axes(call) -> tuple:
    nd = len(dims(call.args[0].ty))
    axes = call.attrs.axes
    return tuple(reversed(range(nd))) if axes is None else tuple(int(a) % nd for a in axes)


def _check_permute(call) -> str | None:
    problem = tensor_problem(call.args[0].ty, STORED)
    if problem:
        return f"relax.permute_dims: {problem}"
    if not dims(call.args[0].ty):
        return "relax.permute_dims: rank-0 input"
    return None


@register("relax.permute_dims", 1, _check_permute)
def _build_permute(fe, call, out):
    axes = _permute_axes(call)
    shape = dims(call.args[0].ty)
    moved = [a for a in axes if shape[a] != 1]
    if moved == sorted(moved):  # only unit dims move: the elements keep their order
        return reshaped(fe, call.args[0], out.shape)
    return Permute((fe.buffer(call.args[0]),), out, axes=axes)
