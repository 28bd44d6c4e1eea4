"""Plans of the channel engine (:mod:`.conv_channels`): which convolutions it runs, on
which layout, with which tile (``R`` pixels x ``V`` vectors of channels) and bands, by a
cost model weighed against the pixel engine's (:mod:`.conv_plan`) and the GEMM engine's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from ..render import isa
from ..threads import physical_cores
from .conv_plan import (DENSE_MAX_KW, ONE_FMA_PIPE, PACK_CYCLES, TWO_FMA_PIPES, WIDE_FMA_PIPES, Layout, Plan,
                        bands_wanted, choose_plan, cost, issue_costs, unit_channels)
from .gemm import blocking_for, panel_width
from .gemm_llvm import chunks_of
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
# a tap are one cache line, streamed in order. On Zen 5 (48 KiB L1) blocks that stay in
# L1 with the group's saved sums paid (builds in one process, in turns, against 96 KiB):
# 24 pairs of 1x1 512 <-> 2048 on 7x7 0.87x the time at 16 KiB (24: 0.89, 40: 0.95, 8:
# 0.87); ResNet-50 0.971x (24: 0.963), its bf16 0.966x, its int8 QDQ 0.981x (24: 0.968),
# Inception v2 0.977x, DenseNet-121 0.988x against controls of 0.99-1.02; MobileNetV2,
# EfficientNet-B0, RegNetY level. 16 KiB and a group of 8 tiles' sums (at most 28 vectors
# a tile) fit a 32 KiB L1 as well (Zen 4, Intel's cores before Ice Lake's 48 KiB).
TILE_GROUP = 8
WEIGHT_BLOCK_KIB = 16
L1_BYTES = 32 << 10  # the smallest first-level data cache of jitbyoc's x86 targets
# taken when its cost is at most this share of the pixel engine's, per issue model: on
# Intel's two-pipe cores the pixel engine's strided convs ran slower than its cost model
# says, the channel engine's stems (3 input channels) slower than its own. Emerald
# Rapids, builds alternating in one process, channel engine's time / pixel engine's (cost
# ratio): ZFNet's 5x5/2 96->256 0.81 (0.96), Inception v2's 3x3/2 128->160 at 28x28 0.66
# (0.91), ResNet-50's 128 at 56x56/2 0.72 (0.90); Inception v1's 5x5 32->96 0.97 (1.00),
# AlexNet's 11x11/4 stem 1.25 (1.02), ResNet-50's 7x7/2 stem 1.36 (1.10). Zen 5 keeps
# Zen 4's margin (not measured apart)
CHEAPER = {ONE_FMA_PIPE: 0.9, TWO_FMA_PIPES: 1.0, WIDE_FMA_PIPES: 0.9}
# cycles per input element of packing the input, where it is not conv_plan.PACK_CYCLES: a
# 1x1 in bfloat16 pairs packs (float32 reads in place) against a GEMM engine whose
# packing its cost leaves out, and packing pairs runs slower than 0.5 says. Zen 4, 2 threads, alone, channel engine's time / GEMM
# engine's, bf16, with the old 0.5: Inception v1's 13x13 1x1 480->64 1.48, 512->64 1.41,
# 512->112 1.24, 480->96 1.11 (on channels), 512->128 1.01, 512->160 0.95, 6x6 832->384
# 0.87, ResNet-50's 7x7 2048->512 0.85: 1.2 sends the first four to the GEMM engine and
# keeps the rest (the margins put it between 0.46 and 0.95). int8's quads keep 0.5: at
# 0.5 uint8 already runs the 13x13 ones on the GEMM engine, and 2048->512 on 7x7 on
# channel vectors at 0.92x the GEMM engine's time
POINTWISE_PACK_CYCLES = {"bfloat16": 1.2}


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
    slots of a 512-bit FMA, loads and broadcasts as :func:`.conv_plan.issue_costs` charges
    them), packing and stores included; on ``padded`` planes, tiles of one row each, and
    threads idle for want of tasks."""
    lanes, bits = lanes_of(dt), isa.vector_bits()
    rows = band_rows(geo, dt, r, v, padded)
    bands = math.ceil(geo.oh / rows)
    per_band = (lambda n: n * math.ceil(geo.ow / r)) if padded else (lambda n: math.ceil(n * geo.ow / r))
    tiles = sum(per_band(min(rows, geo.oh - i * rows)) for i in range(bands))
    groups = blocks_of(geo, dt, v)
    issue = issue_costs()
    loads = v * bits / 512 * issue.load + r * issue.broadcast
    step = max(issue.fmas(r * v, bits), loads, issue.latency) + 0.5
    stores = r * v * lanes * 1.5
    layout = padded_layout(geo) if padded else Layout(geo, True)
    per = POINTWISE_PACK_CYCLES.get(dt, PACK_CYCLES) if geo.pointwise else PACK_CYCLES
    pack = 0 if reads_in_place(geo, PRODUCTS[dt].group) else geo.c * layout.channel_size() * per
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
    # the chunks of the larger side, as the engine split before gemm_llvm.split_side: the
    # estimate the engines' choices were measured against. With split_side's parts, a 1x1
    # 384 <-> 64 on 13x13 moved to the GEMM and ran 1.11x slower in float32 (level in
    # bfloat16; 512 <-> 160 in bfloat16 0.91x): a GEMM of few rows gains less than its
    # chunks say
    parts = math.ceil(pixels / panel_width(dt)) if pixels >= rows else math.ceil(rows / mr)
    chunks = chunks_of(parts)
    threads = physical_cores()
    fmas = math.ceil(rows / mr) * mr * math.ceil(pixels / lanes) * unit_channels(geo, dt) * bits / 512
    return fmas * math.ceil(chunks / threads) * threads / chunks


def choose(geo, dt: str) -> ChannelPlan | None:
    """:func:`_choose` for the build's machine (its vector registers), remembered per
    geometry as the pixel engine's plans are: a model repeats its layers, and each conv
    asks twice (packing its weight, then lowering), 0.5 ms a time."""
    return _choose(geo, dt, isa.vector_bits(), isa.vector_registers(), issue_costs())


@lru_cache(maxsize=1024)
def _choose(geo, dt: str, _bits: int, _registers: int, _issue) -> ChannelPlan | None:
    """The cheapest tile by :func:`tile_cost` when it fits the registers, no tile is
    larger than the map or the channels, and it beats the path that would run the conv
    otherwise: the pixel engine's best plan by :data:`CHEAPER` (the machine's), or for a pointwise conv
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
    rival = gemm_cost(geo, dt) if fallback is None else CHEAPER[issue_costs()] * cost(fallback, dt)
    if not padded and best > rival or padded and not grouped_on_channels(geo, dt):
        return None
    layout = padded_layout(geo) if padded else Layout(geo, True)
    return ChannelPlan(layout, lanes, r, v, fallback, band_rows(geo, dt, r, v, padded),
                       unit=PRODUCTS[dt].group, stride=geo.stride if padded else (0, 0))
