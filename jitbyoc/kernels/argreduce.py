"""``argmax`` and ``argmin``: the index of the first extreme element along an axis (or of
the flattened tensor when ``axis`` is None), as int64.

TVM folds ``(index, value)`` pairs from ``(-1, lowest finite value)`` and takes a new
element unless the running value already beats or equals it (``topi.argmax``). A NaN is
therefore taken and then dropped by the next element, and a run of ``-inf`` leaves the
index at -1; jitbyoc folds the same way, in the same order, so it agrees everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import NUMERIC
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import unravel
from ..render.loops import threaded
from ..render.portable import PortableStage

# kind -> (comparison that keeps the running pair, numpy's extreme for the start value)
KINDS = {"argmax": ("greater", "greater_equal", "min"), "argmin": ("less", "less_equal", "max")}


def start_value(kind: str, dt: str):
    info = np.finfo(dt) if np.dtype(dt).kind == "f" else np.iinfo(dt)
    value = getattr(info, KINDS[kind][2])
    return value.item() if hasattr(value, "item") else value


@dataclass(eq=False)
class ArgReduce(PortableStage, kir.KernelStage):
    """``out[o, i] = arg<kind>_k x[o, k, i]`` with ``x`` viewed as (outer, n, inner)."""
    axis: int | None = None
    kind: str = "argmax"

    def sizes(self, e) -> tuple:
        """(outer, n, inner) in ``e``: a threaded body must size things in its own
        function (values of the launching one are undefined there: symbolic sizes)."""
        x = self.inputs[0]
        if self.axis is None:
            return 1, e.product(x.shape), 1
        a = self.axis
        return e.product(x.shape[:a]), e.dim(x.shape[a]), e.product(x.shape[a + 1:])

    def emit(self, e) -> None:
        x, out = self.inputs[0], self.out
        dt = x.dtype
        outer, _, inner = self.sizes(e)
        strict, keep, _ = KINDS[self.kind]

        def body(e, lo, hi):
            _, n, inner = self.sizes(e)
            with e.loop(hi, lo, "p") as p:
                o, i = e.let(e.div(p, inner)), e.let(e.rem(p, inner))
                base = e.let(e.add(e.mul(o, e.mul(n, inner)), i))
                best = e.var("int64", e.const(-1, "int64"))
                value = e.var(dt, e.const(start_value(self.kind, dt), dt))
                with e.loop(n, 0, "k") as k:
                    v = e.load(x, e.add(base, e.mul(k, inner)))
                    held = e.get(value)
                    e.set(best, e.select(e.op(keep, dt, held, v), e.get(best), k))
                    e.set(value, e.select(e.op(strict, dt, held, v), held, v))
                e.store(out, p, e.get(best))
                if self.epilogue is not None:
                    e.epilogue(self, unravel(e, p, [e.dim(d) for d in out.shape]), [1] * out.ndim)

        e.parallel(e.mul(outer, inner), body, threaded(x.shape, "stage"))

    @staticmethod
    def reference(x: np.ndarray, axis=None, kind: str = "argmax", keepdims: bool = False) -> np.ndarray:
        """TVM's fold, element by element (numpy's argmax differs on NaN and -inf runs)."""
        moved = np.moveaxis(x, axis, -1) if axis is not None else x.reshape(1, -1)
        flat = moved.reshape(-1, moved.shape[-1])
        better = np.greater_equal if kind == "argmax" else np.less_equal
        strict = np.greater if kind == "argmax" else np.less
        best = np.full(flat.shape[0], -1, "int64")
        value = np.full(flat.shape[0], start_value(kind, str(x.dtype)), x.dtype)
        for k in range(flat.shape[1]):
            col = flat[:, k]
            with np.errstate(invalid="ignore"):
                best = np.where(better(value, col), best, k)
                value = np.where(strict(value, col), value, col)
        shape = moved.shape[:-1] if axis is not None else ()
        out = best.reshape(shape)
        if keepdims:
            out = np.expand_dims(out, axis if axis is not None else tuple(range(x.ndim)))
        return out


def _check(call) -> str | None:
    x, name = call.args[0], call.op.name
    problem = tensor_problem(x.ty, NUMERIC) or tensor_problem(call.ty, {"int64"})
    if problem:
        return f"{name}: {problem}"
    shape = dims(x.ty)
    if not shape or 0 in shape:
        return f"{name}: rank-0 or empty input"
    return None


def _builder(kind: str):
    def build(fe, call, out):
        x = fe.buffer(call.args[0])
        axis = None if call.attrs.axis is None else int(call.attrs.axis) % x.ndim
        return ArgReduce((x,), out, axis=axis, kind=kind)
    return build


for _kind in KINDS:
    register(f"relax.{_kind}", 1, _check)(_builder(_kind))
