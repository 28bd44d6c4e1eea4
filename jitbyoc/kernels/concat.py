"""concat and stack: copies of their operands' rows into the result.

concat copies, for each index of the dims before its axis, every operand's row in turn;
stack is a concat of its operands viewed with a unit dim. A batch-1 channel
concatenation is one row: of at least :data:`BLOCKED_COPY` elements it is split into
:data:`ROW_BLOCKS` tasks of ranges along its axis on the thread pool
(:meth:`Concat.blocks`), each copying its overlap with every operand. Operands the region
makes itself are written in place by their producers (:mod:`.concat_parts`); only an
epilogue runs over them. All results are exact (elements are only moved).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import relax

from ..ir import kir
from ..ir.dtypes import STORED
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import unravel
from ..render.loops import threaded
from ..render.portable import PortableStage

# A batch-1 channel concatenation of at least BLOCKED_COPY elements is split into
# ROW_BLOCKS tasks along its axis. DenseNet-121 (float32, exported builds alternating,
# Zen 4, 2 threads): 0.944x the time in both orders; Inception v1 int8 0.987x.
ROW_BLOCKS = 16
BLOCKED_COPY = 1 << 15


@dataclass(eq=False)
class Concat(PortableStage, kir.KernelStage):
    """``out = concat(inputs, axis)``: each row (an index of the dims before ``axis``)
    is the inputs' rows one after another. Inputs whose index is in ``placed`` are already
    there (their producers wrote them in place: :mod:`.concat_parts`), so only the
    epilogue, if any, runs over their part."""
    axis: int = 0
    placed: tuple = ()

    def emit(self, e) -> None:
        out, axis = self.out, self.axis
        rows, blocks = e.product(out.shape[:axis]), self.blocks()
        if blocks == 1:
            e.parallel(rows, self._rows, threaded(out.shape, "copy") and axis > 0)
        else:
            e.parallel(e.mul(rows, blocks), lambda e, lo, hi: self._blocks(e, lo, hi, blocks), True)

    def needs_loop_vectorizer(self) -> bool:
        # rows are memcpy calls; only a cast copy is a loop (the epilogue decides for itself).
        # SqueezeNet's concatenating regions compiled in 30 ms each with the vectorizers, 18
        # without
        return not self.moves_bytes()

    def blocks(self) -> int:
        """Tasks each row of the result is split into, by ranges of its index along the
        axis: :data:`ROW_BLOCKS` where the dims before the axis are one row (a batch-1
        channel concatenation) of at least :data:`BLOCKED_COPY` elements, else 1 (a
        task per row). A DenseNet layer's concatenation copied 0.5-0.8 MB of earlier
        features in the region's entry while the pool's other thread waited."""
        out, axis = self.out, self.axis
        if axis == 0 or not all(isinstance(d, int) for d in out.shape) or math.prod(out.shape[:axis]) != 1:
            return 1
        return min(ROW_BLOCKS, out.shape[axis]) if math.prod(out.shape) >= BLOCKED_COPY else 1

    def _rows(self, e, lo, hi) -> None:
        """Rows ``lo .. hi`` of the result, whole."""
        out, axis = self.out, self.axis
        with e.loop(hi, lo, "row") as r:
            self._copy(e, r, 0, e.dim(out.shape[axis]))

    def _blocks(self, e, lo, hi, blocks: int) -> None:
        """Tasks ``lo .. hi`` of ``blocks`` a row: the ``k``-th of a row takes the indices
        ``[k * n / blocks, (k + 1) * n / blocks)`` along the axis (``n`` of them)."""
        n = self.out.shape[self.axis]
        with e.loop(hi, lo, "task") as t:
            r = e.let(e.div(t, blocks))
            k = e.let(e.sub(t, e.mul(r, blocks)))
            self._copy(e, r, e.let(e.div(e.mul(k, n), blocks)), e.let(e.div(e.mul(e.add(k, 1), n), blocks)))

    def _copy(self, e, r, c0, c1) -> None:
        """Indices ``[c0, c1)`` along the axis of row ``r``: each input's overlap copied
        (unless placed), and the epilogue run over it."""
        out, axis = self.out, self.axis
        inner = e.product(out.shape[axis + 1:])
        pos = unravel(e, r, [e.dim(d) for d in out.shape[:axis]])
        dst, at = e.let(e.mul(r, e.product(out.shape[axis:]))), 0
        for i, x in enumerate(self.inputs):
            size = e.dim(x.shape[axis])
            first = e.let(e.max(c0, at))
            count = e.let(e.max(e.sub(e.min(c1, e.add(at, size)), first), 0))
            if i not in self.placed:
                src = e.let(e.add(e.mul(r, e.mul(size, inner)), e.mul(e.sub(first, at), inner)))
                start = e.let(e.add(dst, e.mul(first, inner)))
                if self.moves_bytes():
                    e.copy_run(out, start, x, src, e.mul(count, inner))
                else:
                    with e.loop(e.mul(count, inner), 0, "k") as k:
                        e.copy(out, e.add(start, k), x, e.add(src, k))
            if self.epilogue is not None:
                e.epilogue(self, pos + [first] + [0] * (out.ndim - axis - 1),
                           [1] * axis + [count] + [e.dim(d) for d in x.shape[axis + 1:]])
            at = e.let(e.add(at, size))

    @staticmethod
    def reference(*xs: np.ndarray, axis: int = 0) -> np.ndarray:
        return np.concatenate(xs, axis=axis)


def _check_tuple_operands(call) -> str | None:
    """concat's and stack's operands: a literal tuple of tensors of one dtype."""
    name, tup = call.op.name, call.args[0]
    if not isinstance(tup, relax.Tuple) or not tup.fields:
        return f"{name}: operand is not a literal tuple of tensors"
    for t in list(tup.fields) + [call]:
        problem = tensor_problem(t.ty, STORED)  # copies: any stored dtype
        if problem:
            return f"{name}: {problem}"
    if len({str(t.ty.dtype) for t in tup.fields}) != 1:
        return f"{name}: operands of mixed dtypes"
    return None


def _check_concat(call) -> str | None:
    if call.attrs.axis is None:
        return "relax.concat: axis=None (flattening concat) is left to TVM"
    problem = _check_tuple_operands(call)
    if problem:
        return problem
    if not dims(call.ty):
        return "relax.concat: rank-0 operands"
    return None


@register("relax.concat", 1, _check_concat)
def _build_concat(fe, call, out):
    inputs = tuple(fe.buffer(t) for t in call.args[0].fields)
    return Concat(inputs, out, axis=int(call.attrs.axis) % out.ndim)


@register("relax.stack", 1, _check_tuple_operands)
def _build_stack(fe, call, out):
    """A concat of the operands, each viewed with a unit dim at ``axis``."""
    axis = int(call.attrs.axis) % out.ndim
    inputs = []
    for t in call.args[0].fields:
        buf = fe.buffer(t)
        inputs.append(kir.view(buf, buf.shape[:axis] + (1,) + buf.shape[axis:]))
    return Concat(tuple(inputs), out, axis=axis)
