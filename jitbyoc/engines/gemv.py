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
from ..ir.llvmtypes import I64, PTR
from ..render.loops import ceil_div, for_range, free_workspace, smin, workspace
from ..render.vectors import intrinsic, lanes, multiply_add, splat, strips, suffix, vload, vstore, vtype

ROWS = 4  # outputs per block: x is loaded once for these rows of W
COLUMNS = 4  # vectors of outputs per block of the partial sums' second pass (``x @ W``)
K_CHUNK = 256  # rows of W per task of ``x @ W`` (each task reads them whole, in order)


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
    ``Conv1D``, ``x @ W``). B is read as it lies, row after row: each task takes
    :data:`K_CHUNK` rows and adds ``a[k]`` times each whole row into its own partial
    sums (``n`` elements, in L1/L2); a second pass adds the partial sums per block of
    outputs and runs the epilogue. Blocks of columns walked down the rows (the previous
    way) read one or four cache lines per row, a row apart: 0.39x numpy at 4096x4096."""
    b, vl = ctx.b, lanes(dtype)
    n, k = ctx.syms["n"], ctx.syms["k"]
    chunks = b.select(b.icmp_signed(">", k, I64(0)), ceil_div(b, k, I64(K_CHUNK)), I64(1))
    width = b.mul(ceil_div(b, n, I64(vl)), I64(vl))
    partial = workspace(ctx, dtype, b.mul(chunks, width))
    extra = [b.ptrtoint(partial, I64), chunks, width]
    ctx.parallel_for(chunks, lambda c, lo, hi, ex: _partial_sums(c, bufs, dtype, lo, hi, ex), extra)
    blocks = ceil_div(b, n, I64(vl * COLUMNS))
    ctx.parallel_for(blocks, lambda c, lo, hi, ex: _sum_partials(c, bufs, dtype, callback, batch, lo, hi, ex), extra)
    free_workspace(ctx, partial)


def _partial_sums(c, bufs: dict, dtype: str, lo, hi, extra) -> None:
    b, vl, vt = c.b, lanes(dtype), vtype(dtype)
    partial, width = b.inttoptr(extra[0], PTR), extra[2]
    k = c.syms["k"]
    with for_range(b, hi, "chunk", start=lo) as chunk:
        out = b.gep(partial, [b.mul(chunk, width)], source_etype=vt.element)
        k0 = b.mul(chunk, I64(K_CHUNK))
        k1 = smin(b, b.add(k0, I64(K_CHUNK)), k)
        strips(b, I64(0), width, vl, lambda j, _m: vstore(
            b, ir.Constant(vt, [0.0] * vl), b.gep(out, [j], source_etype=vt.element), dtype))
        rows = b.sub(k1, k0)
        groups = b.sdiv(rows, I64(ROWS))
        whole = b.mul(groups, I64(ROWS))
        with for_range(b, groups, "kk") as kk:
            _add_rows(c, bufs, dtype, out, b.add(k0, b.mul(kk, I64(ROWS))), ROWS)
        with for_range(b, b.sub(rows, whole), "kr") as kr:
            _add_rows(c, bufs, dtype, out, b.add(b.add(k0, whole), kr), 1)


def _add_rows(c, bufs: dict, dtype: str, out, first, count: int) -> None:
    """``out += a[first + r] * B[first + r, :]`` for ``count`` rows: the partial sums are
    loaded and stored once per ``count`` rows."""
    b, vl, vt = c.b, lanes(dtype), vtype(dtype)
    xs, bases = [], []
    for r in range(count):
        row = b.add(first, I64(r))
        xs.append(splat(b, b.load(c.element(bufs["a"], row), typ=lookup_dtype(dtype).ir), vl))
        bases.append(b.mul(row, c.syms["bk"]))

    def add(j, mask):
        at = b.gep(out, [j], source_etype=vt.element)
        acc = vload(b, at, dtype)
        for x, base in zip(xs, bases):
            acc = multiply_add(b, vload(b, c.element(bufs["b"], b.add(base, j)), dtype, mask), x, acc)
        vstore(b, acc, at, dtype)

    strips(b, I64(0), c.syms["n"], vl, add)


def _sum_partials(c, bufs: dict, dtype: str, callback, batch: int, lo, hi, extra) -> None:
    b, vl, vt = c.b, lanes(dtype), vtype(dtype)
    partial, chunks, width = b.inttoptr(extra[0], PTR), extra[1], extra[2]
    n = c.syms["n"]
    span = I64(vl * COLUMNS)
    with for_range(b, hi, "blk", start=lo) as blk:
        n0 = b.mul(blk, span)
        n1 = smin(b, b.add(n0, span), n)

        def total(j, mask):
            (slot,), _ = _accumulators(b, dtype, 1)
            with for_range(b, chunks, "part") as part:
                at = b.gep(partial, [b.add(b.mul(part, width), j)], source_etype=vt.element)
                b.store(b.fadd(b.load(slot, typ=vt), vload(b, at, dtype)), slot)
            vstore(b, b.load(slot, typ=vt), c.element(bufs["c"], j), dtype, mask)

        strips(b, n0, n1, vl, total)
        callback(c, [I64(0)] * batch, I64(0), I64(1), n0, b.sub(n1, n0))


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
