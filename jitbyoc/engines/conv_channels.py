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
reads *padded planes* instead (:func:`padded_layout`: one plane a channel, the input
with its padding, packed by whole rows whatever the stride): a tile is ``R`` pixels of
one output row, pixel ``r`` at plane element ``r * stride`` from the tile's first, and a
row's last tile overlaps the one before it (:func:`grouped_on_channels` says when).

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

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from llvmlite import ir

from ..ir.llvmtypes import I64, PTR
from ..render import isa
from ..render.loops import ceil_div, for_range, smax, smin
from ..render.vectors import splat
from ..threads import physical_cores
from . import conv_engine, registry
from .conv_plan import DENSE_MAX_KW, Layout, Plan, bands_wanted, choose_plan, cost, unit_channels
from .gemm import blocking_for, panel_width
from .gemm_llvm import chunks_of
from .gemm_micro import multiply_units
from .products import PRODUCTS

MAX_V = 4  # vectors of channels per tile
MAX_R = 16  # pixels per tile
MIN_REDUCTION = 128  # products per output (Cin * taps): the transposed store is paid per tile
# vectors of output channels: DenseNet's 7x7 3x3 128->32 (two vectors) ran 1.27-1.69x
# slower here than on the pixel engine (Zen 4, exported builds alternating)
MIN_VECTORS = 4
# Tiles computed together, one block of input channels at a time (_Emit.grouped), a
# block's weights at most WEIGHT_BLOCK_KIB. Zen 4, 1 thread, exported builds alternating,
# against one tile after another: 7x7 3x3 512 0.90-0.93x the time (0.90 with a process
# streaming 64 MB on the other core), 7x7 1x1 2048->512 0.97 (0.79-0.85); 2 threads 0.94
# and 0.98. Blocks of 16, 48 or 96 KiB measured alike; the pixel engine (conv_engine)
# blocked alike measured level (56x56 to 14x14 3x3 layers, 0.98-1.02): its J weights
# a tap are one cache line, streamed in order.
TILE_GROUP = 8
WEIGHT_BLOCK_KIB = 96
CHEAPER = 0.9  # taken when its cost is at most this share of the pixel engine's


@dataclass(frozen=True)
class ChannelPlan:
    """``R`` pixels x ``V`` vectors of ``lanes`` channels per tile, on ``layout`` (dense);
    ``fallback`` is the pixel engine's plan for a weight that is not a constant (this
    engine reads packed weights only; None for a 1x1 convolution: the GEMM engine)."""
    layout: Layout
    lanes: int
    r: int
    v: int
    fallback: Plan | None
    rows: int  # output rows per band (a task): at least R pixels
    group: int = TILE_GROUP  # tiles per group
    block_kib: int = WEIGHT_BLOCK_KIB  # weights per block of input channels
    unit: int = 1  # input channels per step (the product's group): units are packed
    # > 0: the stride of a grouped conv read from padded planes (:func:`padded_layout`):
    # a tile is R pixels of one output row, pixel r at element ``r * stride`` of the plane
    stride: tuple = (0, 0)

    @property
    def j(self) -> int:
        """Output channels per block of the packed weight: one vector."""
        return self.lanes

    @property
    def direct(self) -> bool:
        return reads_in_place(self.layout.geo, self.unit)


def padded_layout(geo) -> Layout:
    """One zero-padded plane a channel, the input as it lies plus its padding: the stride-1
    grid of ``geo`` (:class:`.conv_plan.Layout`), whatever ``geo``'s stride. Packing it
    copies whole input rows; the phase planes of a strided grid copy every other element
    of rows half as long (a 14x14 stride-2 map: 32 rows of 7 a channel, more time than
    the channel's products on the pixel engine)."""
    (pt, pl, pb, pr), (dh, dw) = geo.pad, geo.dilation
    return Layout(dataclasses.replace(geo, stride=(1, 1), oh=geo.h + pt + pb - dh * (geo.kh - 1),
                                      ow=geo.w + pl + pr - dw * (geo.kw - 1)), False)


def grouped_on_channels(geo, dt: str) -> bool:
    """Whether a grouped convolution (one that :func:`fits`) runs here, on padded planes,
    rather than on the pixel engine: a product of one channel a step (float32), strided
    (the pixel engine packs phase planes of short rows, every other element) or at most a
    vector wide (it computes halo lanes).
    The cost models do not weigh the pixel engine's packing by the row; measured instead
    (Zen 4, 2 threads, 3x3 convs with bias and ReLU alone, group width 16 unless given,
    us here / on the pixel engine): RegNetY-800MF's seven, 320@14 107 / 116, 784@14/2
    100 / 143, 784@7 80 / 100, 144@56/2 233 / 240, 64@112/2 345 / 369, 320@28/2 128 / 148,
    144@28 194 / 195 (level: left to the pixel engine); group width 48 192@56/2 662 / 732;
    128 512@14 1049 / 1116; but 128@56 622 / 592, width 32 256@28 592 / 578, width 64
    256@56 4438 / 4277. In units the engine runs them (the tests), but RegNetY's bf16
    build (``jitbyoc.profile``, alternating processes) took 0.60 ms for its seven 320@14
    layers against 0.49 on the pixel engine, its int8 build 0.42-0.47 against 0.40-0.43."""
    return PRODUCTS[dt].group == 1 and (geo.stride != (1, 1) or geo.ow <= lanes_of(dt))


def lanes_of(dt: str) -> int:
    """Lanes of one of the machine's vector registers of the product ``dt``'s sums (8
    float32 or int32 lanes with AVX2, 16 with AVX-512)."""
    return isa.lanes(PRODUCTS[dt].acc)


def reads_in_place(geo, unit: int = 1) -> bool:
    """A 1x1 convolution with unit stride and no padding, one channel a step: its input
    is the dense layout (units of channels are interleaved by packing first)."""
    return unit == 1 and geo.taps == 1 and geo.stride == (1, 1) and not any(geo.pad)


def fits(geo, dt: str) -> bool:
    """Whether the channel engine may run ``geo`` (:func:`choose` then weighs its cost).
    Maps of fewer pixels than a vector has lanes (a squeeze-and-excitation block's 1x1
    products) fit whatever their reduction and channel count: there the GEMM engine's
    vectors of pixels are a lane or two of 16."""
    if dt not in PRODUCTS or geo.kw > DENSE_MAX_KW or geo.tiles:
        return False  # (units on a machine with AMX: a product on tiles, ConvGeometry.columns)
    lanes = lanes_of(dt)
    if geo.groups > 1 and (geo.taps == 1 or geo.kg % lanes):
        return False  # a vector of channels inside one group; grouped 1x1: products per group
    return geo.oh * geo.ow < lanes or (geo.cg * geo.taps >= MIN_REDUCTION and geo.k >= MIN_VECTORS * lanes)


def vectors_per_group(geo, dt: str) -> int:
    """Vectors of output channels of one group (the last one partial when one group's
    channels are not a whole number of vectors)."""
    return math.ceil(geo.kg / lanes_of(dt))


def blocks_of(geo, dt: str, v: int) -> int:
    """Blocks of ``v`` vectors of output channels, all groups (a block lies in one group)."""
    return geo.groups * math.ceil(vectors_per_group(geo, dt) / v)


def band_rows(geo, dt: str, r: int, v: int, padded: bool = False) -> int:
    """Output rows per task: bands until (image, group, channel block, band) tasks number
    :data:`.conv_plan.MIN_TASKS`, each at least one tile of ``r`` pixels; on strided
    padded planes one band (a band packs the plane rows of its output rows, which are
    those rows only at stride 1)."""
    if padded and geo.stride != (1, 1):
        return geo.oh
    batch = geo.n if isinstance(geo.n, int) else 1
    tasks = batch * blocks_of(geo, dt, v)
    rows = math.ceil(geo.oh / bands_wanted(geo, tasks))
    return min(geo.oh, max(rows, math.ceil(r / geo.ow)))


def tile_cost(geo, dt: str, r: int, v: int, padded: bool = False) -> float:
    """Estimated cycles of one image on tiles of ``r x v`` (units of :func:`.conv_plan.cost`:
    a 512-bit FMA or load is one cycle, a broadcast 2/3), packing and stores included; on
    ``padded`` planes, tiles of one row each, and threads idle for want of tasks."""
    lanes, bits = lanes_of(dt), isa.vector_bits()
    rows = band_rows(geo, dt, r, v, padded)
    bands = math.ceil(geo.oh / rows)
    per_band = (lambda n: n * math.ceil(geo.ow / r)) if padded else (lambda n: math.ceil(n * geo.ow / r))
    tiles = sum(per_band(min(rows, geo.oh - i * rows)) for i in range(bands))
    groups = blocks_of(geo, dt, v)
    step = max(r * v * bits / 512, v * bits / 512 + r * 0.66, 4.0) + 0.5  # FMA latency: 4 cycles
    stores = r * v * lanes * 1.5
    layout = padded_layout(geo) if padded else Layout(geo, True)
    pack = 0 if reads_in_place(geo, PRODUCTS[dt].group) else geo.c * layout.channel_size() * 0.5
    total = tiles * groups * (step * unit_channels(geo, dt) * geo.taps + stores + 20) + pack
    if not padded:
        return total
    tasks, threads = groups * bands, physical_cores()
    return total * math.ceil(tasks / threads) * threads / tasks


def gemm_cost(geo, dt: str) -> float:
    """The GEMM engine's cycles for a pointwise ``geo`` in :func:`tile_cost`'s units: its
    tiles' FMAs (``MR`` rows of output channels by vectors of pixels: a 7x7 map fills 49
    of 64 lanes), spread over its chunks (:func:`.gemm_llvm.chunks_of` per image,
    so 3 chunks of a 13x13 map keep one of two cores idle a third of the time)."""
    mr, lanes, bits = blocking_for(dt).mr, lanes_of(dt), isa.vector_bits()
    rows, pixels = geo.kg, geo.oh * geo.ow
    parts = math.ceil(pixels / panel_width(dt)) if pixels >= rows else math.ceil(rows / mr)
    chunks = chunks_of(parts)
    threads = physical_cores()
    fmas = math.ceil(rows / mr) * mr * math.ceil(pixels / lanes) * unit_channels(geo, dt) * bits / 512
    return fmas * math.ceil(chunks / threads) * threads / chunks


def choose(geo, dt: str) -> ChannelPlan | None:
    """:func:`_choose` for the build's machine (its vector registers), remembered per
    geometry as the pixel engine's plans are: a model repeats its layers, and each conv
    asks twice (packing its weight, then lowering), 0.5 ms a time."""
    return _choose(geo, dt, isa.vector_bits(), isa.vector_registers())


@lru_cache(maxsize=1024)
def _choose(geo, dt: str, _bits: int, _registers: int) -> ChannelPlan | None:
    """The cheapest tile by :func:`tile_cost` when it fits the registers, no tile is
    larger than the map or the channels, and it beats the path that would run the conv
    otherwise: the pixel engine's best plan by :data:`CHEAPER`, or for a pointwise conv
    the GEMM engine (:func:`gemm_cost`). Measured on Zen 4 against those paths (exported
    builds alternating): 7x7 maps 0.81-0.90x their time; 13x13 and 14x14 1x1 with few
    output channels 0.72-0.91x; the estimates were within 0.1 of the measured ratio on 11
    of 13 pointwise layers of ResNet-50, MobileNetV2, EfficientNet, SqueezeNet, DenseNet."""
    if not fits(geo, dt):
        return None
    lanes, regs = lanes_of(dt), isa.vector_registers()
    padded = geo.groups > 1
    pixels, vectors = (geo.ow if padded else geo.oh * geo.ow), vectors_per_group(geo, dt)
    tiles = [(tile_cost(geo, dt, r, v, padded), r, v) for r in range(1, min(MAX_R, pixels) + 1)
             for v in range(1, min(MAX_V, vectors) + 1) if r * v + v + 2 <= regs]
    if not tiles:
        return None
    best, r, v = min(tiles)
    fallback = None if geo.pointwise else choose_plan(geo, dt)
    rival = gemm_cost(geo, dt) if fallback is None else CHEAPER * cost(fallback, dt)
    if not padded and best > rival or padded and not grouped_on_channels(geo, dt):
        return None
    layout = padded_layout(geo) if padded else Layout(geo, True)
    return ChannelPlan(layout, lanes, r, v, fallback, band_rows(geo, dt, r, v, padded), unit=PRODUCTS[dt].group,
                       stride=geo.stride if padded else (0, 0))


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
        if e.sw:  # a tile is R pixels of a row: per row ceil(OW / R) tiles, the last one overlapping
            per_row = ceil_div(b, s["ow"], I64(e.r))
            count = b.mul(b.sub(r1, r0), per_row)
            row = lambda i: b.add(r0, b.sdiv(i, per_row))  # noqa: E731
            col = lambda i: smin(b, b.mul(b.srem(i, per_row), I64(e.r)), b.sub(s["ow"], I64(e.r)))  # noqa: E731
            at = lambda i: b.add(b.mul(row(i), s["ow"]), col(i))  # noqa: E731
            grid = lambda i: b.add(b.mul(b.mul(row(i), I64(e.sh)), s["wq"]), b.mul(col(i), I64(e.sw)))  # noqa: E731
        else:
            count = ceil_div(b, b.sub(pend, pstart), I64(e.r))
            at = grid = lambda i: smin(b, b.add(pstart, b.mul(i, I64(e.r))), b.sub(pend, I64(e.r)))  # noqa: E731
        self.grouped(c, count, e.r * e.v, e.v * e.lanes * self.elem.nbytes,
                     lambda i, accs, lo, hi: self.accumulate(c, src, b.add(xbase, grid(i)), kb, accs, lo, hi),
                     lambda i, accs: self.store_tile(c, accs, n, b.add(k0, b.mul(first, I64(e.lanes))),
                                                     own0, kend, at(i), None if e.sw else pstart))
        registry.call_back(b, s["epi"], s["env"], [n, own0, b.sub(kend, own0), r0, b.sub(r1, r0)])

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
                    accumulate(b.add(first, i), accs, lo, smin(b, channels, b.add(lo, block)))
                    for a, sv in zip(accs, saved(i)):
                        b.store(b.load(a, typ=vt), sv)
            with for_range(b, size, "tile") as i:
                store(b.add(first, i), saved(i))

    def accumulate(self, c, src, xoff, kb, accs, lo, hi) -> None:
        """``accs[r*V + v]`` += input channels ``lo .. hi`` of vector ``kb + v`` at pixel
        ``r`` of the tile at ``xoff``."""
        b, s, e = c.b, c.syms, self.e
        taps = b.inttoptr(s["taptab"], PTR)
        run = b.mul(b.mul(self.channels(c), s["taps"]), I64(e.lanes))  # one vector's weights
        with for_range(b, hi, "ic", start=lo) as ic:
            xp = c.element(src, b.add(xoff, b.mul(ic, s["chan"])))
            first = b.mul(b.mul(ic, s["taps"]), I64(e.lanes))
            wps = [c.element(self.bufs["w"], b.add(b.mul(b.add(kb, I64(v)), run), first)) for v in range(e.v)]
            if e.pointwise:  # one tap at offset 0: no tap loop
                self.tap(c, xp, wps, I64(0), I64(0), accs)
            else:
                with for_range(b, s["taps"], "tap") as t:
                    self.tap(c, xp, wps, b.load(b.gep(taps, [t], source_etype=I64), typ=I64), t, accs)

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
        mine = [None if pstart is None else b.icmp_signed(">=", b.add(p0, I64(r)), pstart) for r in range(e.r)]
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
    conv_engine.call(stage, ctx, plan, engine, img=g.groups * unit_channels(g, dt) * plan.layout.channel_size())
