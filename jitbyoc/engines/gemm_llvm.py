"""The GEMM engine's LLVM driver: threads, cache blocking, packing, microkernel calls.

Work is split along the larger of M and N (:func:`split_side`: unless it has too few
parts to share out) into *parts* (MR rows or NR columns), parts
are grouped into the blocking's ``chunks`` (:data:`CHUNKS`; 16 for bfloat16 on tiles)
chunks per batch item (fewer when there are fewer parts) of equal size give or take a
part, a chunk of columns starting on a whole cache line of the output
(:func:`line_parts`), and every task of TVM's
pool takes chunks from atomic counters until none is left, those of its own range of
chunks first (:func:`~jitbyoc.render.loops.claim_home_first`: the columns, a conv's
pixels, its neighbours in the model worked on): on a machine shared with other processes
a thread that gets less CPU simply takes fewer chunks, where a static split would make
the whole product wait for it.

Per chunk, the loop nest (outermost first) is: MC rows of A (one block when A is read
in place), KC of K, NC columns (B packed ``kc x nc``, stays in L2), MR rows (the A
micro-panel stays in L1), NR columns (B micro-panels stream from L2 through the
microkernel). A :class:`~.gemm.Strided` A is read in place (no packing: the MR rows of a
micro-panel stay in L1 across the NR loop either way), and so is a B whose rows are
contiguous along N; other operands (a transposed B, a conv's im2col) are packed.
"""

from __future__ import annotations

from functools import partial, reduce

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I1, I32, I64
from ..render.loops import (
    ceil_div,
    claim_each,
    claim_home_first,
    for_range,
    free_workspace,
    home_counters,
    smax,
    smin,
    task_counter,
    workspace,
)
from . import gemm_micro as mk
from .gemm_micro import EDGE_UNROLL
from . import gemm_tiles as tiles
from .gemm_tiled import edge_rows, tiled
from . import gemm_units as units
from .gemm import SERIAL_MAX_MACS, Panels, Strided, _all_dims, _dims, _is_one, static_size

CHUNKS = 8  # chunks per batch item: enough to even out threads that get unequal CPU


def extent(ctx, dims) -> ir.Value:
    return ctx.product(_dims(dims))


def chunks_of(parts: int, chunks: int = CHUNKS) -> int:
    """Chunks per batch item of a product split into ``parts`` (static :func:`chunk_count`)."""
    per = max(1, -(-parts // chunks))
    count = -(-parts // per)
    return max(1, count + (count % 2 == 1 and parts % per == 0 and count < parts))


def chunk_count(b, parts, chunks: int = CHUNKS):
    """Chunks per batch item: about ``chunks``, of ``per = ceil(parts / chunks)``
    parts each; but an odd count of whole chunks gets one chunk more, all then of equal
    size give or take a part (:func:`chunk_parts`). ResNet-50's 56x56 1x1 convs have 49
    column panels: 7 chunks of 7 gave one thread of two 4 chunks and the other 3; 8 of 6
    or 7 run its 256->64 conv in 0.89-0.94x the time. Where the last chunk is short (13
    panels: 6 of 2 and 1) the split is even already, and more, smaller chunks only
    re-read the other operand more."""
    per = ceil_div(b, smax(b, parts, I64(1)), I64(chunks))
    count = ceil_div(b, parts, per)
    odd = b.icmp_signed("!=", b.srem(count, I64(2)), I64(0))
    whole = b.icmp_signed("==", b.srem(parts, per), I64(0))
    more = b.and_(b.and_(odd, whole), b.icmp_signed("<", count, parts))
    return smax(b, I64(1), b.add(count, b.zext(more, I64)))


def chunk_parts(b, chunk, parts, chunks, align):
    """The parts ``[lo, hi)`` of chunk ``chunk`` of ``chunks``: even shares, each edge moved
    to the nearest multiple of ``align`` parts (:func:`line_parts`; sizes then differ by
    ``align`` at most)."""
    def edge(c):
        even = b.sdiv(b.mul(c, parts), chunks)
        return smin(b, b.mul(b.sdiv(b.add(even, b.sdiv(align, I64(2))), align), align), parts)
    last = b.icmp_signed("==", b.add(chunk, I64(1)), chunks)
    return edge(chunk), b.select(last, parts, edge(b.add(chunk, I64(1))))


def largest_chunk(parts: int, chunks: int, align: int) -> int:
    """Parts of the largest chunk of :func:`chunk_parts` (an even share rounded up, and
    ``align - 1`` more for its edges' moves)."""
    return -(-parts // chunks_of(parts, chunks)) + align - 1


def line_parts(g) -> int:
    """Parts (column panels) that a chunk of columns starts on a multiple of: enough that
    its first column starts a cache line of the output (:attr:`.gemm.Gemm.stored`), so no
    line is written by two threads. uint8 results (32 columns, half a line) were split
    mid-line: ResNet-50 QDQ's 1x1 convolutions took longer, the more chunks they had."""
    return max(1, -(-64 // (g.nr * g.stored)))


def emit(g, ctx) -> None:
    """Emit ``g`` (a :class:`~.gemm.Gemm`) at ``ctx``'s insertion point (a product in
    units with B of activations packs B once first: :func:`.gemm_units.packed_once`)."""
    g, packed = units.packed_once(g, ctx)
    _emit(g, ctx)
    if packed is not None:
        free_workspace(ctx, packed)


def _emit(g, ctx) -> None:
    b, blk = ctx.b, g.blocking
    m, n = extent(ctx, g.m), extent(ctx, g.n)
    sizes = static_size(g.m), static_size(g.n), static_size(g.batch)
    if None in sizes:
        split_n, parts = split_side(b, (m, n), (I64(blk.mr), I64(g.nr)), ctx.product(g.batch), blk.chunks)
    else:  # known now: the same split as the scratch of private sums (scratch_c) takes
        columns, count = split_parts(sizes[0], sizes[1], blk.mr, g.nr, sizes[2], blk.chunks)
        split_n, parts = I1(int(columns)), I64(count)
    per_item = chunk_count(b, parts, blk.chunks)
    if g.serial():
        _task(g, ctx, I64(0), I64(1), [b.zext(split_n, I64), parts, per_item, task_counter(b)])
        return
    extra = [b.zext(split_n, I64), parts, per_item, home_counters(b)]
    count = b.mul(ctx.product(g.batch), per_item)
    tasks = None
    if not g.static():  # small at run time: one task, on the calling thread
        macs = ctx.product(_all_dims(g))
        tasks = b.select(b.icmp_signed("<", macs, I64(SERIAL_MAX_MACS)), I32(1), I32(0))
    ctx.parallel_for(count, lambda c, lo, hi, ex: _task(g, c, lo, hi, ex, c.team), extra, tasks)


def split_parts(m: int, n: int, mr: int, nr: int, batch: int, chunks: int) -> tuple[bool, int]:
    """:func:`split_side` on known sizes: what a product of static sizes emits as
    constants, and what its scratch for private sums (:func:`scratch_c`) is sized by."""
    pm, pn = -(-m // mr), -(-n // nr)
    larger, other = (pn, pm) if n >= m else (pm, pn)
    columns = (n >= m) != (batch * larger < chunks and other > larger)
    return columns, pn if columns else pm


def split_side(b, sizes, units, batch, chunks: int) -> tuple:
    """(whether chunks are ranges of columns, the parts of that side). The larger side is
    split (the other operand is then the one each chunk re-reads), unless it has fewer
    parts than ``chunks`` over the batch and the other side has more: a 7x7 map's 49
    columns are one panel (one task), 196 columns three panels of 64 and one of 4. The
    zoo measured level (Zen 5); a chain of 128 -> 128 1x1 convolutions on 14x14 ran 0.93x
    the time, but as much with the old rule taken as constants (:func:`split_parts`)."""
    (m, n), (mr, nr) = sizes, units
    pm, pn = ceil_div(b, m, mr), ceil_div(b, n, nr)
    larger_n = b.icmp_signed(">=", n, m)
    few = b.icmp_signed("<", b.mul(batch, b.select(larger_n, pn, pm)), I64(chunks))
    other_more = b.icmp_signed(">", b.select(larger_n, pm, pn), b.select(larger_n, pn, pm))
    split_n = b.xor(larger_n, b.and_(few, other_more))
    return split_n, b.select(split_n, pn, pm)


def _task(g, c, _lo, _hi, extra, team=None) -> None:
    """Take chunks from the shared counter (``team``: the launch's home-range counters)
    until every chunk is taken."""
    b, blk = c.b, g.blocking
    split_n, parts, per_item = b.trunc(extra[0], I1), extra[1], extra[2]
    m, n, k = extent(c, g.m), extent(c, g.n), k_units(g, c)
    kblocks, kcb = k_blocks(b, k, blk)
    direct = a_in_place(g)
    b_direct = b_in_place(g)
    mcap = smin(b, I64(blk.mc), b.mul(ceil_div(b, m, I64(blk.mr)), I64(blk.mr)))
    ncap = smin(b, I64(blk.nc), b.mul(ceil_div(b, n, I64(g.nr)), I64(g.nr)))
    ap = None if direct else workspace(c, g.product.unit, b.mul(mcap, kcb))
    bp = None if b_direct else workspace(c, g.product.unit, b.mul(ncap, kcb))
    # an edge of fewer than MR rows of an A read in place, copied whole and zero-padded
    edge = workspace(c, g.product.unit, b.mul(I64(blk.mr), kcb)) if blk.tiles and direct else None
    sums = scratch_c(g)
    scratch = workspace(c, g.product.acc, I64(sums[0] * sums[1])) if sums else None
    total = b.mul(c.product(g.batch), per_item)
    # a thread's own chunks first: its columns (a conv's pixels) are the rows its
    # neighbours in the model wrote and read (see conv_engine.Emit.banded)
    claim = (claim_each(b, extra[3], total, "chunk") if team is None
             else claim_home_first(b, team, extra[3], total, I64(1), "chunk"))
    if blk.tiles:
        tiles.configure(b)
    with claim as chunk:
        item = b.sdiv(chunk, per_item)
        align = b.select(split_n, I64(line_parts(g)), I64(1))
        p_lo, p_hi = chunk_parts(b, b.srem(chunk, per_item), parts, per_item, align)
        rows = (smin(b, b.mul(p_lo, I64(blk.mr)), m), smin(b, b.mul(p_hi, I64(blk.mr)), m))
        cols = (smin(b, b.mul(p_lo, I64(g.nr)), n), smin(b, b.mul(p_hi, I64(g.nr)), n))
        mrange = (b.select(split_n, I64(0), rows[0]), b.select(split_n, m, rows[1]))
        nrange = (b.select(split_n, cols[0], I64(0)), b.select(split_n, cols[1], n))
        bidx = c.unravel(item, g.batch) if g.batch else []
        c_at = None if scratch is None else (scratch, I64(sums[1]), mrange[0], nrange[0])
        _blocks(g, c, bidx, mrange, nrange, (kblocks, kcb), ap, bp, edge, c_at)
    if blk.tiles:
        tiles.release(b)
    if scratch is not None:
        free_workspace(c, scratch)
    if edge is not None:
        free_workspace(c, edge)
    if bp is not None:
        free_workspace(c, bp)
    if ap is not None:
        free_workspace(c, ap)


SCRATCH_C_MAX_BYTES = 1 << 20  # see scratch_c


def scratch_c(g) -> tuple | None:
    """``(rows, row stride)`` of a task's scratch for a chunk's C, where ``g``'s C is a
    temp only its epilogue reads (:attr:`.gemm.Gemm.private_c`, static M and N) and a
    chunk's block of it takes at most :data:`SCRATCH_C_MAX_BYTES`; else None. The tiles
    store their sums there and the epilogue reads them back while they are in cache,
    where a temp of the whole C took fresh lines from memory and wrote them back: a
    bf16 or int8 product whose epilogue writes its own dtype passed its float32 / int32
    sums through memory once more. Rows are 64 bytes apart at least (whole lines: AMX
    tile rows 16 bytes off a line cost several times as much)."""
    m, n, batch = static_size(g.m), static_size(g.n), static_size(g.batch)
    if not g.private_c or g.epilogue is None or None in (m, n, batch):
        return None
    # as _emit splits (split_side): a chunk is whole columns or whole rows
    split_n, parts = split_parts(m, n, g.blocking.mr, g.nr, batch, g.blocking.chunks)
    most = largest_chunk(parts, g.blocking.chunks, line_parts(g) if split_n else 1)
    rows, cols = (m, most * g.nr) if split_n else (most * g.blocking.mr, n)
    nbytes = lookup_dtype(g.product.acc).nbytes
    line = 64 // nbytes  # elements a cache line
    stride = -(-cols // line) * line
    return (rows, stride) if rows * stride * nbytes <= SCRATCH_C_MAX_BYTES else None


def k_blocks(b, k, blk) -> tuple:
    """``(blocks, units a block)`` of a reduction of ``k`` units (i64 values): blocks of at
    most ``blk.kc``, evenly split; with tiles, each a whole number of the tile kernel's
    steps (16 units), so only the last block's k tail runs on the vector kernel. Split
    evenly, 512 bf16 units were 3 blocks of 171, whose 11 units each ran on vectors: a
    1024^3 bf16 product took 3.1 ms (10 % of the tile loop), 1.8 ms in whole steps;
    ResNet-50's 1x1 convolutions of 1024 and 2048 channels alike (bf16 model 0.92x)."""
    kblocks = b.select(b.icmp_signed(">", k, I64(0)), ceil_div(b, k, I64(blk.kc)), I64(1))
    kcb = ceil_div(b, k, kblocks)
    if not blk.tiles:
        return kblocks, kcb
    step = I64(tiles.TILE_BYTES // 4)
    kcb = smax(b, b.mul(ceil_div(b, kcb, step), step), step)
    return b.select(b.icmp_signed(">", k, I64(0)), ceil_div(b, k, kcb), I64(1)), kcb


def _blocks(g, c, bidx, mrange, nrange, kplan, ap, bp, edge, c_at) -> None:
    b, blk = c.b, g.blocking
    k = k_units(g, c)
    kblocks, kcb = kplan
    rows = b.sub(mrange[1], mrange[0])
    # A read in place needs no M blocking: B is then packed once per (KC, NC) block
    mb = I64(1) if ap is None else ceil_div(b, rows, I64(blk.mc))
    # blocks of at least one row: no M (or N) is a division by zero (an empty block loop)
    mcb = b.mul(ceil_div(b, ceil_div(b, rows, smax(b, mb, I64(1))), I64(blk.mr)), I64(blk.mr))
    with for_range(b, mb, "gi") as ib:
        ic = b.add(mrange[0], b.mul(ib, mcb))
        mc = smin(b, mcb, b.sub(mrange[1], ic))
        with for_range(b, kblocks, "gp") as pb:
            pc = b.mul(pb, kcb)
            kc = smin(b, kcb, b.sub(k, pc))
            if ap is not None:
                if blk.tiles:  # rows of k, as the tile kernel reads A
                    units.pack_unit_rows(g, g.a, c, ap, bidx, ic, mc, pc, kc)
                else:
                    pack_panels(g, c, g.a, ap, bidx, ic, mc, pc, kc, blk.mr)
            last = b.icmp_signed("==", pb, b.sub(kblocks, I64(1)))
            _columns(g, c, bidx, (ic, mc), (pc, kc, last), nrange, ap, bp, edge, c_at)


def _columns(g, c, bidx, mblock, kblock, nrange, ap, bp, edge, c_at) -> None:
    """The NC blocks of columns of a KC x MC block; C at ``g.c``, or with ``c_at =
    (scratch, row stride, first row, first column)`` in the chunk's scratch
    (:func:`scratch_c`)."""
    b, blk, dt = c.b, g.blocking, g.product.unit
    (ic, mc), (pc, kc, last) = mblock, kblock
    cols = b.sub(nrange[1], nrange[0])
    nb = ceil_div(b, cols, I64(blk.nc))
    ncb = b.mul(ceil_div(b, ceil_div(b, cols, smax(b, nb, I64(1))), I64(g.nr)), I64(g.nr))
    ldc = c.product(g.c.row if isinstance(g.c.row, tuple) else (g.c.row,)) if c_at is None else c_at[1]

    def sums(row, col):  # C's element (row, col): in the output, or in the scratch
        if c_at is None:
            return c.element(g.c.buf, g.c.offset_llvm(c, bidx, row, col))
        scratch, stride, row0, col0 = c_at
        return mk.gep(b, scratch, b.add(b.mul(b.sub(row, row0), stride), b.sub(col, col0)), g.product.acc)
    accumulate = b.icmp_signed(">", pc, I64(0))
    if ap is None:
        abase, axs, aks = a_direct(g, c, bidx)
        abase = mk.gep(b, abase, b.add(b.mul(ic, axs), b.mul(pc, aks)), dt)
    if bp is None:  # column x starts at x * bxs: 1 for a row-major B, K for Panels
        bbase, bxs, bks = g.b.direct_llvm(c, bidx)
        bbase = mk.gep(b, bbase, b.mul(pc, bks), dt)
    with for_range(b, nb, "gj") as jb:
        jc = b.add(nrange[0], b.mul(jb, ncb))
        nc = smin(b, ncb, b.sub(nrange[1], jc))
        if bp is not None:
            pack_panels(g, c, g.b, bp, bidx, jc, nc, pc, kc, g.nr)
        ngc = ceil_div(b, nc, I64(g.nr))
        ahead = next_rows(g, c, abase, axs, kc, ngc) if g.stream_a and ap is None and not blk.tiles \
            and _is_one(getattr(g.a, "k", None)) else None
        # a packed A is in MR-row panels, so only an A read in place has short tiles
        count, tile = row_tiles(b, mc, blk.mr, balanced=ap is None and not blk.tiles)
        with for_range(b, count, "gr") as ir_:
            i0, mv = tile(ir_)
            if ap is None:
                a = (mk.gep(b, abase, b.mul(i0, axs), dt), axs, aks)
                if edge is not None:
                    a = edge_rows(g, c, a, edge, kc, mv)
            else:
                a = (mk.gep(b, ap, b.mul(i0, kc), dt), *((kc, I64(1)) if blk.tiles else (I64(1), I64(blk.mr))))
            with for_range(b, ngc, "gc") as jr:
                j0 = b.mul(jr, I64(g.nr))
                if ahead is not None:
                    ahead(b.add(i0, mv), jr)
                out = sums(b.add(ic, i0), b.add(jc, j0))
                bt = (mk.gep(b, bp, b.mul(j0, kc), dt), I64(g.nr)) if bp is not None else \
                    (mk.gep(b, bbase, b.mul(b.add(jc, j0), bxs), dt), bks)
                args = [*a, *bt, kc, out, ldc, mv, smin(b, I64(g.nr), b.sub(nc, j0)), accumulate]
                if blk.tiles:
                    tiled(g, c, args, bp is None, a_rows=True)
                else:
                    micro_tile(g, c, args, bp is None, short=ap is None and short_tiles(g))
            if g.epilogue is not None:
                with b.if_then(last):
                    row = b.add(ic, i0)
                    if c_at is None:
                        g.epilogue(c, bidx, row, mv, jc, nc)
                    else:  # the block's sums are in the scratch
                        g.epilogue(c, bidx, row, mv, jc, nc, acc=(sums(row, jc), ldc))


# rows of A shorter than this many lines (128 float32 k) are not prefetched: their tile's
# microkernel calls are short, and the prefetch loops cost a share of them; the hardware
# prefetcher covers a few lines. MobileNetV2 (its 1x1s reduce 16-160 channels; weights
# in cache) 1.03x the time with them prefetched
STREAM_MIN_LINES = 8


def next_rows(g, c, abase, axs, kc, ngc):
    """``fetch(i1, jr)`` for a streamed A (:attr:`.gemm.Gemm.stream_a`, rows contiguous
    along k): prefetch share ``jr`` of ``ngc`` (the column tiles of a row tile) of the
    lines of the ``MR`` rows from row ``i1`` (``kc`` units each from ``abase``'s column),
    so the next row tile's weights arrive from memory while this one computes, not in a
    burst its first column tile waits for (the hardware prefetcher runs only a little
    ahead of a stream that pauses). Into L2 (the rows of a tile are ~6 KB). Rows past
    A's end are other memory: a prefetch never faults, and its address is not
    ``inbounds``. Measured on Zen 5, 2 threads, one process, builds in turns: 24 pairs
    of 1x1 256->1024->256 on 14x14 with their own weights (48 MB) 0.955-0.968x the time
    (one shared pair, hot weights: level); 12 pairs of Winograd 3x3 256 on 14x14 (54 MB)
    0.90x; ResNet-50 0.984x. Only for a weight: BERT's products, whose A is the
    activations, ran 1.05x slower with it (and with B's next panels prefetched alike,
    1.05x slower too: not done)."""
    b, elem = c.b, lookup_dtype(g.product.unit)
    lines = ceil_div(b, b.mul(kc, I64(elem.nbytes)), I64(64))
    per = ceil_div(b, lines, ngc)
    on = b.icmp_signed(">=", lines, I64(STREAM_MIN_LINES))  # hoisted out of the tiles' loops
    if isinstance(g.stream_a, str):  # the engine's run-time flag
        on = b.and_(on, b.icmp_unsigned("!=", c.syms[g.stream_a], I64(0)))

    def rows(i1, jr):
        lo = b.mul(jr, per)
        hi = smin(b, b.add(lo, per), lines)
        for r in range(g.blocking.mr):
            row = b.gep(abase, [b.mul(b.add(i1, I64(r)), axs)], source_etype=elem.ir)
            with for_range(b, hi, "pf", start=lo) as line:
                at = b.gep(row, [b.mul(line, I64(64 // elem.nbytes))], source_etype=elem.ir)
                mk.prefetch(b, at, locality=2)

    def fetch(i1, jr):
        with b.if_then(on):
            rows(i1, jr)
    return fetch


def row_tiles(b, rows, mr: int, balanced: bool):
    """Split ``rows`` into register tiles: ``(count, tile)``, ``tile(t) -> (first row,
    rows)``. Plain: tiles of ``mr`` and one edge of ``rows % mr``. Balanced (``mr > 1``):
    when ``rows % mr = r > 0`` and there are enough rows, the last ``mr - r`` tiles have
    ``mr - 1`` rows instead, so no tile is a thin edge. An edge of 2 rows costs nearly a
    full tile's time (the kernel is load-bound, or computes clamped rows), where a tile of
    ``mr - 1`` rows runs at the full tile's speed per row: BERT's 128 rows (6x64 tiles)
    ran at 220 GFLOP/s against 226 for 126 rows (Zen 4, 2 threads, 128x768x768)."""
    plain = ceil_div(b, rows, I64(mr))
    if not balanced or mr < 2:
        return plain, lambda t: (b.mul(t, I64(mr)), smin(b, I64(mr), b.sub(rows, b.mul(t, I64(mr)))))
    r = b.srem(rows, I64(mr))
    short = b.select(b.icmp_signed("==", r, I64(0)), I64(0), b.sub(I64(mr), r))
    short = b.select(b.icmp_signed(">=", rows, b.mul(short, I64(mr - 1))), short, I64(0))
    whole = b.sdiv(b.sub(rows, b.mul(short, I64(mr - 1))), I64(mr))  # exact when short > 0
    whole = b.select(b.icmp_signed(">", short, I64(0)), whole, plain)

    def tile(t):
        first = b.sub(b.mul(t, I64(mr)), smax(b, I64(0), b.sub(t, whole)))
        height = b.select(b.icmp_signed("<", t, whole), I64(mr), I64(mr - 1))
        return first, smin(b, height, b.sub(rows, first))
    return b.add(whole, short), tile


def short_tiles(g) -> bool:
    """Whether :func:`row_tiles` may make tiles of ``mr - 1`` rows for ``g``: M is
    symbolic, or static and not a multiple of ``mr`` (a chunk of an M split is a multiple
    of ``mr`` rows but for the last)."""
    size = static_size(g.m)
    return g.blocking.mr > 1 and (size is None or size % g.blocking.mr != 0)


def _edges(dim, width: int) -> list[int]:
    """Edge-tile sizes worth a kernel of their own along a side of ``width``: the
    remainder when the side is static, else 1 (a vector: M=1 inference, N=1)."""
    dims = dim if isinstance(dim, tuple) else (dim,)
    if all(isinstance(d, int) for d in dims):
        rem = reduce(lambda x, y: x * y, dims, 1) % width
        return [rem] if rem else []
    return [1]


IN_PLACE_MIN_ROW_BYTES = 256  # see b_in_place


def b_in_place(g) -> bool:
    """Read B in place (no packing) when its rows are contiguous and a micro-panel's row
    segment (NR elements) is at least 4 cache lines: the panel's ``kc`` segments then
    stream from L2 as fast as a packed panel, and packing is saved. Shorter segments,
    one line each ``N`` elements apart, stream badly. Measured on znver4, one process,
    exported builds alternating: AVX-512 float32 (NR = 64, 256 B) in place 217 vs packed
    204 GFLOP/s at 64x1024x1024, 222 vs 218 at 500x512x1536, equal at 2048^3; AVX2
    (NR = 16, 64 B) packed 172 vs 157, 212 vs 193 and 190 vs 150."""
    if isinstance(g.b, Panels):  # in place when packed for this engine's NR
        return g.b.width == g.nr and g.b.group == g.product.group
    if getattr(g.b, "packed", False) or g.product.group > 1:  # units are packed interleaved
        return False
    nbytes = g.nr * lookup_dtype(g.dtype).nbytes
    return getattr(g.b, "contiguous_x", False) and nbytes >= IN_PLACE_MIN_ROW_BYTES


def micro_tile(g, c, args, in_place: bool, short: bool = False) -> None:
    """Call the microkernel sized for this tile: the full one, with ``short`` the full one
    of ``mr - 1`` rows (:func:`row_tiles`), or for an edge tile the cheapest variant
    covering it (so M=1 or N=10 does not pay for MR rows / NR columns). B read in place is
    read with masks at edges (a packed panel is zero-padded)."""
    b, blk, dt, vl = c.b, g.blocking, g.dtype, mk.lanes(g.product.acc)
    if blk.tiles:  # a caller of its own (fused attention): vector strips, no tiles configured
        tiled(g, c, args, in_place, a_rows=False)
        return
    mv, nvalid = args[8], args[9]
    nvec = ceil_div(b, nvalid, I64(vl))
    rows = sorted({blk.mr, *_edges(g.m, blk.mr)})
    col_edges = _edges(g.n, g.nr)
    cols = sorted({blk.nv, *(-(-e // vl) for e in col_edges)})
    variants = sorted(((r, v) for r in rows for v in cols), key=lambda rv: rv[0] * rv[1])
    if static_size(g.m) is not None and not col_edges:
        # no N edge and every row edge has its kernel: a tile of MR rows is always full
        # (B packed or in place: 56 of the 211 KB of IR of BERT's attention region)
        variants.remove((blk.mr, blk.nv))
    done = b.append_basic_block("micro.done")
    whole_n = b.icmp_signed("==", nvalid, I64(g.nr))
    for height in [blk.mr] + ([blk.mr - 1] if short else []):  # whole tiles: unrolled, unmasked
        with b.if_then(b.and_(b.icmp_signed("==", mv, I64(height)), whole_n), likely=True):
            b.call(mk.microkernel(c.module, dt, height, blk.nv, blk.unroll, False, full=True), args)
            b.branch(done)
    for r, v in variants:
        fits = b.and_(b.icmp_signed("<=", mv, I64(r)), b.icmp_signed("<=", nvec, I64(v)))
        with b.if_then(fits):
            b.call(mk.microkernel(c.module, dt, r, v, EDGE_UNROLL, in_place), args)
            b.branch(done)
    b.unreachable()  # the last variant is the full tile: every edge tile fits
    b.position_at_end(done)


def pack_panels(g, c, operand, dst, bidx, x0, nx, k0, kc, width) -> None:
    """Pack ``nx`` rows (A) or columns (B) from ``x0`` into ``width``-wide panels: all at
    once where the operand packs them so (:meth:`.gemm.Strided.pack_all_llvm`), else
    one panel at a time."""
    b, grouped = c.b, g.product.group > 1
    if hasattr(operand, "pack_panels_llvm"):  # it packs itself (a conv's windows: kernels.conv_panels)
        operand.pack_panels_llvm(g, c, dst, bidx, x0, nx, k0, kc, width)
        return
    packs_all = units.pack_all_units(g, operand, c, dst, bidx, x0, nx, k0, kc, width) if grouped \
        else operand.pack_all_llvm(c, dst, bidx, x0, nx, k0, kc, width)
    if packs_all:
        return
    pack = partial(units.pack_units, g, operand) if grouped else operand.pack_llvm
    with for_range(b, ceil_div(b, nx, I64(width)), "gq") as q:
        r0 = b.mul(q, I64(width))
        pack(c, mk.gep(b, dst, b.mul(r0, kc), g.product.unit), bidx, b.add(x0, r0),
             smin(b, I64(width), b.sub(nx, r0)), k0, kc, width)


def k_units(g, c) -> ir.Value:
    """K in the product's units (:mod:`.products`): ``ceil(K / group)``, the last one
    padded with zeros by the packers."""
    k = extent(c, g.k)
    group = g.product.group
    return k if group == 1 else ceil_div(c.b, k, I64(group))


def a_in_place(g) -> bool:
    """Whether A is read where it lies, never packed: any dense A of a float product; for
    units of ``group`` k, one whose rows hold whole units (k contiguous; its row stride
    and K static multiples of ``group``: no unit reads past a row)."""
    group = g.product.group
    if group == 1 or not isinstance(g.a, Strided):
        return group == 1 and hasattr(g.a, "direct_llvm")
    row, k = static_size(g.a.x), static_size(g.k)
    return _is_one(g.a.k) and row is not None and k is not None and row % group == 0 and k % group == 0


def a_direct(g, c, bidx) -> tuple:
    """A's pointer and strides in units (see :func:`a_in_place`)."""
    ptr, axs, aks = g.a.direct_llvm(c, bidx)
    group = g.product.group
    return (ptr, axs, aks) if group == 1 else (ptr, I64(static_size(g.a.x) // group), I64(1))
