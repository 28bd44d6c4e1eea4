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
from ..render.vectors import intrinsic, lane_mask, lanes, multiply_add, splat, strips, suffix, vload, vstore, vtype

ROWS = 4  # outputs per block: x is loaded once for these rows of W
COLUMNS = 4  # vectors of outputs per block when B's rows are contiguous (``x @ W``)


def _each_block(ctx, width: int, batch: int, callback, work) -> None:
    """``work(c, n0)`` for each block of ``width`` outputs ``n0 ..``, blocks split across
    the thread pool, then the epilogue ``callback(c, batch index, m0, mc, n0, nc)`` on
    the block. ``c`` is the task's own context: values of ``ctx`` are not its."""
    blocks = ctx.b.sdiv(ctx.b.add(ctx.syms["n"], I64(width - 1)), I64(width))

    def body(c, lo, hi, _extra):
        b = c.b
        with for_range(b, hi, "blk", start=lo) as blk:
            n0 = b.mul(blk, I64(width))
            work(c, n0)
            count = b.sub(c.syms["n"], n0)
            callback(c, [I64(0)] * batch, I64(0), I64(1), n0,
                     b.select(b.icmp_signed("<", count, I64(width)), count, I64(width)))

    ctx.parallel_for(blocks, body)


def _accumulators(b: ir.IRBuilder, dtype: str, count: int):
    """``count`` vector slots set to zero here (allocated in the entry block), and the
    fused multiply-add that updates them."""
    vt = vtype(dtype)
    with b.goto_entry_block():
        slots = [b.alloca(vt) for _ in range(count)]
    for s in slots:
        b.store(ir.Constant(vt, [0.0] * vt.count), s)

    def add(slot, x, y) -> None:
        b.store(multiply_add(b, x, y, b.load(slot, typ=vt)), slot)

    return slots, add


def emit_gemv_columns(ctx, bufs: dict, dtype: str, callback, batch: int) -> None:
    """``c[0, n] = sum_k a[0, k] * b[k * bk + n]`` (B's rows contiguous: GPT-2's
    ``Conv1D``, ``x @ W``): each task takes blocks of ``COLUMNS`` vectors of outputs and
    adds ``a[k]`` times each row's stretch of B into them, one row after another."""
    vl = lanes(dtype)

    def work(c, n0):
        b = c.b
        masks = [lane_mask(b, b.sub(c.syms["n"], b.add(n0, I64(j * vl))), vl) for j in range(COLUMNS)]
        slots, add = _accumulators(b, dtype, COLUMNS)
        with for_range(b, c.syms["k"], "k") as k:
            x = splat(b, b.load(c.element(bufs["a"], k), typ=lookup_dtype(dtype).ir), vl)
            row = b.add(b.mul(k, c.syms["bk"]), n0)
            for j, (s, mask) in enumerate(zip(slots, masks)):
                add(s, vload(b, c.element(bufs["b"], b.add(row, I64(j * vl))), dtype, mask), x)
        for j, (s, mask) in enumerate(zip(slots, masks)):
            vstore(b, b.load(s, typ=vtype(dtype)), c.element(bufs["c"], b.add(n0, I64(j * vl))), dtype, mask)

    _each_block(ctx, vl * COLUMNS, batch, callback, work)


def emit_gemv(ctx, bufs: dict, dtype: str, callback, batch: int) -> None:
    """``c[0, n] = sum_k a[0, k] * b[n * bx + k]`` for every ``n``, then the epilogue
    ``callback(ctx, batch index, m0, mc, n0, nc)`` per block."""
    def work(c, n0):
        b = c.b
        for r, total in enumerate(_dot_rows(c, bufs, dtype, n0)):
            at = b.add(n0, I64(r))
            with b.if_then(b.icmp_signed("<", at, c.syms["n"])):
                b.store(total, c.element(bufs["c"], at))

    _each_block(ctx, ROWS, batch, callback, work)


def _dot_rows(c, bufs: dict, dtype: str, n0) -> list:
    """The dot products of ``a``'s row with rows ``n0 .. n0 + ROWS - 1`` of ``W`` (rows
    past ``n`` re-read the last row: never out of bounds; their sums are not stored)."""
    b, vl, vt = c.b, lanes(dtype), vtype(dtype)
    last = b.sub(c.syms["n"], I64(1))
    starts = []
    for r in range(ROWS):
        row = b.add(n0, I64(r))
        starts.append(b.mul(b.select(b.icmp_signed("<", row, last), row, last), c.syms["bx"]))
    slots, add = _accumulators(b, dtype, ROWS)

    def step(j, mask):
        x = vload(b, c.element(bufs["a"], j), dtype, mask)
        for s, start in zip(slots, starts):
            add(s, vload(b, c.element(bufs["b"], b.add(start, j)), dtype, mask), x)

    strips(b, I64(0), c.syms["k"], vl, step)
    reduce = intrinsic(b.module, f"llvm.vector.reduce.fadd.{suffix(vt)}", vt.element, [vt.element, vt])
    zero = ir.Constant(lookup_dtype(dtype).ir, 0.0)
    return [b.call(reduce, [zero, b.load(s, typ=vt)], fastmath=("reassoc",)) for s in slots]
