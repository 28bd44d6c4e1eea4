"""``relax.cumsum`` along one axis (inclusive or exclusive), accumulated in order in the
output dtype, as TVM's build does; in bool, a running OR (NumPy's bool addition: TVM's
own build fails on it). Threads take lines (an index of every other dim)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import ALL
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import unravel
from ..render.loops import threaded
from ..render.portable import PortableStage


@dataclass(eq=False)
class Cumsum(PortableStage, kir.KernelStage):
    axis: int = 0
    exclusive: bool = False

    def emit(self, e) -> None:
        (x,), out, dt, axis = self.inputs, self.out, self.out.dtype, self.axis

        def body(e, lo, hi):
            n, inner = e.dim(x.shape[axis]), e.product(x.shape[axis + 1:])
            with e.loop(hi, lo, "line") as t:
                base = e.let(e.add(e.mul(e.mul(e.div(t, inner), n), inner), e.rem(t, inner)))
                acc = e.var(dt, e.const(0, dt))
                with e.loop(n, 0, "k") as k:
                    at = e.let(e.add(base, e.mul(k, inner)))
                    v = e.load(x, at)
                    v = v if x.dtype == dt else e.op("astype", x.dtype, v, to=dt)
                    total = e.op("logical_or" if dt == "bool" else "add", dt, e.get(acc), v)
                    e.store(out, at, e.get(acc) if self.exclusive else total)
                    e.set(acc, total)
                    if self.epilogue is not None:
                        e.epilogue(self, unravel(e, at, [e.dim(d) for d in out.shape]), [1] * out.ndim)

        lines = e.mul(e.product(x.shape[:axis]), e.product(x.shape[axis + 1:]))
        e.parallel(lines, body, threaded(x.shape, "stage"))

    @staticmethod
    def reference(x: np.ndarray, axis: int, dtype: str, exclusive: bool = False) -> np.ndarray:
        out = np.cumsum(x.astype(dtype), axis=axis, dtype=dtype)
        if exclusive:
            out = np.concatenate([np.zeros_like(np.take(out, [0], axis=axis)),
                                  np.take(out, range(x.shape[axis] - 1), axis=axis)], axis=axis)
        return out


def _check(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, ALL) or tensor_problem(call.ty, ALL)
    if problem:
        return f"relax.cumsum: {problem}"
    if call.attrs.axis is None or not dims(x.ty):
        return "relax.cumsum: a flattening cumsum (axis=None) or a rank-0 input is left to TVM"
    return None


@register("relax.cumsum", 1, _check)
def _build(fe, call, out):
    x = fe.buffer(call.args[0])
    return Cumsum((x,), out, axis=int(call.attrs.axis) % x.ndim, exclusive=bool(call.attrs.exclusive))
