"""LLVM rendering of :class:`~.attention.Attention`: per task, a few rows of one head.

Tasks are (batch item, chunk of ``ROW_BLOCKS * MR`` rows), split across TVM's pool. A
task packs ``K^T`` into the microkernel's panels (and ``V`` when its rows are not
contiguous) once per batch item, then for each block of ``MR``
rows: the microkernel computes the ``MR x N`` scores into the task's block; row by row,
the chain's stages run on the block on explicit vectors (the scores' epilogue, elementwise
stages, the softmax of :func:`.softmax.vector_row`, integer max/min folds into per-row
buffers); the microkernel multiplies the probabilities' block by ``V`` into the output,
whose epilogue then runs on the finished rows.
"""

from __future__ import annotations

from ..engines import gemm_micro as mk
from ..engines.gemm_llvm import b_in_place, extent, free_workspace, micro_tile, pack_panels, workspace
from ..ir import kir
from ..ir.folds import FOLDS, identity
from ..ir.llvmtypes import I1, I64
from ..render.indexing import offset
from ..render.loops import ceil_div, for_range, smin
from ..render.portable import LLVM
from ..render.vectors import lanes
from .reduce import Reduce
from .softmax import Softmax, vector_row

ROW_BLOCKS = 4  # MR-row blocks per task: packing K and V is paid once per ROW_BLOCKS * MR rows


def emit(stage, ctx) -> None:
    m1, m2 = stage.steps[0], stage.steps[-1]
    g1, g2 = m1.gemm(), m2.gemm()
    b = ctx.b
    chunks = ceil_div(b, extent(ctx, g1.m), I64(g1.blocking.mr * ROW_BLOCKS))
    count = b.mul(ctx.product(g1.batch), chunks)
    ctx.parallel_for(count, lambda c, lo, hi, extra: _tasks(stage, g1, g2, c, lo, hi, extra[0]), [chunks])


def _tasks(stage, g1, g2, c, lo, hi, chunks) -> None:
    """Tasks ``lo .. hi``: task ``t`` is chunk ``t % chunks`` of batch item ``t // chunks``."""
    b, dt = c.b, g1.dtype
    m, n, k, dv = extent(c, g1.m), extent(c, g1.n), extent(c, g1.k), extent(c, g2.n)
    mr, vl = g1.blocking.mr, lanes(dt)
    ldn = b.mul(ceil_div(b, n, I64(vl)), I64(vl))
    rows = {t: workspace(c, t.dtype, b.mul(I64(mr), ldn)) for t in stage.blocks}
    # K^T is always packed: read in place, its rows are N apart, and the microkernel ran
    # 2.4x slower on Llama's attention (N = 500) than on the packed panels
    kp = workspace(c, dt, b.mul(ceil_div(b, n, I64(g1.nr)), I64(g1.nr * g1.k)))
    vp = None if b_in_place(g2) else workspace(c, dt, b.mul(b.mul(ceil_div(b, dv, I64(g2.nr)), I64(g2.nr)), n))
    per_task = I64(mr * ROW_BLOCKS)
    with for_range(b, hi, "task", start=lo) as t:
        item, chunk = b.sdiv(t, chunks), b.srem(t, chunks)
        bidx = c.unravel(item, g1.batch) if g1.batch else []
        fresh = b.or_(b.icmp_signed("==", chunk, I64(0)), b.icmp_signed("==", t, lo))
        with b.if_then(fresh):
            pack_panels(g1, c, g1.b, kp, bidx, I64(0), n, I64(0), k, g1.nr)
            if vp is not None:
                pack_panels(g2, c, g2.b, vp, bidx, I64(0), dv, I64(0), n, g2.nr)
        first = b.mul(chunk, per_task)
        last = smin(b, m, b.add(first, per_task))
        with for_range(b, ceil_div(b, b.sub(last, first), I64(mr)), "blk") as q:
            i0 = b.add(first, b.mul(q, I64(mr)))
            mv = smin(b, I64(mr), b.sub(last, i0))
            block = _Block(stage, LLVM(c), rows, ldn, n, bidx, i0)
            _scores(g1, c, block, kp, mv, (n, k))
            with for_range(b, mv, "row") as r:
                block.row_steps(r)
            _values(g2, c, block, vp, mv, (n, dv))
    for p in [vp, kp, *reversed(rows.values())]:
        if p is not None:
            free_workspace(c, p)


def _scores(g1, c, block, kp, mv, nk) -> None:
    """``S[i0:i0+mv, :] = Q K^T`` into the scores' block (no epilogue yet)."""
    b, dt, (n, k) = c.b, g1.dtype, nk
    abase, axs, aks = g1.a.direct_llvm(c, block.bidx)
    a = mk.gep(b, abase, b.mul(block.i0, axs), dt)
    out = block.rows[block.stage.steps[0].out.storage]
    with for_range(b, ceil_div(b, n, I64(g1.nr)), "sj") as jr:
        j0 = b.mul(jr, I64(g1.nr))
        micro_tile(g1, c, [a, axs, aks, mk.gep(b, kp, b.mul(j0, k), dt), I64(g1.nr), k, mk.gep(b, out, j0, dt),
                           block.ldn, mv, smin(b, I64(g1.nr), b.sub(n, j0)), I1(0)], False)


def _values(g2, c, block, vp, mv, ndv) -> None:
    """``O[i0:i0+mv, :] = P V`` from the probabilities' block, then the output's epilogue."""
    b, dt, (n, dv) = c.b, g2.dtype, ndv
    p = block.rows[block.stage.steps[-1].inputs[0].storage]
    if vp is None:
        vbase, _, vks = g2.b.direct_llvm(c, block.bidx)
    ldc = c.product(g2.c.row if isinstance(g2.c.row, tuple) else (g2.c.row,))
    with for_range(b, ceil_div(b, dv, I64(g2.nr)), "vj") as jr:
        j0 = b.mul(jr, I64(g2.nr))
        bt = (mk.gep(b, vp, b.mul(j0, n), dt), I64(g2.nr)) if vp is not None else (mk.gep(b, vbase, j0, dt), vks)
        out = c.element(g2.c.buf, g2.c.offset_llvm(c, block.bidx, block.i0, j0))
        micro_tile(g2, c, [p, block.ldn, I64(1), *bt, n, out, ldc, mv,
                           smin(b, I64(g2.nr), b.sub(dv, j0)), I1(0)], vp is None)
    if g2.epilogue is not None:
        g2.epilogue(c, block.bidx, block.i0, mv, I64(0), dv)


class _Block:
    """One block of rows of a task: where each buffer's element of row ``r`` is. The row
    steps are written against the portable facade ``e`` and its vector ops."""

    def __init__(self, stage, e, rows, ldn, n, bidx, i0):
        self.stage, self.e, self.rows, self.ldn, self.n = stage, e, rows, ldn, n
        self.bidx, self.i0 = list(bidx), i0
        self.vl = e.lanes(stage.steps[0].out.dtype)

    def row_steps(self, r) -> None:
        e, m1 = self.e, self.stage.steps[0]
        if m1.epilogue is not None:
            self.map(r, m1.out.shape, [(m1.out, m1.epilogue)], m1.out)
        for s in self.stage.steps[1:-1]:
            if isinstance(s, kir.Elementwise):
                self.map(r, s.shape, s.stores)
            elif isinstance(s, Softmax):
                (x,), out = s.inputs, s.out
                vector_row(e, out.dtype, e.address(self.rows[x.storage], self.at(r, 0), x.dtype),
                           e.address(self.rows[out.storage], self.at(r, 0), out.dtype), self.n)
                if s.epilogue is not None:
                    self.map(r, out.shape, [(out, s.epilogue)], out)
            elif isinstance(s, Reduce):
                self.fold(r, s)

    def at(self, r, j):
        """Where element ``j`` of row ``r`` of a block buffer is, from its start."""
        return self.e.add(self.e.mul(r, self.ldn), j)

    def position(self, ndim: int, r, j) -> list:
        """The point (batch..., i0 + r, j), right-aligned to ``ndim`` dims (leading unit dims 0)."""
        full = self.bidx + [self.e.add(self.i0, r), j]
        return [0] * (ndim - len(full)) + full[max(len(full) - ndim, 0):]

    def map(self, r, shape, stores, acc_buf=None) -> None:
        """Elementwise ``stores`` (over ``shape``) along row ``r`` on vectors."""
        e, vl = self.e, self.vl
        roots = [node for _, node in stores]

        def point(j, mask):
            def load(buf):
                if buf.storage in self.rows:
                    return e.vload(self.rows[buf.storage], self.at(r, j), buf.dtype, vl, mask, None)
                off = offset(e, buf.shape, self.position(buf.ndim, r, j), broadcast=True)
                if buf.ndim and buf.shape[-1] != 1:
                    return e.vload(buf, off, buf.dtype, vl, mask, None)
                return e.vbroadcast(buf, off, buf.dtype, vl)

            acc = None if acc_buf is None else e.loaded(load(acc_buf), acc_buf.dtype)
            values = e.evaluate(vl, roots, load, acc)
            for dst, node in stores:
                e.vstore(self.rows[dst.storage], self.at(r, j), e.stored(values[id(node)], dst.dtype),
                         dst.dtype, mask)

        e.strips(0, self.n, vl, point)

    def fold(self, r, s: Reduce) -> None:
        """An integer max/min of row ``r`` of a block buffer into the per-row buffer."""
        e, vl = self.e, self.vl
        (x,), dt = s.inputs, s.out.dtype
        init, op = identity(s.kind, dt), FOLDS[s.kind].op

        def step(acc, j, mask):
            return e.vop(vl, op, dt, acc, e.vload(self.rows[x.storage], self.at(r, j), dt, vl, mask, init))

        value = e.fold_lanes(s.kind, dt, self.n, vl, step)
        e.store(s.out, offset(e, s.out.shape, self.position(s.out.ndim, r, 0), broadcast=True), value)
