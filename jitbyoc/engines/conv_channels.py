"""The direct convolution vectorized over *output channels*, for small maps (7x7, 14x14)
with long reductions, where vectors over pixels waste lanes: 49 pixels fill 49 of 64
lanes, in the GEMM engine's 1x1 products and the pixel engine's 7-wide rows alike.

A tile is ``R`` consecutive output pixels times ``V`` vectors of ``lanes`` output
channels, ``R * V`` vector accumulators. Per input channel and tap it costs ``V`` vector
loads of weights (packed at build time in blocks of ``lanes`` channels,
:mod:`jitbyoc.tvm.conv_weights`: one contiguous run per tap) and ``R`` broadcast pixels,
read from the *dense* layout of :mod:`.conv_plan` (one plane per kernel column and row
phase, exactly OW wide), where output pixel ``p`` of any stride reads plane element
``p + tap``: ``R`` consecutive pixels are ``R`` consecutive elements, row ends included.
A 1x1 convolution with unit stride and no padding reads its input in place.

A grouped convolution whose groups are whole vectors of channels (RegNet's groups of 16)
reads *padded planes* instead (:func:`.conv_channel_plan.padded_layout`: one plane a
channel, the input with its padding, packed by whole rows whatever the stride): a tile
is ``R`` pixels of one output row, pixel ``r`` at plane element ``r * stride`` from the
tile's first, and a row's last tile overlaps the one before it
(:func:`.conv_channel_plan.grouped_on_channels` says when). Plans and their cost model:
:mod:`.conv_channel_plan`.

Tasks are (image, group, block of ``V`` vectors of the group's channels, band of rows). No tile is
partial: a band's last tile of pixels ends at the band's end and the last block of
channels at channel ``ceil(K / lanes) * lanes``, recomputing what the one before
computed (the plan takes ``R`` and ``V`` that waste least, bands of at least ``R``
pixels but the last). A task stores only the channels and pixels it owns (a last band
shorter than a tile starts its tile in the band before), pixel by pixel from its finished
tiles (a transposed store: ``R * V * lanes`` scalars against ``R * V`` FMAs per channel
and tap), then hands its band to the region's epilogue callback, as :mod:`.conv_engine`
does. A task computes its tiles in groups, one block of input channels at a time for the
whole group (:meth:`_Emit.grouped`), so each weight comes from memory once per group of
tiles, not once per tile.

The element types are the product's (:mod:`.products`): a float row multiplies one
channel at a time with fused multiply-adds; bfloat16 pairs (``vdpbf16ps``) and uint8 x
int8 quads (``vpdpbusd``) take a *unit* of channels per step, the input packed in units
by the pixel engine's packing (:mod:`.conv_units`: a broadcast unit is one pixel's pair or
quad) and the weight in blocks of one vector of units (``lanes`` channels x a unit per
tap: one 64-byte load), summed in float32 or int32. Measured on Zen 4, 2 threads, a
3x3 512->512 on 7x7 alone: bf16 614 us (376 GFLOP/s, 81 % of the ``vdpbf16ps`` loop)
against 1320 in float32 on this engine and 0.74-0.82x float32's speed on the pixel
engine; int8 319 us (724 GOP/s) against 1054 gathered into columns; from 14x14 to 7x7
with stride 2, 360 against 652. A 1x1 in units packs its input too.

Accumulation order per output: input channel (unit), then the taps in row-major order,
as the pixel engine (:mod:`jitbyoc.kernels.conv2d`): the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..ir.llvmtypes import I64, PTR
from ..render.loops import ceil_div, for_range, smax, smin
from ..render.vectors import prefetch, splat
from . import conv_engine, registry
from .conv_channel_plan import TILE_GROUP, WEIGHT_BLOCK_KIB
from .conv_plan import unit_channels
from .gemm_micro import multiply_units


@registry.kind
@dataclass(frozen=True)
class ChannelEngine(conv_engine.ConvKind):
    """One engine per (dtype, lanes, R, V, direct, pointwise), on the pixel engine's
    parameters (sizes and tables at run time)."""
    kind = "convc"
    dtype: str
    lanes: int
    r: int
    v: int
    direct: int  # reads the input in place (ChannelPlan.direct): no packing
    pointwise: int  # one tap (1x1)
    group: int = TILE_GROUP
    block_kib: int = WEIGHT_BLOCK_KIB
    sh: int = 0  # > 0: padded planes (ChannelPlan.stride), tiles of one row
    sw: int = 0

    def body(self, bufs: dict):
        return _Emit(self, bufs)


class _Emit(conv_engine.Emit):
    """The engine's body (packing and the task pool are the pixel engine's)."""

    def run(self, ctx) -> None:
        s, b, e = ctx.syms, ctx.b, self.e
        self.banded(ctx, ceil_div(b, ceil_div(b, s["kg"], I64(e.lanes)), I64(e.v)), pack=not e.direct)

    def task(self, c, t) -> None:
        b, s, e = c.b, c.syms, self.e
        vec = ceil_div(b, s["kg"], I64(e.lanes))  # vectors of a group
        blocks = ceil_div(b, vec, I64(e.v))
        blk, unit = b.srem(t, blocks), b.sdiv(t, blocks)
        grp, band, n = self.unit_of(c, unit)
        first = smin(b, b.mul(blk, I64(e.v)), b.sub(vec, I64(e.v)))  # the group's first vector computed
        kb = b.add(b.mul(grp, vec), first)  # its block of the packed weight (a group is whole vectors)
        k0 = b.mul(grp, s["kg"])
        own0 = b.add(k0, b.mul(blk, I64(e.v * e.lanes)))  # first channel stored: the last block overlaps
        kend = b.add(k0, smin(b, s["kg"], b.mul(b.add(first, I64(e.v)), I64(e.lanes))))
        r0 = b.mul(band, s["rows"])
        r1 = smin(b, b.add(r0, s["rows"]), s["oh"])
        pstart, pend = b.mul(r0, s["ow"]), b.mul(r1, s["ow"])
        src = self.bufs["x" if e.direct else "work"]
        xbase = b.add(b.mul(n, s["img"]), b.mul(grp, b.mul(self.channels(c), s["chan"])))
        if e.sw:
            count, at, grid = self.row_tiles(c, r0, r1)
        else:
            count = ceil_div(b, b.sub(pend, pstart), I64(e.r))
            at = grid = lambda i: smin(b, b.add(pstart, b.mul(i, I64(e.r))), b.sub(pend, I64(e.r)))  # noqa: E731

        def accumulate(i, accs, lo, hi, ahead):
            self.accumulate(c, src, b.add(xbase, grid(i)), kb, accs, lo, hi, ahead)
        self.grouped(c, count, e.r * e.v, e.v * e.lanes * self.elem.nbytes, accumulate,
                     lambda i, accs: self.store_tile(c, accs, n, b.add(k0, b.mul(first, I64(e.lanes))),
                                                     own0, kend, at(i), None if e.sw else pstart))
        registry.call_back(b, s["epi"], s["env"], [n, own0, b.sub(kend, own0), r0, b.sub(r1, r0)])

    def row_tiles(self, c, r0, r1) -> tuple:
        """Padded planes: a tile is R pixels of one row, ``ceil(OW / R)`` a row, the last
        overlapping the one before. Returns the tiles of rows ``r0 .. r1``, and per tile
        ``i`` its first output pixel and its first plane element (``stride`` apart)."""
        b, s, e = c.b, c.syms, self.e
        per_row = ceil_div(b, s["ow"], I64(e.r))
        row = lambda i: b.add(r0, b.sdiv(i, per_row))  # noqa: E731
        col = lambda i: smin(b, b.mul(b.srem(i, per_row), I64(e.r)), b.sub(s["ow"], I64(e.r)))  # noqa: E731
        return (b.mul(b.sub(r1, r0), per_row),
                lambda i: b.add(b.mul(row(i), s["ow"]), col(i)),
                lambda i: b.add(b.mul(b.mul(row(i), I64(e.sh)), s["wq"]), b.mul(col(i), I64(e.sw))))

    def grouped(self, c, count, held, weight_bytes, accumulate, store) -> None:
        """Tiles ``0 .. count`` (``held`` vector accumulators each), in groups of
        ``group``: per group, one block of input channels at a time for every tile of the
        group (``accumulate(tile, accs, lo, hi)`` adds channels ``lo .. hi``; the tiles'
        sums wait in a stack buffer between blocks), then ``store(tile, sums)`` of each. A
        block's weights (``weight_bytes`` a channel and tap) are at most ``block_kib``:
        read from memory once for the group and from cache by its other tiles, where tile
        after tile re-read every weight of the layer per tile (a 7x7 3x3 512-channel
        layer's two vectors of channels have 590 KB of weights). The sums keep their
        order: channel by channel, as unblocked."""
        b, s, vt, channels = c.b, c.syms, self.acc_vt, self.channels(c)
        with b.goto_block(b.function.entry_basic_block):
            accs = [b.alloca(vt) for _ in range(held)]
            tiles = b.alloca(vt, self.e.group * held)
        block = smax(b, I64(1), b.sdiv(I64(self.e.block_kib * 1024), b.mul(s["taps"], I64(weight_bytes))))
        saved = lambda i: [b.gep(tiles, [b.add(b.mul(i, I64(held)), I64(k))], source_etype=vt)
                           for k in range(held)]
        group = I64(self.e.group)
        with for_range(b, ceil_div(b, count, group), "group") as g:
            first = b.mul(g, group)
            size = smin(b, group, b.sub(count, first))
            with for_range(b, ceil_div(b, channels, block), "kblock") as kb:
                lo = b.mul(kb, block)
                start = b.icmp_signed("==", lo, I64(0))
                with for_range(b, size, "tile") as i:
                    for a, sv in zip(accs, saved(i)):
                        b.store(b.select(start, ir.Constant(vt, None), b.load(sv, typ=vt)), a)
                    hi = smin(b, channels, b.add(lo, block))
                    ahead = (hi, smin(b, channels, b.add(hi, block)), i, size, b.icmp_signed("==", g, I64(0)))
                    accumulate(b.add(first, i), accs, lo, hi, ahead)
                    for a, sv in zip(accs, saved(i)):
                        b.store(b.load(a, typ=vt), sv)
            with for_range(b, size, "tile") as i:
                store(b.add(first, i), saved(i))

    def accumulate(self, c, src, xoff, kb, accs, lo, hi, ahead=None) -> None:
        """``accs[r*V + v]`` += input channels ``lo .. hi`` of vector ``kb + v`` at pixel
        ``r`` of the tile at ``xoff``; with ``ahead`` (the next block's channels ``lo ..
        hi``, this tile ``i`` of ``size``, whether this is the group's first pass), reading
        the next block's weights ahead (:meth:`fetch_ahead`)."""
        b, s, e = c.b, c.syms, self.e
        taps = b.inttoptr(s["taptab"], PTR)
        run = b.mul(b.mul(self.channels(c), s["taps"]), I64(e.lanes))  # one vector's weights

        def channels(fetch) -> None:
            with for_range(b, hi, "ic", start=lo) as ic:
                xp = c.element(src, b.add(xoff, b.mul(ic, s["chan"])))
                first = b.mul(b.mul(ic, s["taps"]), I64(e.lanes))
                wps = [c.element(self.bufs["w"], b.add(b.mul(b.add(kb, I64(v)), run), first))
                       for v in range(e.v)]
                if e.pointwise:  # one tap at offset 0: no tap loop
                    if fetch is not None:
                        fetch(b.sub(ic, lo))
                    self.tap(c, xp, wps, I64(0), I64(0), accs)
                else:
                    with for_range(b, s["taps"], "tap") as t:
                        if fetch is not None:
                            fetch(b.add(b.mul(b.sub(ic, lo), s["taps"]), t))
                        self.tap(c, xp, wps, b.load(b.gep(taps, [t], source_etype=I64), typ=I64), t, accs)

        if ahead is None:
            channels(None)
            return
        *block, first = ahead
        with b.if_else(first) as (first_pass, later):  # only a group's first pass reads ahead
            with first_pass:
                channels(self.fetch_ahead(c, kb, run, block))
            with later:
                channels(None)

    def fetch_ahead(self, c, kb, run, block):
        """``fetch(step)``: in a group's first pass (where the block's weights come from
        memory), tile ``i`` of ``size`` prefetches its share of the next block's weights,
        channels ``lo .. hi``, a line (one channel's tap of one vector) at each of its
        steps (channel and tap) until done, the vectors in turn: while a tile computes,
        the next block arrives, where the first tile of each block waited for it (into
        L2; the address is not ``inbounds``: a prefetch never faults). Zen 5, 2 threads,
        builds in turns in one process: 12 layers of 3x3 512 on 7x7 with their own weights
        (108 MB) 0.91x the time; 1x1 1024->256 on 14x14 (cold or hot weights) and
        ResNet-50 level."""
        b, s, e = c.b, c.syms, self.e
        lo, hi, i, size = block
        share = ceil_div(b, b.sub(hi, lo), size)  # channels a tile fetches
        lines = b.mul(b.mul(share, s["taps"]), I64(e.v))
        at = b.mul(b.add(lo, b.mul(i, share)), b.mul(s["taps"], I64(e.lanes)))

        def fetch(step):
            with b.if_then(b.icmp_signed("<", step, lines)):
                v, line = b.urem(step, I64(e.v)), b.udiv(step, I64(e.v))
                offset = b.add(b.add(b.mul(b.add(kb, v), run), at), b.mul(line, I64(e.lanes)))
                prefetch(b, b.gep(c.ptrs[self.bufs["w"].storage], [offset],
                                  source_etype=self.elem.ir), locality=2)
        return fetch

    def tap(self, c, xp, wps, off, t, accs) -> None:
        """One tap ``t`` (at ``off`` from the pixel) of one input channel (unit): ``V``
        weight vectors, ``R`` broadcast pixels, ``R * V`` FMAs (dot-product steps)."""
        b, e, vt, elem = c.b, self.e, self.vt, self.elem
        at = b.mul(t, I64(e.lanes))
        ws = [b.load(b.gep(wp, [at], source_etype=elem.ir), typ=vt, align=elem.nbytes) for wp in wps]
        vals = [b.load(a, typ=self.acc_vt) for a in accs]
        for r in range(e.r):
            x = b.load(b.gep(xp, [b.add(off, I64(r * max(1, e.sw)))], source_etype=elem.ir), typ=elem.ir)
            xs = splat(b, x, e.lanes)
            for v in range(e.v):
                vals[r * e.v + v] = multiply_units(b, self.product, xs, ws[v], vals[r * e.v + v])
        for a, val in zip(accs, vals):
            b.store(val, a)

    def store_tile(self, c, sums, n, first, own0, kend, p0, pstart) -> None:
        """Channels ``own0 .. kend`` of the tile (``sums``: its ``R * V`` vectors, one after
        the other in memory, ``[r][channel - first]``) to their ``R`` consecutive output
        pixels from ``p0``, those before the band's first (``pstart``: a band shorter than
        a tile started its tile in the band before; None: a tile of one row, in its band)
        left to their own task."""
        b, e, acc = c.b, self.e, self.acc_vt.element
        scratch = b.bitcast(sums[0], ir.PointerType(acc))
        mine = [None if pstart is None else b.icmp_signed(">=", b.add(p0, I64(r)), pstart)
                for r in range(e.r)]
        with for_range(b, kend, "ch", start=own0) as ch:
            row = self.output_at(c, n, ch, 0, I64(0), p0)  # pixel p0 of the flattened map
            lane = b.sub(ch, first)
            for r in range(e.r):
                at = b.gep(scratch, [b.add(lane, I64(r * e.v * e.lanes))], source_etype=acc)
                if mine[r] is None:
                    c.store(self.bufs["out"], b.add(row, I64(r)), b.load(at, typ=acc))
                    continue
                with b.if_then(mine[r], likely=True):
                    c.store(self.bufs["out"], b.add(row, I64(r)), b.load(at, typ=acc))


def call(stage, ctx) -> None:
    """Emit the call of the engine for ``stage`` (a :class:`~jitbyoc.kernels.conv2d.Conv2d`
    with a :class:`ChannelPlan` and a packed weight)."""
    plan, g = stage.plan, stage.geo
    dt = stage.inputs[0].dtype  # the product
    engine = ChannelEngine(dt, plan.lanes, plan.r, plan.v, int(plan.direct), int(g.taps == 1),
                           plan.group, plan.block_kib, *plan.stride)
    # the dense layout of an input read in place is the input itself (one H x W plane a channel)
    img = g.groups * unit_channels(g, dt) * plan.layout.channel_size()
    conv_engine.call(stage, ctx, plan, engine, img=img)
