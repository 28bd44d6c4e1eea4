"""How the direct convolution (:mod:`.conv_engine`) lays out its packed input and blocks
its registers, chosen per convolution at build time by a small cost model.

Layouts of one input channel in the workspace (``planes`` planes of ``hq x wq``):

* *grid*: one zero-padded plane per stride phase (a, b) some tap reads, holding padded
  pixels ``(s*r + a, s*q + b)``. Output pixel (oh, ow) is grid pixel ``oh*wq + ow`` and
  tap (i, j) reads plane element ``grid pixel + tap(i, j)``. ``wq`` exceeds OW by the
  window's reach, so ``(wq - OW) / wq`` of the lanes compute thrown-away halo columns.
* *dense*: one plane per (row phase, kernel column j), holding the padded input shifted
  by column j, exactly OW wide: no halo lanes, at ``KW`` times the packing. It wins on
  small images (7x7: 49 pixels fill 56 of 8-lane vectors, but 64 of the grid's). Wider
  (``width``), every tap's shift is a whole number of rows: AMX tiles read 64-byte rows
  of it on whole cache lines (:mod:`.conv_tiles`).

Either way every tap reads a contiguous run, whatever the stride, dilation or padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..ir.dtypes import dtype as lookup_dtype
from ..render import isa
from .products import PRODUCTS

DENSE_MAX_KW = 16  # the dense layout copies the input once per kernel column: not for wide windows
MIN_TASKS = 16  # split rows into bands until there are this many tasks (load balance)
# and, where the input outweighs the weights, until there are this many units (bands of
# one group of one image): a thread packs the input rows of the units it runs
# (conv_engine.Emit.banded), so with one unit every thread packs all of it (an AVX2 3x3
# 64->64 on 56x56 had one band of 56 rows), and a thread that takes a band from another
# packs it first (smaller bands: cheaper to take). That conv, exported builds alternating
# in one process, Zen 4, 2 threads: 1.539 / 1.942 ms with 4 units, 1.535 / 1.953 with 8,
# 1.580 / 1.978 with 2, 1.647 / 2.001 with 1 (a quiet and a slow phase). Where the
# weights are the bigger, a band per thread makes every thread read all of them instead
# (ResNet's 3x3 256 on 14x14, AVX-512: 68-70 % of peak in two bands, 74-78 % in one)
MIN_UNITS = 4


def bands_wanted(geo, blocks: int) -> int:
    """Row bands per image and group for ``blocks`` tasks per band (all images): enough
    for :data:`MIN_TASKS` tasks and, when the input is larger than the weights,
    :data:`MIN_UNITS` units; at most one per row."""
    want = math.ceil(MIN_TASKS / blocks)
    sizes = (geo.n, geo.c, geo.h, geo.w)
    if all(isinstance(d, int) for d in sizes) and geo.c * geo.h * geo.w > geo.k * geo.cg * geo.kh * geo.kw:
        want = max(want, math.ceil(MIN_UNITS / (geo.n * geo.groups)))
    return min(geo.oh, want)


MAX_V = 8  # vectors per chunk; the workspace's slack covers one chunk of full vectors
PACK_CYCLES = 0.5  # per input element packed into the workspace (both engines' cost models)


@dataclass(frozen=True)
class IssueCosts:
    """What the cost models charge a 512-bit vector load and a broadcast scalar (on
    AVX-512 folded into its FMA), in issue slots of a 512-bit FMA on the build's machine;
    ``narrow`` a 256-bit FMA (half a slot where a 512-bit FMA is two 256-bit halves, a
    whole one on 512-bit pipes), ``latency`` the slots an FMA's result takes (a block of
    fewer accumulators waits on them)."""
    load: float
    broadcast: float
    narrow: float = 0.5
    latency: float = 4.0

    def fmas(self, count: float, bits: int) -> float:
        """Slots of ``count`` FMAs on vectors of ``bits``."""
        return count * max(bits / 512, self.narrow)


# Zen 4 and friends: 512 FMA bits and 512 load bits per cycle, a broadcast ~2/3 cycle, as
# measured on ResNet's layers
ONE_FMA_PIPE = IssueCosts(1.0, 0.66)
# Intel's AVX-512 server cores: two 512-bit FMA pipes and two 512-bit loads a cycle, but a
# broadcast costs ~1.8 FMAs. Measured on an Emerald Rapids under KVM, 1 thread, L1-resident
# loops of 3x3 taps (bench.contention's mix loop): the 16x1 block (16 broadcasts and a
# load per 16 FMAs) at 94-165 GFLOP/s, 6x4 and 8x3 (6 or 8 broadcasts and 4 or 3 loads
# per 24 FMAs) at 160-175, against 186 for the FMA loop. The 16x1 block the Zen 4 model
# picks ran ZFNet's 5x5/2 96->256 at 1.8x the channel engine's time (6x4), its 7x7/2 stem
# at 1.35x 8x2's (one process, builds alternating)
TWO_FMA_PIPES = IssueCosts(1.0, 1.8)
# Zen 5: two 512-bit FMA pipes, two 512-bit loads a cycle, a broadcast one load. Measured
# (bench.contention's mix loop per block, L1-resident, 1 thread, this model's FMA loop 250
# GFLOP/s): 16x1 0.91 of it, 24x1 0.95 (a broadcast ~1.0 slot), 13x2 0.99, 6x4 1.00, 7x3
# 1.00; every block of 256-bit vectors 0.46-0.51 (a 256-bit FMA takes a 512-bit pipe, so
# Zen 4's half-width blocks compute at half rate here). Latency: 4 cycles, 8 slots
WIDE_FMA_PIPES = IssueCosts(1.0, 1.0, narrow=1.0, latency=8.0)
WIDE_FMA_PIPE_CPUS = frozenset({"znver5"})
TWO_FMA_PIPE_CPUS = frozenset({"skylake-avx512", "cascadelake", "cooperlake", "icelake-server",
                               "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d",
                               "diamondrapids"})
# and any CPU with AMX, whatever its name: only the server cores have it, and a Xeon under
# KVM may report a client core's model (167: LLVM's ``rocketlake``, one 512-bit FMA pipe)
# while its FMA loop runs at two pipes' rate. There the two-pipe model's blocks ran ResNet-50
# fp32 in 0.94-0.96x the time, ZFNet 0.86-0.90x, Inception v1 0.96-0.98x, DenseNet-121 level


def issue_costs(machine=None) -> IssueCosts:
    """The :class:`IssueCosts` of ``machine`` (the build's by default), by its LLVM CPU
    name."""
    m = machine or isa.current()
    if not m.has("avx512f"):
        return ONE_FMA_PIPE
    if m.cpu in WIDE_FMA_PIPE_CPUS:
        return WIDE_FMA_PIPES
    return TWO_FMA_PIPES if m.cpu in TWO_FMA_PIPE_CPUS or m.has("amx-tile") else ONE_FMA_PIPE


# Register blocks (vector width divisor, J, V) preferred when nearly as cheap, per issue
# model: each block is a compiled engine (~100 ms of LLVM time on a machine's first
# build), so a model whose layers share two blocks compiles two. By the Zen 4 model, 16x1
# full-width vectors is within 0.4 % of the best plan on ResNet-18's layers but the small
# 3x3 ones (14x14 stride 2, 7x7), where 3x7 half-width vectors is best; by the two-pipe
# model 13x2 and 3x7 are within 5.5 % of the best on all eleven.
MENUS = {ONE_FMA_PIPE: frozenset({(1, 16, 1), (2, 3, 7)}), TWO_FMA_PIPES: frozenset({(1, 13, 2), (2, 3, 7)}),
         WIDE_FMA_PIPES: frozenset({(1, 8, 3), (1, 13, 2)})}
MENU_SLACK = 1.02


@dataclass(frozen=True)
class Layout:
    geo: object  # ConvGeometry
    dense: bool
    width: int = 0  # dense planes this wide (at least OW; past OW, columns nobody stores)

    @property
    def hq(self) -> int:
        g = self.geo
        return g.oh + (g.kh - 1) * g.dilation[0] // g.stride[0]

    @property
    def wq(self) -> int:
        g = self.geo
        if self.dense:
            return max(self.width, g.ow)
        return g.ow + (g.kw - 1) * g.dilation[1] // g.stride[1]

    @property
    def row_phases(self) -> tuple:
        g = self.geo
        return tuple(sorted({i * g.dilation[0] % g.stride[0] for i in range(g.kh)}))

    @property
    def col_sources(self) -> tuple:
        """Per plane column: the padded input column of plane column 0 (then + stride)."""
        g = self.geo
        if self.dense:
            return tuple(j * g.dilation[1] for j in range(g.kw))
        return tuple(sorted({j * g.dilation[1] % g.stride[1] for j in range(g.kw)}))

    def plane_sources(self) -> list[tuple[int, int]]:
        """(row phase, column source) of each plane of a channel, in order."""
        return [(a, b) for a in self.row_phases for b in self.col_sources]

    @property
    def planes(self) -> int:
        return len(self.row_phases) * len(self.col_sources)

    @property
    def plane_size(self) -> int:
        return self.hq * self.wq

    def channel_size(self) -> int:
        return self.planes * self.plane_size

    def tap(self, i: int, j: int) -> int:
        """Offset of tap (i, j) in a channel's planes relative to the output pixel's."""
        (sh, sw), (dh, dw) = self.geo.stride, self.geo.dilation
        row = self.row_phases.index(i * dh % sh)
        col = j if self.dense else self.col_sources.index(j * dw % sw)
        shift = 0 if self.dense else j * dw // sw
        return (row * len(self.col_sources) + col) * self.plane_size + (i * dh // sh) * self.wq + shift


@dataclass(frozen=True)
class Plan:
    layout: Layout
    lanes: int
    j: int  # output channels per block
    v: int  # vectors per chunk
    rows: int  # output rows per band

    @property
    def span(self) -> int:
        return self.v * self.lanes


def tap_table(plan: Plan) -> list[int]:
    """Per tap (i, j), row-major as in the weights: its offset from the output pixel's."""
    g = plan.layout.geo
    return [plan.layout.tap(i, j) for i in range(g.kh) for j in range(g.kw)]


# Taps of a window the engine unrolls (a 5x5 at most), where the loop over the tap table
# cost as many instructions as its FMAs: AVX2's 4x3 register block (12 FMAs, 4
# broadcasts, 3 loads a tap) issued 27 instructions a tap, 19 unrolled. Issue slots bind
# when another thread shares the core (this VM's co-tenants): 3x3 64->64 on 56x56, AVX2,
# exported builds alternating, Zen 4, 2 threads: 58 -> 71, 69 -> 77, 43 -> 70 % of the
# FMA loop timed in turns (three runs); AVX-512 (16x1 block) 90 -> 91 %.
MAX_UNROLLED_TAPS = 25


def unrolled_window(plan: Plan) -> tuple[int, int]:
    """``(kh, kw)`` when the engine can unroll the window, ``(0, 0)`` otherwise: each
    window row's taps must read consecutive elements (tap (i, j) = tap (i, 0) + j: the
    grid layout with unit column stride and dilation), so that their loads differ by
    constant offsets."""
    g, taps = plan.layout.geo, tap_table(plan)
    consecutive = all(taps[i * g.kw + j] == taps[i * g.kw] + j for i in range(g.kh) for j in range(g.kw))
    return (g.kh, g.kw) if consecutive and g.taps <= MAX_UNROLLED_TAPS else (0, 0)


def plane_table(plan: Plan) -> list[int]:
    """Per plane: input row and column of plane element (0, 0) (plane row r then reads
    input row ``stride*r + shift``), and the valid plane rows and columns [lo, hi)."""
    lay, g = plan.layout, plan.layout.geo
    (sh, sw), (pt, pl, _, _) = g.stride, g.pad
    out = []
    for a, bb in lay.plane_sources():
        r_lo, r_hi = _valid_range(lay.hq, sh, a - pt, g.h)
        q_lo, q_hi = _valid_range(lay.wq, sw, bb - pl, g.w)
        if r_lo >= r_hi or q_lo >= q_hi:
            r_lo = r_hi = q_lo = q_hi = 0  # nothing valid: the whole plane is zeroed
        out += [a - pt, bb - pl, r_lo, r_hi, q_lo, q_hi]
    return out


def _valid_range(count: int, step: int, shift: int, size: int) -> tuple[int, int]:
    """The indices q in [0, count) with 0 <= step*q + shift < size, as [lo, hi)."""
    lo = max(0, -(shift // step)) if shift < 0 else 0
    hi = min(count, (size - 1 - shift) // step + 1) if size - 1 - shift >= 0 else 0
    return lo, max(lo, hi)


def _accumulator(dt: str) -> str:
    """What the product ``dt`` (:data:`~.products.PRODUCTS`) sums in: the vectors the
    engine holds and stores."""
    return PRODUCTS[dt].acc if dt in PRODUCTS else dt


def max_lanes(dt: str) -> int:
    """The widest plan's lanes: one vector (of the accumulators, for the product ``dt``
    of :data:`~.products.PRODUCTS`) as kernels write them."""
    return isa.lanes(_accumulator(dt), isa.VECTOR_BITS)


def unit_channels(geo, dt: str) -> int:
    """Input channels of a group as the engine packs them: in units of the product's
    ``group`` channels (a bfloat16 pair of channels at one pixel is one 32-bit unit; an
    odd count gets a zero channel)."""
    group = PRODUCTS[dt].group if dt in PRODUCTS else 1
    return -(-geo.cg // group)


def workspace_size(plan: Plan, dt: str) -> int:
    """Elements (units) of one image's packed input, plus zeroed slack that chunks
    overrun into."""
    geo = plan.layout.geo
    return geo.groups * unit_channels(geo, dt) * plan.layout.channel_size() + MAX_V * max_lanes(dt)


def cost(plan: Plan, dt: str) -> float:
    """Estimated cycles of one image: per tap, FMAs or loads, whichever binds
    (:func:`issue_costs`); per chunk the masked stores; plus packing the input."""
    lay, g, lanes, j, v = plan.layout, plan.layout.geo, plan.lanes, plan.j, plan.v
    issue = issue_costs()
    bands = math.ceil(g.oh / plan.rows)
    span = lambda r: (r - 1) * lay.wq + g.ow  # noqa: E731  grid pixels of r rows
    chunks = sum(math.ceil(span(min(plan.rows, g.oh - b * plan.rows)) / plan.span) for b in range(bands))
    blocks = math.ceil(g.kg / j)  # a remainder block computes all J channels (stores fewer)
    acc = _accumulator(dt)
    bits = lanes * isa.element_bits(acc)
    stores = (lay.wq + lanes - 2) // lay.wq + 1  # rows one vector can touch
    cg = unit_channels(g, dt)  # a unit's instruction sums its group of channels
    loads = v * bits / 512 * issue.load + j * issue.broadcast
    per_chunk = (max(issue.fmas(j * v, bits), loads, issue.latency) + 0.5) * cg * g.taps \
        + v * stores * (j + 5) + 20
    pack = g.c * lay.channel_size() * PACK_CYCLES
    # every channel block streams the packed input through L2 again (~128 B/cycle with
    # the compute overlapping it): small J pays for its low reuse
    stream = blocks * g.c * lay.channel_size() * lookup_dtype(dt).nbytes / 128
    return g.groups * chunks * blocks * per_chunk + pack + stream


def candidates(geo, dt: str):
    """Every plan :func:`choose_plan` weighs: layouts, vector widths (512 and 256 bits)
    and register blocks J x V (plus a broadcast) that fit the machine's vector registers
    (32 of 512 bits with AVX-512; 16 of 256 with AVX2, where a 512-bit vector takes two);
    row bands give enough tasks to keep the thread pool busy."""
    batch = geo.n if isinstance(geo.n, int) else 1
    acc = _accumulator(dt)
    layouts = [Layout(geo, False)] + ([Layout(geo, True)] if geo.kw <= DENSE_MAX_KW else [])
    for layout in layouts:
        for lanes in (max_lanes(dt), max_lanes(dt) // 2):
            for v in range(1, MAX_V + 1):
                for j in range(1, min(geo.kg, 16) + 1):
                    if (j + 1) * v * isa.registers_per_vector(lanes, acc) > isa.vector_registers() - 1:
                        continue
                    blocks = batch * geo.groups * math.ceil(geo.kg / j)
                    rows = math.ceil(geo.oh / bands_wanted(geo, blocks))
                    yield Plan(layout, lanes, j, v, rows)


def on_menu(plan: Plan, dt: str) -> bool:
    return (max_lanes(dt) // plan.lanes, plan.j, plan.v) in MENUS[issue_costs()]


def choose_plan(geo, dt: str) -> Plan:
    """The cheapest of the :func:`candidates` by :func:`cost`, or the cheapest on the
    :data:`MENUS` (the machine's) when it costs at most :data:`MENU_SLACK` times that. Remembered per
    geometry (a model repeats its layers) and register file: a process that builds for
    AVX-512 and then AVX2 got the AVX-512 register block for AVX2 (16 x 1 vectors of 16
    lanes: spills; the AVX2 conv ran at half speed)."""
    return _choose_plan(geo, dt, isa.vector_bits(), isa.vector_registers(), issue_costs())


@lru_cache(maxsize=1024)
def _choose_plan(geo, dt: str, _bits: int, _registers: int, _issue: IssueCosts) -> Plan:
    best = menu = None
    for plan in candidates(geo, dt):
        c = cost(plan, dt)
        if best is None or c < best[0]:
            best = (c, plan)
        if on_menu(plan, dt) and (menu is None or c < menu[0]):
            menu = (c, plan)
    return menu[1] if menu is not None and menu[0] <= best[0] * MENU_SLACK else best[1]
