"""Fused attention (:class:`~.attention.Attention`), written once against the portable
facade (:mod:`jitbyoc.render.portable`): per task, a few rows of one head.

Tasks are (batch item, chunk of ``ROW_BLOCKS * MR`` rows), split across TVM's pool. For
each block of ``MR`` rows: the products compute the ``MR x N`` scores into the task's
block (a workspace per block buffer); row by row, the chain's stages run on the block
(the scores' epilogue, elementwise stages, the softmax of :func:`.softmax.vector_row`,
integer max/min folds into per-row buffers) on the facade's vectors; the products
multiply the probabilities' block by ``V`` into the output, whose epilogue then runs on
the finished rows. Only the products differ between the renderings: in LLVM the GEMM
microkernel (:class:`_Microkernel`: ``K^T``, and ``V`` when its rows are not contiguous,
packed once per batch item of a task), in C scalar loops (:class:`_Loops`), every other
vector one element wide.

Accuracy: the C rendering sums each product over ``k`` in order from 0, as
:meth:`jitbyoc.engines.gemm.Gemm.emit_c` (and TVM's build) does, and the softmax's sum
in order; LLVM sums in the microkernel's and the vectors' lanes.
"""

from __future__ import annotations

from llvmlite import ir

from ..engines import gemm_micro as mk
from ..engines import gemm_tiles as tiles
from ..engines.gemm_llvm import a_direct, b_in_place, micro_tile, pack_panels
from ..engines.gemm_tiled import edge_rows, tiled
from ..ir import kir
from ..ir.bfloat import widened_c
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.folds import FOLDS, identity
from ..ir.llvmtypes import I1, I64
from ..render.indexing import div_ceil, offset, unravel
from ..render.loops import ceil_div, for_range, smin
from ..render.portable import LLVM
from .reduce import Reduce
from .softmax import Softmax, vector_row

ROW_BLOCKS = 4  # MR-row blocks per task: packing K and V is paid once per ROW_BLOCKS * MR rows


def _extent(e, dims):
    return e.product(dims if isinstance(dims, tuple) else (dims,))


def emit(stage, e) -> None:
    # the schedule's arithmetic (tasks, blocks, workspace sizes) is plain, not nsw: with
    # nsw flags LLVM rewrites the blocks' bounds into other code than it had before the facade
    g1, w = stage.steps[0].gemm(), e.wrapping()
    chunks = w.let(div_ceil(w, _extent(w, g1.m), g1.blocking.mr * ROW_BLOCKS))
    w.parallel(w.mul(w.product(g1.batch), chunks), lambda e, lo, hi, chunks: _tasks(stage, e, lo, hi, chunks),
               True, [chunks])


def _tasks(stage, e, lo, hi, chunks) -> None:
    """Tasks ``lo .. hi``: task ``t`` is chunk ``t % chunks`` of batch item ``t // chunks``."""
    g1, g2, w = stage.steps[0].gemm(), stage.steps[-1].gemm(), e.wrapping()
    m, n, k, dv = (_extent(e, d) for d in (g1.m, g1.n, g1.k, g2.n))
    mr, vl = g1.blocking.mr, e.lanes(g1.dtype)
    ldn = w.let(w.mul(div_ceil(w, n, vl), vl))
    rows = {t: e.workspace(t.dtype, w.mul(mr, ldn)) for t in stage.blocks}
    products = (_Microkernel if isinstance(e, LLVM) else _Loops)(w, g1, g2, (n, k, dv))
    per_task = mr * ROW_BLOCKS
    with e.loop(hi, lo, "task") as t:
        item, chunk = w.let(w.div(t, chunks)), w.let(w.rem(t, chunks))
        bidx = unravel(w, item, [w.dim(d) for d in g1.batch], wrap=True) if g1.batch else []
        products.pack(bidx, e.or_(e.eq(chunk, 0), e.eq(t, lo)))
        first = w.let(w.mul(chunk, per_task))
        last = w.let(w.min(m, w.add(first, per_task)))
        with e.loop(div_ceil(w, w.sub(last, first), mr), 0, "blk") as q:
            i0 = w.let(w.add(first, w.mul(q, mr)))
            mv = w.let(w.min(mr, w.sub(last, i0)))
            block = _Block(stage, e, rows, ldn, n, bidx, i0)
            products.scores(block, mv)
            with e.loop(mv, 0, "row") as r:
                block.row_steps(r)
            products.values(block, mv)
            if g2.epilogue is not None:
                g2.epilogue(e.ctx, [e.i(x) for x in bidx], e.i(i0), e.i(mv), e.i(0), e.i(dv))
    products.release()
    for p in reversed(rows.values()):
        e.free(p)


class _Microkernel:
    """The block's products on the GEMM microkernel (LLVM), or AMX's tile kernel where the
    product has one (bf16 mode's bfloat16 pairs, :mod:`jitbyoc.engines.gemm_tiles`: a
    block is its ``MR = 32`` rows; a short block's rows of ``Q`` are copied zero-padded,
    the probabilities' block has ``MR`` rows). ``K^T`` is always packed: read in place,
    its rows are N apart, and the microkernel ran 2.4x slower on Llama's attention
    (N = 500) than on the packed panels."""

    def __init__(self, e, g1, g2, sizes):
        self.e, self.c, self.g1, self.g2 = e, e.ctx, g1, g2
        n, k, dv = sizes
        group, self.unit = g1.product.group, g1.product.unit
        k_units = -(-g1.k // group)  # Q's row (g1.k is static: _products_fit) in units
        # K^T and V as the engine packs them: panels of units (group consecutive k)
        self.kp = e.workspace(self.unit, e.mul(div_ceil(e, n, g1.nr), g1.nr * k_units))
        vp = None if b_in_place(g2) else e.mul(e.mul(div_ceil(e, dv, g2.nr), g2.nr), div_ceil(e, n, group))
        self.vp = None if vp is None else e.workspace(self.unit, vp)
        self.n, self.dv = e.i(n), e.i(dv)
        self.k, self.n_units = (e.i(div_ceil(e, x, group)) for x in (k, n))
        self.tiles = g1.blocking.tiles
        self.edge = e.workspace(self.unit, e.mul(g1.blocking.mr, k_units)) if self.tiles else None
        if self.tiles:
            tiles.configure(self.c.b)

    def _product(self, g, args, in_place: bool) -> None:
        if self.tiles:
            tiled(g, self.c, args, in_place, a_rows=True)
        else:
            micro_tile(g, self.c, args, in_place)

    def pack(self, bidx, fresh) -> None:
        """Pack ``K^T`` (and ``V``) of batch item ``bidx`` into the task's panels when
        ``fresh`` (the task's first block of this item)."""
        c, g1, g2, n = self.c, self.g1, self.g2, self.n
        bidx = [self.e.i(x) for x in bidx]
        with self.e.when(fresh):
            pack_panels(g1, c, g1.b, self.kp, bidx, I64(0), n, I64(0), self.k, g1.nr)
            if self.vp is not None:
                pack_panels(g2, c, g2.b, self.vp, bidx, I64(0), self.dv, I64(0), self.n_units, g2.nr)

    def scores(self, block, mv) -> None:
        """``S[i0:i0+mv, :] = Q K^T`` into the scores' block (no epilogue yet)."""
        e, c, g, (n, k) = self.e, self.c, self.g1, (self.n, self.k)
        b, dt = c.b, self.unit
        abase, axs, aks = a_direct(g, c, [e.i(x) for x in block.bidx])  # in units
        a = (mk.gep(b, abase, b.mul(e.i(block.i0), axs), dt), axs, aks)
        if self.tiles:  # a tile reads MR rows: a short block's are copied, zero-padded
            a = edge_rows(g, c, a, self.edge, k, e.i(mv))
        out = block.rows[block.stage.steps[0].out.storage]
        with for_range(b, ceil_div(b, n, I64(g.nr)), "sj") as jr:
            j0 = b.mul(jr, I64(g.nr))
            self._product(g, [*a, mk.gep(b, self.kp, b.mul(j0, k), dt), I64(g.nr), k,
                              mk.gep(b, out, j0, g.product.out), e.i(block.ldn), e.i(mv),
                              smin(b, I64(g.nr), b.sub(n, j0)), I1(0)], False)

    def values(self, block, mv) -> None:
        """``O[i0:i0+mv, :] = P V`` from the probabilities' block."""
        e, c, g, (n, dv), vp = self.e, self.c, self.g2, (self.n_units, self.dv), self.vp
        b, dt, bidx, group = c.b, self.unit, [e.i(x) for x in block.bidx], g.product.group
        p = block.rows[block.stage.steps[-1].inputs[0].storage]
        if group > 1:  # the last unit's k past N multiplies V's zero padding: zero, never garbage
            _zero_past(c, p, g.product.a, (e.i(mv), e.i(block.ldn)), self.n, group)
        if vp is None:
            vbase, _, vks = g.b.direct_llvm(c, bidx)
        ldc = c.product(g.c.row if isinstance(g.c.row, tuple) else (g.c.row,))
        with for_range(b, ceil_div(b, dv, I64(g.nr)), "vj") as jr:
            j0 = b.mul(jr, I64(g.nr))
            if vp is not None:
                bt = (mk.gep(b, vp, b.mul(j0, n), dt), I64(g.nr))
            else:
                bt = (mk.gep(b, vbase, j0, dt), vks)
            out = c.element(g.c.buf, g.c.offset_llvm(c, bidx, e.i(block.i0), j0))
            self._product(g, [p, b.sdiv(e.i(block.ldn), I64(group)), I64(1), *bt, n, out, ldc, e.i(mv),
                              smin(b, I64(g.nr), b.sub(dv, j0)), I1(0)], vp is None)

    def release(self) -> None:
        if self.tiles:
            tiles.release(self.c.b)
        for p in [self.edge, self.vp, self.kp]:
            if p is not None:
                self.e.free(p)


def _zero_past(c, block, dtype: str, rows, n, group: int) -> None:
    """Zero the elements from ``n`` to the next whole unit of ``group`` in each of the
    block's ``rows = (count, stride)`` rows (what the last unit of a row reads past N)."""
    b = c.b
    count, stride = rows
    pad = b.sub(b.mul(ceil_div(b, n, I64(group)), I64(group)), n)
    zero = ir.Constant(lookup_dtype(dtype).storage_ir, 0)
    with for_range(b, count, "zr") as r:
        with for_range(b, pad, "zk") as j:
            b.store(zero, mk.gep(b, block, b.add(b.mul(r, stride), b.add(n, j)), dtype))


class _Loops:
    """The block's products as scalar loops (C), operands read in place: each sum runs
    over ``k`` in order from 0, as :meth:`jitbyoc.engines.gemm.Gemm.emit_c` sums."""

    def __init__(self, e, g1, g2, sizes):
        self.e, self.g1, self.g2, self.sizes = e, g1, g2, sizes

    def pack(self, bidx, fresh) -> None:
        pass

    def release(self) -> None:
        pass

    def scores(self, block, mv) -> None:
        e, g, (n, k, _) = self.e, self.g1, self.sizes
        out = block.rows[block.stage.steps[0].out.storage]
        self._product(mv, n, k, lambda i, kk: g.a.element_c(e.ctx, block.bidx, e.i(e.add(block.i0, i)), kk),
                      lambda j, kk: g.b.element_c(e.ctx, block.bidx, j, kk),
                      lambda i, j, acc: e.vstore(out, block.at(i, j), acc, g.product.out))

    def values(self, block, mv) -> None:
        e, g, (n, _, dv) = self.e, self.g2, self.sizes
        p = block.rows[block.stage.steps[-1].inputs[0].storage]

        def store(i, j, acc):
            off = g.c.offset_c(e.ctx, block.bidx, e.i(e.add(block.i0, i)), j)
            e.ctx.line(f"{e.ctx.element(g.c.buf, off)} = {acc};")

        self._product(mv, dv, n, lambda i, kk: f"{p}[{e.i(block.at(i, kk))}]",
                      lambda j, kk: g.b.element_c(e.ctx, block.bidx, j, kk), store)

    def _product(self, rows, cols, depth, a, b, store) -> None:
        """``store(i, j, sum of a(i, kk) * b(j, kk) over kk < depth)`` for each i < rows,
        j < cols, summed in the product's accumulator (bfloat16 widened exactly)."""
        e, product = self.e, self.g1.product
        dt, wide = product.acc, lookup_dtype(product.a)
        with e.loop(rows, 0, "pi") as i:
            with e.loop(cols, 0, "pj") as j:
                acc = e.var(dt, e.const(0, dt))
                with e.loop(depth, 0, "pk") as kk:
                    e.ctx.line(f"{acc} += {widened_c(wide, a(i, kk))} * {widened_c(wide, b(j, kk))};")
                store(i, j, acc)


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
