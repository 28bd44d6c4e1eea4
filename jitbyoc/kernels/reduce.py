"""Reductions: sum, prod, max, min, mean, variance, std over any axes.

The input's dims are grouped into runs that are all reduced or all kept (unit dims drop
out), then one of two loop orders is used:

* the innermost run is reduced ("rows"): every output element folds its elements, the
  contiguous innermost run in a reassociable loop that LLVM vectorizes; outputs are split
  across TVM's thread pool.
* the innermost run is kept ("columns"): for each block of ``BLOCK`` contiguous outputs,
  every reduced index adds a contiguous slice of the input into the block, which stays
  in cache; (outer index, block) pairs are split across threads.

An input that widens integers (``sum(astype(q, "int32"))``, an int8 product's zero-point
sums) is read as the narrow integers and widened element by element as it is folded: no
wide copy is written (``sum`` of int8 ``(1, 12, 64, 128)`` and of uint8 ``(1, 12, 128,
128)``, BERT's attention, together: 21-26 -> 11-13 us on Zen 4).

mean divides the sum by the element count and variance is two-pass (mean, then the mean
squared deviation), exactly as TVM's legalization does; std is its square root.

Accuracy: max/min are exact (and NaN-propagating, as numpy's); sum/mean/prod are
accumulated in the input dtype with reassociation allowed, so LLVM sums in vector lanes
and C in order. Both are within ``n * eps * sum(|x|)`` of the exact sum (``n`` elements
reduced), like TVM's sequential sum, so the tests use that bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS, HALF, NUMERIC
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.folds import identity
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import div_ceil, dot, folds, product, unravel
from ..render.loops import threaded
from ..render.portable import PortableStage

ROWS = 4  # outputs reduced together in the "rows" order: four streams from memory
BLOCK = 256  # outputs per block in the "columns" order: 1 KiB of float32, stays in L1


@dataclass(frozen=True)
class Reduction:
    """One Relax reduction: how elements fold (a kind of :data:`jitbyoc.ir.folds.FOLDS`)
    and what is done with the fold."""
    fold: str
    ref: Callable  # numpy
    divide: bool = False  # by the element count (mean)
    two_pass: bool = False  # fold the squared deviations from the mean (variance)
    sqrt: bool = False  # of the result (std)
    dtypes: frozenset = NUMERIC


REDUCTIONS = {
    "sum": Reduction("sum", np.sum),
    "prod": Reduction("prod", np.prod),
    "max": Reduction("max", np.max, dtypes=NUMERIC | HALF),  # exact: half too
    "min": Reduction("min", np.min, dtypes=NUMERIC | HALF),
    "mean": Reduction("sum", np.mean, divide=True, dtypes=FLOATS),
    "variance": Reduction("sum", np.var, divide=True, two_pass=True, dtypes=FLOATS),
    "std": Reduction("sum", np.std, divide=True, two_pass=True, sqrt=True, dtypes=FLOATS),
}


@dataclass(eq=False)
class Reduce(PortableStage, kir.KernelStage):
    """``out = <kind>(inputs[0], axes)``; ``out`` has the kept dims in order (with unit
    dims where ``keepdims`` put them). ``scratch`` (same shape as ``out``) holds the
    squared deviations of two-pass kinds in the "columns" order."""
    axes: tuple = ()
    kind: str = "sum"  # a key of REDUCTIONS
    scratch: kir.Buffer | None = None

    @property
    def row(self) -> Reduction:
        return REDUCTIONS[self.kind]

    def runs(self) -> list[tuple[bool, list[int]]]:
        """The input's non-unit dims in runs that are all reduced or all kept."""
        x = self.inputs[0]
        runs: list[tuple[bool, list[int]]] = []
        for d, n in enumerate(x.shape):
            if n == 1:
                continue
            red = d in self.axes
            if runs and runs[-1][0] == red:
                runs[-1][1].append(d)
            else:
                runs.append((red, [d]))
        if not any(red for red, _ in runs):  # only unit dims reduced: fold one element
            runs.append((True, []))
        return runs

    def groups(self, e):
        """``(reduced, extent, stride)`` per run, as facade values."""
        x = self.inputs[0]
        return [(red, e.product([x.shape[d] for d in ds]),
                 e.product(x.shape[ds[-1] + 1:]) if ds else 1) for red, ds in self.runs()]

    def count(self, e):
        return e.product([self.inputs[0].shape[a] for a in self.axes])

    def emit(self, e) -> None:
        groups = self.groups(e)
        if groups[-1][0]:
            self._rows(e, groups)
        else:
            self._columns(e, groups)

    def _read(self, e, i):
        """Input element ``i`` in ``out``'s dtype: an integer input narrower than it is
        widened as it is read (:func:`_widened`)."""
        x, dt = self.inputs[0], self.out.dtype
        value = e.load(x, i)
        return value if x.dtype == dt else e.op("astype", x.dtype, value, to=dt)

    def _finish(self, e, total, dt, n):
        """mean/variance/std from a sum."""
        if not self.row.divide:
            return total
        value = e.op("divide", dt, total, n)
        return e.op("sqrt", dt, value) if self.row.sqrt else value

    def _rows(self, e, groups) -> None:
        x, dt = self.inputs[0], self.out.dtype

        def body(e, lo, hi):
            groups = self.groups(e)
            kept, red = [g for g in groups if not g[0]], [g for g in groups if g[0]]
            inner = red.pop()[1]  # the contiguous run
            plan = (kept, red, inner, e.as_float(self.count(e), dt))
            with e.loop(e.div(e.sub(hi, lo), ROWS), 0, "og") as g:
                first = e.let(e.add(lo, e.mul(g, ROWS)))
                self._some_rows(e, [e.let(e.add(first, i)) for i in range(ROWS)], plan)
            with e.loop(hi, e.sub(hi, e.rem(e.sub(hi, lo), ROWS)), "o") as o:
                self._some_rows(e, [o], plan)

        e.parallel(product(e, [g[1] for g in groups if not g[0]]), body, threaded(x.shape, "stage"))

    def _some_rows(self, e, rows, plan) -> None:
        """Reduce the outputs ``rows`` together (their input rows stream side by side)."""
        out, dt = self.out, self.out.dtype
        kept, red, inner, n = plan
        kind = self.row.fold
        bases = [e.let(dot(e, unravel(e, o, [g[1] for g in kept]), [g[2] for g in kept]))
                 for o in rows]

        def totals(value):
            """Fold the strided runs (outer loop) of contiguous-run folds (vectorized)."""
            accs = [e.var(dt, e.const(identity(kind, dt), dt)) for _ in rows]
            with e.loop(product(e, [g[1] for g in red]), 0, "q") as q:
                off = e.let(dot(e, unravel(e, q, [g[1] for g in red]), [g[2] for g in red]))
                parts = folds(e, kind, dt, inner, [
                    (lambda k, r=r, b=b: value(r, e.add(e.add(b, off), k)))
                    for r, b in enumerate(bases)])
                for acc, part in zip(accs, parts):
                    e.set(acc, e.reduce(kind, dt, e.get(acc), part))
            return [e.get(acc) for acc in accs]

        sums = totals(lambda r, i: self._read(e, i))
        if self.row.two_pass:
            means = [e.op("divide", dt, s, n) for s in sums]
            sums = totals(lambda r, i: e.op("square", dt, e.op("subtract", dt, self._read(e, i),
                                                                 means[r])))
        for o, s in zip(rows, sums):
            e.store(out, o, self._finish(e, s, dt, n))
            if self.epilogue is not None:
                e.epilogue(self, unravel(e, o, [e.dim(d) for d in out.shape]), [1] * out.ndim)

    def _columns(self, e, groups) -> None:
        x, out, dt = self.inputs[0], self.out, self.out.dtype
        kind = self.row.fold

        def blocks(e, groups):
            return e.let(div_ceil(e, groups[-1][1], BLOCK))

        def accumulate(e, acc_buf, base, o0, j0, j1, value, red):
            with e.loop(j1, j0, "j") as j:
                e.store(acc_buf, e.add(o0, j), e.const(identity(kind, dt), dt))
            with e.loop(product(e, [g[1] for g in red]), 0, "q") as q:
                off = e.let(e.add(base, dot(e, unravel(e, q, [g[1] for g in red]),
                                            [g[2] for g in red])))
                with e.loop(j1, j0, "j") as j:
                    at = e.add(o0, j)
                    e.store(acc_buf, at, e.reduce(kind, dt, e.load(acc_buf, at),
                                                  value(e.add(off, j), at)))

        def body(e, lo, hi):
            groups = self.groups(e)
            width, nblocks = groups[-1][1], blocks(e, groups)
            kept, red = [g for g in groups[:-1] if not g[0]], [g for g in groups if g[0]]
            n = e.as_float(self.count(e), dt)
            with e.loop(hi, lo, "t") as t:
                ko, jb = e.let(e.div(t, nblocks)), e.let(e.rem(t, nblocks))
                base = e.let(dot(e, unravel(e, ko, [g[1] for g in kept]), [g[2] for g in kept]))
                o0, j0 = e.let(e.mul(ko, width)), e.let(e.mul(jb, BLOCK))
                j1 = e.let(e.min(e.add(j0, BLOCK), width))
                accumulate(e, out, base, o0, j0, j1, lambda i, at: self._read(e, i), red)
                if self.row.two_pass:
                    with e.loop(j1, j0, "j") as j:
                        at = e.add(o0, j)
                        e.store(out, at, e.op("divide", dt, e.load(out, at), n))
                    accumulate(e, self.scratch, base, o0, j0, j1, lambda i, at: e.op(
                        "square", dt, e.op("subtract", dt, self._read(e, i), e.load(out, at))), red)
                src = self.scratch if self.row.two_pass else out
                with e.loop(j1, j0, "j") as j:
                    at = e.let(e.add(o0, j))
                    if self.row.divide:
                        e.store(out, at, self._finish(e, e.load(src, at), dt, n))
                    if self.epilogue is not None:
                        e.epilogue(self, unravel(e, at, [e.dim(d) for d in out.shape]),
                                   [1] * out.ndim)

        kept = [g[1] for g in groups[:-1] if not g[0]]
        e.parallel(e.mul(product(e, kept), blocks(e, groups)), body, threaded(x.shape, "stage"))

    @staticmethod
    def reference(x: np.ndarray, axes, kind: str, keepdims: bool = False) -> np.ndarray:
        fn = REDUCTIONS[kind].ref
        wide = x.astype(np.float64) if x.dtype.kind == "f" else x
        return np.asarray(fn(wide, axis=tuple(axes), keepdims=keepdims)).astype(x.dtype)


def _axes(call) -> tuple:
    nd = len(dims(call.args[0].ty))
    axis = call.attrs.axis
    return tuple(range(nd)) if axis is None else tuple(sorted({int(a) % nd for a in axis}))


def _checker(kind: str):
    allowed = REDUCTIONS[kind].dtypes

    def check(call) -> str | None:
        x = call.args[0]
        problem = tensor_problem(x.ty, allowed) or tensor_problem(call.ty, allowed)
        if problem:
            return f"relax.{kind}: {problem}"
        shape = dims(x.ty)
        if not shape:
            return f"relax.{kind}: rank-0 input"
        if call.attrs.axis is not None and len(call.attrs.axis) == 0:
            return f"relax.{kind}: an empty axis list is left to TVM"
        if any(shape[a] == 0 for a in _axes(call)):
            return f"relax.{kind}: empty reduction (TVM fills the identity)"
        return None
    return check


def _widened(fe, expr, dt: str) -> kir.Buffer | None:
    """The narrower integers ``expr`` widens to ``dt`` (an ``astype``), as a buffer the
    reduction reads and widens itself: no copy in ``dt`` is written first (an int8
    product's zero-point sums, ``sum(astype(q, "int32"))``, wrote four bytes for each of
    ``q``'s, where ``q`` is a buffer already: the product's operand). None otherwise."""
    node = fe.value(expr)
    if not (isinstance(node, kir.Op) and node.op == "astype" and node.dtype == dt):
        return None
    if not (lookup_dtype(node.in_dtype).is_int and lookup_dtype(dt).is_int
            and lookup_dtype(node.in_dtype).bits < lookup_dtype(dt).bits):
        return None
    return fe.node_buffer(node.args[0], tuple(dims(expr.ty)), node.in_dtype)


def _builder(kind: str):
    def build(fe, call, out):
        x = (_widened(fe, call.args[0], out.dtype) if kind in ("sum", "max", "min") else None) \
            or fe.buffer(call.args[0])
        stage = Reduce((x,), out, axes=_axes(call), kind=kind)
        if stage.row.two_pass and not stage.runs()[-1][0]:  # "columns" order needs scratch
            stage.scratch = fe.temp(out.shape, out.dtype)
        return stage
    return build


for _kind in REDUCTIONS:
    register(f"relax.{_kind}", 1, _checker(_kind))(_builder(_kind))
