"""The direct convolution on AMX tiles: the pixel engine's packed input
(:mod:`.conv_engine`), multiplied by the tile kernel tap by tap, no windows gathered.

On tiles a convolution had run as a matrix product on its windows gathered into the
product's panels (:mod:`jitbyoc.kernels.conv_panels`): nine copies of a 3x3 conv's input
written and read back, and the product's C loaded and stored in its tiles once per block
of k. Here, as oneDNN's brgemm convolutions do, every tap reads the input where it lies:

1. *Pack*: each thread packs the input rows of its bands in units (:mod:`.conv_units`: a
   bfloat16 pair, a uint8 quad of channels at a pixel is one 32-bit unit), the units
   padded with zero channels to whole blocks of 16 (a tile's rows of k), into a layout
   of :mod:`.conv_plan` (:func:`layout`): dense planes, one per kernel column, as wide
   as the grid rounded up to 16 units, so that every tap's shift is whole rows and B's
   64-byte rows lie on whole cache lines (plane 0 packed, the others copied from it,
   :meth:`Emit.pack_rows`); or, where that wastes too many columns (a 7x7 map), the grid.
   Tap ``t`` of grid pixel ``p`` is unit ``p + tap(t)`` of each channel unit's planes,
   whatever the stride or dilation.
2. *Multiply*: per block of 32 output channels and 32 consecutive grid pixels, one call
   of :class:`.gemm_tiles.TapTiles`: for each tap, B's 16 x 16 tiles are read straight
   from the packed input (16 channel units, one per plane, 16 pixels on from the tap's
   shift) and A's from the weight packed tile by tile at build time
   (:func:`jitbyoc.kernels.conv_panels.tile_packed`: each 16 x 16 tile 1 KB in one
   piece, a block's tiles one stream); C stays in the tiles across every tap and channel
   and is stored once, into a 4 KB scratch.
3. *Epilogue*: the region's callback takes each block's scratch (:func:`_block_sums`):
   row by row of the output the block's pixels fall in (the grid's halo columns and the
   pixels past the band dropped), the fused epilogue reads the sums there and writes its
   stores; without one, the sums are stored.

A tile kernel fed from its cache lines ran at 2200-2500 GFLOP/s of one core's 3000 (this
Xeon, bf16, both operands in L1), 1500-1800 with B's rows 4 bytes off their lines; A's
rows of a tap-major weight 4.6 KB apart (256 channels), streamed from L2, held it to
about 1000, packed tile by tile 1800.

A 32-pixel block at a band's end reads up to 31 units past the band's last grid pixel:
into rows the band does not use, the next channel unit, or the workspace's slack; those
columns of C are never stored. The sums of a bfloat16 conv are taken in another order than
the gathered product's (tile by tile of 16 units, tap after tap); integer sums are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I64, PTR
from ..render.loops import ceil_div, copy_bytes, for_range, smax, smin
from ..render.vectors import lanes, strips, vload, vstore
from . import conv_engine, gemm_tiles, registry
from .conv_plan import Layout, Plan
from .products import PRODUCTS

TILE = 32  # output channels and grid pixels per kernel call: 2 x 2 tiles of 16
UNITS = gemm_tiles.TILE_BYTES // gemm_tiles.UNIT_BYTES  # channel units per tile row of k (16)
ROWS = gemm_tiles.TILE_ROWS  # output channels per tile (16)
# tasks of a conv at least (bands of an image times blocks of 32 channels): 256 on 14x14
# (8 blocks) in one band ran in 0.150 ms, in two 0.175
MIN_TASKS = 8
SLACK = 2 * TILE  # units after an image's packed input that a band's last block may read
# channel units padded to whole blocks of 16 for at most this much more work; beyond it
# the gathered product (which pads to one unit) runs the conv
MAX_PADDING = 1.25
# Where a conv runs here, by its product: a strided conv only with an output map of at
# most STRIDED_PIXELS (every stride phase of the input is packed, a plane each, where the
# gathered product reads the windows it needs); on the grid layout (a 7x7 map, whose B
# rows sit across cache lines) or not; and with at least MIN_STEPS blocks of 16 units per
# tap (a kernel call on few taps' short reductions costs its C tiles' drain and store and
# the epilogue per block, as the gathered product's long reductions do not). Measured on
# ResNet-50's 3x3 convs (isolated, ms, gathered -> here, two runs each): bf16 256 on
# 14x14 0.27-0.30 -> 0.15, 512 on 7x7 0.32-0.35 -> 0.23-0.24, 128 on 28x28 0.20 -> 0.17,
# 64 on 56x56 0.21-0.22 -> 0.19-0.21 (in the model level, 0.49-0.51 -> 0.52 ms for its 3
# calls, and Inception v1's region of 64 -> 192 on 55x55 with its LRN 1.46 -> 1.66 ms);
# strided 512 14x14 -> 7x7 0.38 -> 0.30, 256 28x28 -> 14x14 0.33 -> 0.28, 128 56x56 ->
# 28x28 0.26 -> 0.29. int8 in the QDQ model (jitbyoc.profile, 5/2/3/3 calls): 256 on
# 14x14 0.848 -> 0.615 ms, but 512 on 7x7 0.470 -> 0.500, 128 on 28x28 (2 steps a tap)
# 0.389 -> 0.428, 64 on 56x56 0.456 -> 0.578.
STRIDED_PIXELS = 256
GRID = {"bfloat16": True, "int8": False}
MIN_STEPS = {"bfloat16": 3, "int8": 4}
ALIGNED_WASTE = 1.25  # columns of the aligned layout, at most this many times the grid's
# the input's product (A: the packed input) -> the tile product, whose A is the weight
INPUTS = {"bfloat16": "bfloat16", "uint8": "int8"}


def units(geo, weight_dtype: str) -> int:
    """Channel units of a group as the engine packs them: whole blocks of :data:`UNITS`."""
    group = PRODUCTS[weight_dtype].group
    return -(-geo.cg // (group * UNITS)) * UNITS


def fits(geo, weight_dtype: str) -> bool:
    """Whether the engine runs ``geo`` on ``weight_dtype`` weights (tap-major, on tiles):
    one group, a window of several taps, output channels in whole tiles of 16, and
    channels that fill their units' blocks of 16 but for :data:`MAX_PADDING`."""
    if weight_dtype not in INPUTS.values() or not gemm_tiles.has_tiles(weight_dtype):
        return False
    group, count = PRODUCTS[weight_dtype].group, units(geo, weight_dtype)
    return (geo.groups == 1 and geo.taps > 1 and geo.kg % ROWS == 0 and count <= MAX_PADDING * geo.cg / group
            and count >= MIN_STEPS[weight_dtype] * UNITS and (GRID[weight_dtype] or layout(geo).dense)
            and (geo.stride == (1, 1) or geo.oh * geo.ow <= STRIDED_PIXELS))


@registry.kind
@dataclass(frozen=True)
class TileConv(conv_engine.ConvKind):
    """The engine: called with :data:`.conv_engine.NAMES` as the pixel engine is, the
    workspace in whole blocks of channel units (:func:`units`); its callback ``epi``
    takes each block's sums (:func:`call`)."""
    kind = "tileconv"
    dtype: str  # the input's product (INPUTS)
    lanes: ClassVar[int] = 16  # what the pixel engine's packing reads of an engine

    def body(self, bufs: dict):
        return Emit(self, bufs)


class Emit(conv_engine.Emit):
    def channels(self, c) -> ir.Value:
        b, group = c.b, self.product.group
        return b.mul(ceil_div(b, c.syms["cg"], I64(group * UNITS)), I64(UNITS))

    def pack_rows(self, c, n, ch, r0, r1) -> None:
        """Rows ``r0 .. r1`` of every plane of channel unit ``ch``. In the aligned layout
        (:func:`layout`) of a stride-1 conv, plane ``j`` (kernel column ``j``) is plane 0
        read ``j * dilation`` columns on: packed once, then copied in one run per plane
        (the columns a row's copy takes from the next row are past the map)."""
        b, s = c.b, c.syms
        one = lambda v: b.icmp_signed("==", v, I64(1))  # noqa: E731
        shifted = b.and_(b.icmp_signed(">", s["planes"], I64(1)), b.and_(one(s["sh"]), one(s["sw"])))
        with b.if_else(shifted) as (copied, packed):
            with copied:
                self.pack_plane(c, n, ch, I64(0), r0, r1)
                first = b.add(self.plane_at(c, n, ch, I64(0)), b.mul(r0, s["wq"]))
                column = self.plane_fields(c, I64(0))[1]
                count = b.mul(b.sub(r1, r0), s["wq"])
                with for_range(b, s["planes"], "p", start=I64(1)) as p:
                    shift = b.sub(self.plane_fields(c, p)[1], column)
                    to = b.add(self.plane_at(c, n, ch, p), b.mul(r0, s["wq"]))
                    copy_bytes(b, c.element(self.bufs["work"], to), c.element(self.bufs["work"], b.add(first, shift)),
                               b.mul(count, I64(self.elem.nbytes)))
            with packed:
                super().pack_rows(c, n, ch, r0, r1)

    def run(self, ctx) -> None:
        self.banded(ctx, ceil_div(ctx.b, ctx.syms["kg"], I64(TILE)), pack=True)

    def task(self, c, t) -> None:
        """Output channels ``32 * block ..`` of a band (``t``: :meth:`banded`'s task), block
        by block of 32 grid pixels, each block's sums handed to the region's callback
        ``epi(env, image, oc0, channels, p0, end, sums)`` (grid pixels ``p0 .. end``; the
        sums' rows 32 elements apart)."""
        b, s = c.b, c.syms
        blocks = ceil_div(b, s["kg"], I64(TILE))
        blk, unit = b.srem(t, blocks), b.sdiv(t, blocks)
        _, band, n = self.unit_of(c, unit)  # one group
        oc0 = b.mul(blk, I64(TILE))
        jn = smin(b, I64(TILE), b.sub(s["kg"], oc0))
        r0 = b.mul(band, s["rows"])
        r1 = smin(b, b.add(r0, s["rows"]), s["oh"])
        pstart = b.mul(r0, s["wq"])
        pend = b.add(b.mul(b.sub(r1, I64(1)), s["wq"]), s["ow"])
        cu = self.channels(c)
        ktaps = b.mul(cu, s["taps"])
        with b.goto_block(b.function.entry_basic_block):
            sums = b.alloca(ir.ArrayType(lookup_dtype(self.product.acc).ir, TILE * TILE))
            sums.align = 64
        weight = c.element(self.bufs["w"], b.mul(oc0, ktaps))  # the block's first tile (16 rows of ktaps)
        taps = b.inttoptr(s["taptab"], PTR)
        gemm_tiles.configure(b)
        with for_range(b, ceil_div(b, b.sub(pend, pstart), I64(TILE)), "chunk") as k:
            p0 = b.add(pstart, b.mul(k, I64(TILE)))
            bp = c.element(self.bufs["work"], b.add(b.mul(n, s["img"]), p0))
            args = [weight, b.mul(ktaps, I64(ROWS)), b.mul(cu, I64(ROWS)), bp, s["chan"], b.sdiv(cu, I64(UNITS)),
                    s["taps"], taps, b.bitcast(sums, PTR), I64(TILE)]
            self.multiply(b, jn, b.sub(pend, p0), args)
            end = smin(b, b.add(p0, I64(TILE)), pend)
            registry.call_back(b, s["epi"], s["env"], [n, oc0, jn, p0, end, b.ptrtoint(sums, I64)])
        gemm_tiles.release(b)

    def multiply(self, b, jn, left, args) -> None:
        """The kernel call on 1 or 2 tiles of output channels (``jn``) and of pixels
        (``left`` up to the band's end): a half tile costs what a whole one does."""
        dt = PRODUCTS[self.e.dtype].b  # the weight's: the tile product's A
        with b.if_else(b.icmp_signed(">", jn, I64(ROWS))) as (two, one):
            for rows, branch in ((2, two), (1, one)):
                with branch, b.if_else(b.icmp_signed(">", left, I64(UNITS))) as (full, half):
                    for cols, inner in ((2, full), (1, half)):
                        with inner:
                            b.call(gemm_tiles.tap_tile_kernel(b.module, dt, rows, cols), args)


def layout(geo) -> Layout:
    """The packed input's layout: dense planes a whole number of tile rows wide, so that
    every tap reads B's rows on whole cache lines, unless that wastes more than the grid
    (a 7x7 map: 16 columns of 7, against the grid's 9)."""
    grid = Layout(geo, False)
    aligned = Layout(geo, True, -(-grid.wq // UNITS) * UNITS)  # as wide as the grid: see Emit.pack_rows
    return aligned if aligned.wq <= ALIGNED_WASTE * grid.wq else grid


def band_rows(geo, lay: Layout) -> int:
    """Output rows per band: enough bands for :data:`MIN_TASKS` tasks (a band's blocks of
    32 channels), each a whole number of 32-pixel blocks where the rows allow (a 14x14
    map, 16 grid columns, in two bands of 7 rows ended each in a half block)."""
    batch = geo.n if isinstance(geo.n, int) else 1
    bands = min(geo.oh, math.ceil(MIN_TASKS / (batch * math.ceil(geo.kg / TILE))))
    rows = math.ceil(geo.oh / bands)
    whole = TILE // math.gcd(TILE, lay.wq)  # rows of whole blocks
    return min(geo.oh, -(-rows // whole) * whole) if whole <= rows else rows


def call(stage, ctx) -> None:
    """Emit the engine's call for ``stage`` (a :class:`~jitbyoc.kernels.conv2d.Conv2d`
    whose weight is tap-major in :func:`units`, :func:`fits`)."""
    g, dt = stage.geo, stage.inputs[0].dtype
    lay = layout(g)
    plan = Plan(lay, TileConv.lanes, TILE, 2, band_rows(g, lay))
    img = units(g, stage.inputs[1].dtype) * plan.layout.channel_size() + SLACK
    body = lambda c, args: _block_sums(stage, plan.layout.wq, c, args)  # noqa: E731
    conv_engine.call(stage, ctx, plan, TileConv(dt), img=img, callback=(6, body))


def _block_sums(stage, wq: int, c, args) -> None:
    """The region's side of a block: the sums of grid pixels ``p0 .. end`` (``args``, see
    :meth:`Emit.task`), row by row of the output they fall in, through the epilogue
    straight from the scratch (``out``, when the epilogue writes elsewhere, is a temp of
    sums only it reads: :attr:`jitbyoc.engines.gemm.Gemm.private_c`), or stored to
    ``out`` when there is none."""
    n, oc0, jn, p0, end, at = args
    b, g, out = c.b, stage.geo, stage.out
    acc = lookup_dtype(out.dtype).storage_ir
    sums = b.inttoptr(at, PTR)
    epilogue = bool(stage.epilogue_stores())
    with for_range(b, b.add(b.sdiv(b.sub(end, I64(1)), I64(wq)), I64(1)), "row", start=b.sdiv(p0, I64(wq))) as r:
        first = b.mul(r, I64(wq))
        lo, hi = smax(b, p0, first), smin(b, end, b.add(first, I64(g.ow)))
        with b.if_then(b.icmp_signed(">", hi, lo)):
            row = b.gep(sums, [b.sub(lo, p0)], source_etype=acc)
            origin = [n, oc0, r, b.sub(lo, first)]  # (conv1d runs elsewhere: conv2d.ConvGeometry.tiles)
            if epilogue:
                extent = [1, jn, 1, b.sub(hi, lo)]
                c.epilogue(stage, origin, extent, acc=(row, I64(TILE), 1))
            else:
                _store_rows(c, out, origin, row, jn, b.sub(hi, lo))


def _store_rows(c, out, origin, sums, rows, count) -> None:
    """``out`` at ``origin`` and the next ``rows`` channels on: ``count`` sums of each row
    of ``sums`` (rows :data:`TILE` elements apart)."""
    b, dt = c.b, out.dtype
    element = lookup_dtype(dt).storage_ir
    with for_range(b, rows, "j") as j:
        to = c.element(out, c.offset(out.shape, [origin[0], b.add(origin[1], j)] + origin[2:]))
        src = b.gep(sums, [b.mul(j, I64(TILE))], source_etype=element)
        strips(b, I64(0), count, lanes(dt), lambda i, mask: vstore(
            b, vload(b, b.gep(src, [i], source_etype=element), dt, mask),
            b.gep(to, [i], source_etype=element), dt, mask))
