"""Matrix-vector products inside the GEMM engine: one row of A against B (``x @ W.T``,
torch.export's ``linear`` at batch 1 and a decoder's single-token step; ``x @ W``,
GPT-2's ``Conv1D``).

The packed GEMM would copy and transpose all of ``W`` into panels on every call for one
row of work: three passes over the weights where one suffices. Here each task takes
blocks of :data:`ROWS` outputs; every output keeps a vector accumulator of fused
multiply-adds over contiguous stretches of its row of ``W`` and of ``x`` (``x`` loaded
once per stretch for all :data:`ROWS` rows), then sums its lanes. The engine chooses this
path at run time (``m == 1``, no batch), so a symbolic-length decoder runs its prompt
through the GEMM and each generated token through here.
"""

from __future__ import annotations

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I64
from ..render.loops import for_range
from ..render.vectors import intrinsic, lane_mask, lanes, splat, strips, suffix, vload, vstore, vtype

ROWS = 4  # outputs per block: x is loaded once for these rows of W
COLUMNS = 4  # vectors of outputs per block when B's rows are contiguous (``x @ W``)


def emit_gemv_columns(ctx, bufs: dict, dtype: str, callback, batch: int) -> None:
    """``c[0, n] = sum_k a[0, k] * b[k * bk + n]`` (B's rows contiguous: GPT-2's
    ``Conv1D``, ``x @ W``): each task takes blocks of ``COLUMNS`` vectors of outputs and
    adds ``a[k]`` times each row's stretch of B into them, one row after another."""
    b, vl = ctx.b, lanes(dtype)
    width = vl * COLUMNS
    blocks = b.sdiv(b.add(ctx.syms["n"], I64(width - 1)), I64(width))

    def body(c, lo, hi, _extra):
        n, cb, vt = c.syms["n"], c.b, vtype(dtype)
        fma = intrinsic(cb.module, f"llvm.fma.{suffix(vt)}", vt, [vt, vt, vt])
        with cb.goto_entry_block():
            slots = [cb.alloca(vt) for _ in range(COLUMNS)]
        with for_range(cb, hi, "blk", start=lo) as blk:
            n0 = cb.mul(blk, I64(width))
            masks = [lane_mask(cb, cb.sub(n, cb.add(n0, I64(j * vl))), vl) for j in range(COLUMNS)]
            for s in slots:
                cb.store(ir.Constant(vt, [0.0] * vl), s)
            with for_range(cb, c.syms["k"], "k") as k:
                x = splat(cb, cb.load(c.element(bufs["a"], k), typ=lookup_dtype(dtype).ir), vl)
                row = cb.add(cb.mul(k, c.syms["bk"]), n0)
                for j, (s, mask) in enumerate(zip(slots, masks)):
                    w = vload(cb, c.element(bufs["b"], cb.add(row, I64(j * vl))), dtype, mask)
                    cb.store(cb.call(fma, [w, x, cb.load(s, typ=vt)]), s)
            for j, (s, mask) in enumerate(zip(slots, masks)):
                vstore(cb, cb.load(s, typ=vt), c.element(bufs["c"], cb.add(n0, I64(j * vl))), dtype, mask)
            count = cb.sub(n, n0)
            cols = cb.select(cb.icmp_signed("<", count, I64(width)), count, I64(width))
            callback(c, [I64(0)] * batch, I64(0), I64(1), n0, cols)

    ctx.parallel_for(blocks, body)


def emit_gemv(ctx, bufs: dict, dtype: str, callback, batch: int) -> None:
    """``c[0, n] = sum_k a[0, k] * b[n * bx + k]`` for every ``n``, then the epilogue
    ``callback(ctx, batch index, m0, mc, n0, nc)`` per block."""
    blocks = ctx.b.sdiv(ctx.b.add(ctx.syms["n"], I64(ROWS - 1)), I64(ROWS))

    def body(c, lo, hi, _extra):  # c: the task's own context (values of ctx are not its)
        n = c.syms["n"]
        with for_range(c.b, hi, "blk", start=lo) as blk:
            n0 = c.b.mul(blk, I64(ROWS))
            sums = _dot_rows(c, bufs, dtype, n0)
            for r, total in enumerate(sums):
                at = c.b.add(n0, I64(r))
                with c.b.if_then(c.b.icmp_signed("<", at, n)):
                    c.b.store(total, c.element(bufs["c"], at))
            count = c.b.sub(n, n0)
            rows = c.b.select(c.b.icmp_signed("<", count, I64(ROWS)), count, I64(ROWS))
            callback(c, [I64(0)] * batch, I64(0), I64(1), n0, rows)

    ctx.parallel_for(blocks, body)


def _dot_rows(c, bufs: dict, dtype: str, n0) -> list:
    """The dot products of ``a``'s row with rows ``n0 .. n0 + ROWS - 1`` of ``W`` (rows
    past ``n`` re-read the last row: never out of bounds; their sums are not stored)."""
    b, vl = c.b, lanes(dtype)
    vt = vtype(dtype)
    last = b.sub(c.syms["n"], I64(1))
    starts = []
    for r in range(ROWS):
        row = b.add(n0, I64(r))
        starts.append(b.mul(b.select(b.icmp_signed("<", row, last), row, last), c.syms["bx"]))
    fma = intrinsic(b.module, f"llvm.fma.{suffix(vt)}", vt, [vt, vt, vt])
    with b.goto_entry_block():
        slots = [b.alloca(vt) for _ in range(ROWS)]
    for s in slots:
        b.store(ir.Constant(vt, [0.0] * vl), s)

    def step(j, mask):
        x = vload(b, c.element(bufs["a"], j), dtype, mask)
        for s, start in zip(slots, starts):
            w = vload(b, c.element(bufs["b"], b.add(start, j)), dtype, mask)
            b.store(b.call(fma, [w, x, b.load(s, typ=vt)]), s)

    strips(b, I64(0), c.syms["k"], vl, step)
    reduce = intrinsic(b.module, f"llvm.vector.reduce.fadd.{suffix(vt)}", vt.element, [vt.element, vt])
    zero = ir.Constant(lookup_dtype(dtype).ir, 0.0)
    return [b.call(reduce, [zero, b.load(s, typ=vt)], fastmath=("reassoc",)) for s in slots]
