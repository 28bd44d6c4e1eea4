"""A block of a GEMM on AMX tiles (:mod:`.gemm_tiles`' kernel): 32x32 tiles in steps of
16 units of k, edges through a scratch C tile and a zero-padded copy of A's rows, the
last ``k mod 16`` units as one more step on zero-padded copies, in the same call; a
reduction under one step on the vector kernel in strips of
:data:`.gemm_tiles.STRIP_ROWS` rows. :mod:`.gemm_llvm` calls it for each tile of a
blocking with ``tiles``."""

from __future__ import annotations

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I64, PTR
from ..render.loops import ceil_div, for_range, smin
from ..render.vectors import lane_mask, splat, vload, vstore
from . import gemm_micro as mk
from . import gemm_tiles as tiles
from .gemm_micro import EDGE_UNROLL


def tiled(g, c, args, in_place: bool, a_rows: bool) -> None:
    """A tile of an AMX blocking (:mod:`.gemm_tiles`) on the tile kernel when A's rows hold
    k contiguous and a whole tile's rows are readable (``a_rows``; an edge's through
    :func:`edge_rows` and a scratch C): k in steps of 16 units, the last ``kc mod 16`` as
    one more step on zero-padded copies (:func:`_tail_copies`), in the same call. A tile
    with ``a_rows`` False (fused attention's), or with k under one step (SqueezeNet's 1x1
    convolutions of 16-48 channels: 1.07x the time on tiles), runs on the vector kernel."""
    b, blk, dt = c.b, g.blocking, g.product.unit
    a, axs, aks, bp, bks, kc, out, ldc, mv, nvalid, accumulate = args
    if a_rows:  # A has MR readable rows: an edge's are copied and zero-padded (edge_rows)
        step = I64(tiles.TILE_BYTES // 4)
        steps = b.sdiv(kc, step)
        done = b.mul(steps, step)
        rest = b.sub(kc, done)
        kernel = tiles.tile_kernel(c.module, g.dtype)
        whole = b.and_(b.icmp_signed("==", nvalid, I64(g.nr)), b.icmp_signed("==", mv, I64(blk.mr)))

        def run(operands, acc):
            with b.if_else(whole, likely=True) as (then, otherwise):
                with then:
                    b.call(kernel, [*operands, out, ldc, acc])
                with otherwise:  # B is packed, zeros past N: a whole tile into a scratch C
                    _edge_tile(g, c, operands, (out, ldc), (mv, nvalid), acc)

        tail, null = b.icmp_signed(">", rest, I64(0)), ir.Constant(PTR, None)
        with b.if_else(b.icmp_signed(">", steps, I64(0)), likely=True) as (then, otherwise):
            with then:
                a_tail, b_tail = _tail_copies(g, c, mk.gep(b, a, done, dt), axs,
                                              mk.gep(b, bp, b.mul(done, bks), dt), bks, rest)
                run([a, axs, bp, bks, steps, b.select(tail, a_tail, null), b.select(tail, b_tail, null)],
                    accumulate)
            with otherwise:  # less than a step of k: the copies and C's trip cost more than vectors
                _strips(g, c, args, in_place)
        return
    _strips(g, c, args, in_place)


def _strips(g, c, args, in_place: bool) -> None:
    """The tile on the vector kernel, in strips of :data:`.gemm_tiles.STRIP_ROWS` rows."""
    b, blk, dt = c.b, g.blocking, g.product.unit
    a, axs, aks, bp, bks, kc, out, ldc, mv, nvalid, accumulate = args
    with b.if_then(b.icmp_signed(">", kc, I64(0))):
        strip = mk.microkernel(c.module, g.dtype, tiles.STRIP_ROWS, blk.nv, EDGE_UNROLL, in_place)
        with for_range(b, ceil_div(b, mv, I64(tiles.STRIP_ROWS)), "ts") as t:
            r0 = b.mul(t, I64(tiles.STRIP_ROWS))
            b.call(strip, [mk.gep(b, a, b.mul(r0, axs), dt), axs, aks, bp, bks, kc,
                           mk.gep(b, out, b.mul(r0, ldc), g.product.acc), ldc,
                           smin(b, I64(tiles.STRIP_ROWS), b.sub(mv, r0)), nvalid, accumulate])


def _tail_copies(g, c, a, axs, bp, bks, rest) -> tuple:
    """The last ``rest < 16`` units of k as one whole tile step: A's ``MR`` rows of them
    and B's ``rest`` rows of ``NR`` units copied into scratch tiles, zero past ``rest``
    (so what the step reads past k multiplies zeros), read by the same tile-kernel call
    as the whole steps. On the vector kernel, an int8 784x480x256 product (120 units: 7
    steps and 8 more, Inception v1's 480 channels) took 0.065 ms, 0.046 this way;
    784x528x256 0.061 -> 0.056; Inception v1 and SqueezeNet QDQ level."""
    b, blk, dt = c.b, g.blocking, g.product.unit
    vl = mk.lanes(dt)  # 16 units: one tile row of A
    a_tail, b_tail = _scratch(b, dt, blk.mr * vl), _scratch(b, dt, vl * g.nr)
    with b.if_then(b.icmp_signed(">", rest, I64(0))):
        _padded_rows(g, c, (a, axs, I64(blk.mr)), rest, (a_tail, I64(vl)), I64(blk.mr))
        _padded_rows(g, c, (bp, bks, rest), I64(g.nr), (b_tail, I64(g.nr)), I64(vl))
    return b.bitcast(a_tail, PTR), b.bitcast(b_tail, PTR)


def _scratch(b, dtype: str, count: int) -> ir.Value:
    """A 64-byte-aligned stack array of ``count`` elements of ``dtype``, made in the entry
    block (once per call of the function, though asked for inside loops)."""
    entry = ir.IRBuilder(b.function.entry_basic_block)
    entry.position_at_start(b.function.entry_basic_block)
    array = entry.alloca(ir.ArrayType(lookup_dtype(dtype).storage_ir, count))
    array.align = 64
    return array


def _padded_rows(g, c, src, units, dst, rows) -> None:
    """``rows`` rows of ``units`` units (the product's unit) copied from ``src = (pointer,
    row stride, live rows)`` into ``dst = (pointer, width)``, rows ``width`` apart: zero
    past ``units`` and in the rows from ``live rows`` on (the zero padding the tile
    kernel's whole tiles read)."""
    b, dt = c.b, g.product.unit
    (ptr, stride, live_rows), (out, width) = src, dst
    vl = mk.lanes(dt)
    with for_range(b, rows, "pr") as r:
        live = splat(b, b.icmp_signed("<", r, live_rows), vl)
        with for_range(b, ceil_div(b, width, I64(vl)), "pk") as v:
            k0 = b.mul(v, I64(vl))
            row = vload(b, mk.gep(b, ptr, b.add(b.mul(r, stride), k0), dt), dt,
                        b.and_(lane_mask(b, b.sub(units, k0), vl), live), vl)
            to = mk.gep(b, out, b.add(b.mul(r, width), k0), dt)
            vstore(b, row, to, dt, lane_mask(b, b.sub(width, k0), vl))


def _edge_tile(g, c, operands, c_at, valid, accumulate) -> None:
    """The tile kernel on a tile of ``rows x cols`` valid outputs, fewer than ``MR x NR``
    (A has MR readable rows, B zeros past N): C's valid part copied into a ``MR x NR``
    scratch when accumulating, the tiles of 16 that hold valid outputs computed there
    (:class:`.gemm_tiles.Tiles`' ``rows``, ``cols``), its valid part copied back.
    ResNet-50's 7x7 maps (49 columns: 32 and 17) ran a third of their columns on the
    vector kernel before, and ViT's 197 tokens (a 5-row edge) took 1.47x the time of 192."""
    b, blk, acc = c.b, g.blocking, g.product.acc
    (out, ldc), (rows, cols) = c_at, valid
    scratch = _scratch(b, acc, blk.mr * g.nr)
    vl = mk.lanes(acc)
    masks = [lane_mask(b, b.sub(cols, I64(j * vl)), vl) for j in range(blk.nv)]

    def copy(src, src_ld, dst, dst_ld):
        with for_range(b, rows, "er") as r:
            for j, mask in enumerate(masks):
                at = b.add(b.mul(r, src_ld), I64(j * vl))
                to = b.add(b.mul(r, dst_ld), I64(j * vl))
                vstore(b, vload(b, mk.gep(b, src, at, acc), acc, mask, vl), mk.gep(b, dst, to, acc), acc, mask)

    with b.if_then(accumulate):
        copy(out, ldc, scratch, I64(g.nr))
    # tiles of 16 along each side: one where the valid part fits in 16, else two
    one_row, one_col = (b.icmp_signed("<=", x, I64(tiles.TILE_ROWS)) for x in (rows, cols))
    row_tiles, col_tiles = {1: one_row, 2: b.not_(one_row)}, {1: one_col, 2: b.not_(one_col)}
    for tall in (1, 2):
        for across in (1, 2):
            with b.if_then(b.and_(row_tiles[tall], col_tiles[across])):
                kernel = tiles.tile_kernel(c.module, g.dtype, tall, across)
                b.call(kernel, [*operands, scratch, I64(g.nr), accumulate])
    copy(scratch, I64(g.nr), out, ldc)


def edge_rows(g, c, a, edge, kc, rows) -> tuple:
    """A's operand for a row tile: as it lies, or for an edge of ``rows < MR`` rows, those
    rows' ``kc`` units copied into ``edge`` (rows of ``kc``) and the rest of its ``MR``
    rows zero, so the tile kernel reads whole tiles (A read in place has no rows past M;
    on tiles its units are contiguous: ``aks`` is 1)."""
    b, blk = c.b, g.blocking
    ptr, axs, aks = a
    short = b.icmp_signed("<", rows, I64(blk.mr))
    with b.if_then(short):
        _padded_rows(g, c, (ptr, axs, rows), kc, (edge, kc), I64(blk.mr))
    return b.select(short, edge, ptr), b.select(short, kc, axs), b.select(short, I64(1), aks)
