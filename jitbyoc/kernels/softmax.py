"""softmax and log_softmax over any axis.

The tensor is viewed as (outer, L, inner) around the axis; each of the outer*inner rows
is reduced on its own: max, then the sum of exp(x - max) (exp from :mod:`jitbyoc.ir.vecmath`,
so it vectorizes), then one scaling pass. Rows are split across TVM's thread pool.

The algorithm is written once (:func:`softmax_row`) against the portable facade and its
vector ops: rows along the last (contiguous) axis run on strips of the machine's lanes
with a masked tail (explicit vectors in LLVM); strided rows, and every row in C, one
element at a time (LLVM's loop vectorizer takes the strided ones).

Accuracy: the sum is accumulated with reassociation allowed, so LLVM sums in vector
lanes and the C rendering sums in order; both are within ``L * eps`` relative of the
exact sum, and results agree to about 1e-6 relative (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import unravel
from ..render.loops import threaded
from ..render.portable import PortableStage


@dataclass(eq=False)
class Softmax(PortableStage, kir.KernelStage):
    axis: int = -1
    log: bool = False

    def split(self):
        shape = self.out.shape
        return shape[:self.axis], shape[self.axis], shape[self.axis + 1:]

    def needs_loop_vectorizer(self) -> bool:
        return bool(self.split()[2])  # rows along the last axis are written as vectors

    def emit(self, e) -> None:
        (x,), out = self.inputs, self.out
        outer, length, inner = self.split()

        def rows(e, lo, hi):
            n, step = e.dim(length), e.product(inner)
            with e.loop(hi, lo, "row") as r:
                if inner:  # strided rows: one element at a time (LLVM's loop vectorizer takes them)
                    base = e.let(e.add(e.mul(e.div(r, step), e.mul(n, step)), e.rem(r, step)))
                    softmax_row(e, out.dtype, _Strided(e, x, base, step), _Strided(e, out, base, step), n, 1,
                                self.log)
                else:
                    src, dst = e.address(x, e.mul(r, n)), e.address(out, e.mul(r, n))
                    vector_row(e, out.dtype, src, dst, n, self.log)
                    if self.epilogue is not None:
                        e.epilogue(self, unravel(e, r, [e.dim(d) for d in outer]) + [0],
                                   [1] * len(outer) + [n])

        e.parallel(e.product(outer + inner), rows, threaded(out.shape, "rows"))
        if inner:
            e.epilogue(self, [0] * out.ndim, [e.dim(d) for d in out.shape])

    @staticmethod
    def reference(x: np.ndarray, axis: int = -1, log: bool = False) -> np.ndarray:
        shifted = x - x.max(axis=axis, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=axis, keepdims=True)
        return (shifted - np.log(s) if log else e / s).astype(x.dtype)


class _Strided:
    """Element ``i`` of a row of ``buf`` at ``base + i * step``, one at a time."""

    def __init__(self, e, buf, base, step):
        self.e, self.buf, self.base, self.step = e, buf, base, step

    def load(self, i, mask, fill):
        return self.e.load(self.buf, self.e.add(self.base, self.e.mul(i, self.step)))

    def store(self, i, v, mask) -> None:
        self.e.store(self.buf, self.e.add(self.base, self.e.mul(i, self.step)), v)


class _Contiguous:
    """Elements ``i .. i + width`` of a contiguous row at ``ptr`` (:meth:`address`)."""

    def __init__(self, e, ptr, dt: str, width: int):
        self.e, self.ptr, self.dt, self.width = e, ptr, dt, width

    def load(self, i, mask, fill):
        return self.e.vload(self.ptr, i, self.dt, self.width, mask, fill)

    def store(self, i, v, mask) -> None:
        self.e.vstore(self.ptr, i, v, self.dt, mask)


def vector_row(e, dt: str, src, dst, n, log: bool = False) -> None:
    """(log_)softmax of the ``n`` contiguous elements at ``src`` into ``dst`` (may be
    ``src``; pointers from ``e.address``) on vectors of the machine's lanes: the max, the
    sum of exponentials and the scaling each one pass of whole vectors and a masked tail.
    Also the row step of fused attention."""
    width = e.lanes(dt)
    softmax_row(e, dt, _Contiguous(e, src, dt, width), _Contiguous(e, dst, dt, width), n, width, log)


def softmax_row(e, dt: str, src, dst, n, width: int, log: bool) -> None:
    """The algorithm, once: (log_)softmax of the ``n`` elements of the row ``src`` into
    ``dst`` (``load(i, mask, fill)``, ``store(i, v, mask)``), ``width`` at a time."""
    def vop(name, *args):
        return e.vop(width, name, dt, *args)

    m = e.fold_lanes("max", dt, n, width, lambda acc, i, mask: vop("maximum", acc, src.load(i, mask, "-inf")))

    def add_exp(acc, i, mask):
        x = vop("exp", vop("subtract", src.load(i, mask, 0), e.splat(m, width)))
        if not log:
            dst.store(i, x, mask)
        return e.reduce("sum", dt, acc, x if mask is None else e.select(mask, x, e.vconst(0, dt, width)))

    s = e.fold_lanes("sum", dt, n, width, add_exp)
    if log:  # x - (max + log(sum))
        shift = e.splat(e.op("add", dt, m, e.op("log", dt, s)), width)
        scaled = lambda i, mask: vop("subtract", src.load(i, mask, 0), shift)  # noqa: E731
    else:  # exp(x - max) * (1 / sum), the exponentials read back from dst
        scale = e.splat(e.op("divide", dt, e.const(1, dt), s), width)
        scaled = lambda i, mask: vop("multiply", dst.load(i, mask, 0), scale)  # noqa: E731
    e.strips(0, n, width, lambda i, mask: dst.store(i, scaled(i, mask), mask))


def _check(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, FLOATS)
    if problem:
        return f"{call.op.name}: {problem}"
    if not dims(x.ty):
        return f"{call.op.name}: rank-0 input"
    return None


def _builder(log: bool):
    def build(fe, call, out):
        x = fe.buffer(call.args[0])
        axis = int(call.attrs.axis) % x.ndim
        return Softmax((x,), out, axis=axis, log=log)
    return build


register("relax.nn.softmax", 1, _check)(_builder(False))
register("relax.nn.log_softmax", 1, _check)(_builder(True))
