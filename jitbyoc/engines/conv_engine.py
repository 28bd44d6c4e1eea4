"""The direct convolution as a library engine (:mod:`jitbyoc.library`): one compiled
engine per (dtype, lanes, J, V) serves every convolution planned with that register
block; sizes, strides and the layout come as run-time values and two tables.

1. *Pack*: each input channel is copied into the zero-padded planes of the plan's
   :class:`~.conv_plan.Layout` (the *plane table*: per plane the input row/column shift
   and the valid row/column ranges), so that every tap of the window reads a contiguous
   run of the workspace (the *tap table*: per tap, its offset from the output pixel).
2. *Compute*: a chunk of ``V * lanes`` consecutive grid pixels times ``J`` output
   channels lives in ``J * V`` vector accumulators; per input channel and tap it costs
   ``V`` vector loads, ``J`` broadcast weights and ``J * V`` FMAs. The taps come from
   the tap table in a loop, or, where each window row's taps read consecutive elements,
   unrolled at constant offsets (engines with ``kh``, ``kw``). A finished chunk is
   stored with masked vector stores (one per output row it touches; channels past the
   last of a remainder block are masked off: they re-read the last channel's weights),
   and a finished band of rows is handed to the region's epilogue callback
   ``epi(env, image, oc0, channels, row0, rows)`` while it is in cache.

Threads take (image, row band, group, channel block) tasks, each its own bands first
(:meth:`Emit.banded`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64, PTR
from ..render.loops import (ceil_div, claim_home_first, for_range, free_workspace, home_counters, smax, smin,
                            workspace, zero_bytes)
from ..render.vectors import lane_mask, lanes, prefetch, splat, strips, vload, vstore, vtype
from . import conv_units, registry
from .conv_plan import plane_table, tap_table, unrolled_window, workspace_size
from .gemm_micro import multiply_units
from .products import PRODUCTS

NAMES = ("x", "w", "work", "out", "n", "c", "h", "wd", "k", "oh", "ow", "groups", "cg", "kg", "taps",
         "wq", "plane", "chan", "img", "planes", "rows", "sh", "sw", "taptab", "planetab", "epi", "env")
PLANE_FIELDS = 6  # row shift, column shift, first/last+1 valid plane row, first/last+1 valid column
# The input window prefetched while a channel computes is this many channels ahead. One
# channel (144 FMA cycles with AVX-512's 16x1 block) hid L2, not L3 or DRAM: a 224x224
# layer's packed input (13 MB) does not stay in L2. Zen 4, exported builds alternating,
# 3x3 64->64 at 224x224: 168 (1 ahead), 189 (2), 200 (4), 199 GFLOP/s (8); in a phase of
# this VM's slower memory 131 / 161 / 184 (1 / 2 / 4); 112x112 and 56x56 level or +2 %.
PREFETCH_CHANNELS = 4


class ConvKind(registry.Engine):
    """An engine called with the direct convolution's parameters (:data:`NAMES`), its
    body written by ``self.body(bufs).run(ctx)``."""

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        p = PRODUCTS[self.dtype]
        dtypes = self.dtype if p.uniform else dict(zip(NAMES[:4], (p.a, p.unit, p.unit, p.out)))  # w: packed units
        ctx, bufs = registry.open_params(self, module, fn, NAMES, NAMES[:4], dtypes)
        self.body(bufs).run(ctx)
        ctx.b.ret(I32(0))


@registry.kind
@dataclass(frozen=True)
class ConvEngine(ConvKind):
    kind = "conv"
    dtype: str  # the product (.products.PRODUCTS): the input and weight in its units
    lanes: int
    j: int
    v: int
    packed: int = 0  # weights in blocks of J channels (Conv2d.packed), not OIHW
    # > 0: the window is unrolled, kh rows of kw taps at consecutive elements (conv_plan.unrolled_window)
    kh: int = 0
    kw: int = 0

    def body(self, bufs: dict):
        return Emit(self, bufs)


class Emit:
    """The engine's body; ``c.syms`` holds the run-time sizes (see :data:`NAMES`)."""

    def __init__(self, engine: ConvEngine, bufs: dict):
        self.e, self.bufs = engine, bufs
        self.product = PRODUCTS[engine.dtype]
        self.elem = lookup_dtype(self.product.unit)  # of the workspace and the (packed) weight
        self.vt = ir.VectorType(self.elem.ir, engine.lanes)
        self.acc_vt = ir.VectorType(lookup_dtype(self.product.acc).ir, engine.lanes)

    def channels(self, c) -> ir.Value:
        """Input channels of a group in the product's units (:func:`.conv_plan.unit_channels`)."""
        group = self.product.group
        return c.syms["cg"] if group == 1 else ceil_div(c.b, c.syms["cg"], I64(group))

    def run(self, ctx) -> None:
        s, b = ctx.syms, ctx.b
        self.banded(ctx, ceil_div(b, s["kg"], I64(self.e.j)), pack=True)

    def banded(self, ctx, blocks, pack: bool) -> None:
        """Tasks ``t = unit * blocks + block`` (:meth:`task`) on the thread pool, a unit
        being a band of output rows of one group of one image (:meth:`unit_of`). The
        launch splits the units into one range per thread; a thread packs its range's
        input rows (``pack``) into a workspace of its own, from TVM's per-thread pool,
        computes its range's tasks (:func:`~jitbyoc.render.loops.claim_home_first`),
        then helps with the others', packing a band it takes from another range first.
        So packed rows are written and read by one core, and the rows of a thread's
        output are those it wrote the call before and its neighbours in the model
        wrote (they split by rows too): a line written by one core and then written or
        read by another moves between them, which on a machine whose cores sit on
        different dies (this VM, often: 30 or 170 ns a cache-line round trip between
        its two CPUs, phase by phase) took the shared per-channel packing, read by every
        band, to 3-8x its time and the whole conv to one thread's speed. Zen 4, 2
        threads, exported builds in alternating processes: 3x3 64->64 on 56x56 median
        1.31 / 1.35 / 1.50 ms against 1.31 / 1.97 / 2.05 before; in this VM's slow
        phases RegNetY-800MF 16-19 ms against 20-22, Inception v2 28-33 against 37-40,
        level in quiet ones (ResNet-50, VGG-19 level)."""
        s, b = ctx.syms, ctx.b
        units = b.mul(b.mul(s["n"], s["groups"]), ceil_div(b, s["oh"], s["rows"]))

        def worker(c, lo, hi, extra):
            if not pack:
                with claim_home_first(c.b, c.team, extra[0], extra[1], extra[2]) as t:
                    self.task(c, t)
                return
            own = workspace(c, self.product.unit, c.b.mul(c.syms["n"], c.syms["img"]))
            c.ptrs[self.bufs["work"].storage] = own
            with for_range(c.b, hi, "unit", start=lo) as unit:
                self.pack_band(c, unit, hi)
            with c.b.goto_block(c.b.function.entry_basic_block):
                packed = c.b.alloca(I64)  # the last band packed from another range
            c.b.store(I64(-1), packed)
            with claim_home_first(c.b, c.team, extra[0], extra[1], extra[2]) as t:
                unit = c.b.sdiv(t, extra[2])
                away = c.b.or_(c.b.icmp_signed("<", unit, lo), c.b.icmp_signed(">=", unit, hi))
                with c.b.if_then(c.b.and_(away, c.b.icmp_signed("!=", unit, c.b.load(packed, typ=I64)))):
                    self.pack_band(c, unit, unit)
                    c.b.store(unit, packed)
                self.task(c, t)
            free_workspace(c, own)

        ctx.parallel_for(units, worker, extra=[home_counters(b), units, blocks])

    # ---- 1. pack -------------------------------------------------------------------------------
    def memset0(self, c, offset, count) -> None:
        zero_bytes(c.b, c.element(self.bufs["work"], offset), c.b.mul(count, I64(self.elem.nbytes)))

    # A row of a plane is short (a 56-wide map: 224 bytes, halos of a pixel or two): its
    # copy and halos are inline vector stores, not libc calls. 64 channels of a 3x3 conv
    # on 56x56 made 32K memcpy/memset calls per image (4-8 % of such convs' time at 2
    # threads).
    def row_zeros(self, c, row, lo, hi) -> None:
        """Zero elements ``lo .. hi`` of the workspace row at ``row``."""
        b, dt = c.b, self.product.unit
        zero = ir.Constant(vtype(dt), None)
        strips(b, lo, hi, lanes(dt), lambda j, mask: vstore(
            b, zero, c.element(self.bufs["work"], b.add(row, j)), dt, mask))

    def row_padded(self, c, row, first, q_lo, q_hi) -> None:
        """The whole workspace row at ``row`` (``wq`` elements) in one pass, a vector at a
        time: input elements from ``first`` (unit stride) at columns ``q_lo .. q_hi``,
        zeros elsewhere, each vector a load whose lanes outside the columns read nothing
        and give 0, then one store (masked at the row's end only). The halos' two masked
        stores and the copy's masked load and store per row made the pack 13 % of a
        grouped 320-channel 3x3 conv on 14x14 maps (perf, Zen 4)."""
        b, dt = c.b, self.e.dtype
        n = lanes(dt)
        iota = ir.Constant(ir.VectorType(I32, n), list(range(n)))
        base = b.sub(first, q_lo)  # the input element of column 0 (before the input when padded: never read)
        lo, hi = (splat(b, b.trunc(q, I32), n) for q in (q_lo, q_hi))
        x = c.ptrs[self.bufs["x"].storage]
        elem = lookup_dtype(dt).storage_ir

        def strip(j, mask):
            cols = b.add(iota, splat(b, b.trunc(j, I32), n))
            inside = b.and_(b.icmp_signed(">=", cols, lo), b.icmp_signed("<", cols, hi))
            # not inbounds: masked-off lanes may lie before or past the input
            value = vload(b, b.gep(x, [b.add(base, j)], source_etype=elem), dt, inside, n)
            vstore(b, value, c.element(self.bufs["work"], b.add(row, j)), dt, mask)

        strips(b, I64(0), c.syms["wq"], n, strip)

    def row_copy(self, c, dst, src, count, stride) -> None:
        """Copy ``count`` elements of the input, ``stride`` apart from ``src``, to the
        workspace at ``dst``: vectors for strides 1 and 2 (a strided conv's phase planes;
        element by element, the pack of RegNetY's 112x112 stride-2 grouped conv took
        longer than the conv), elements otherwise."""
        b, dt, n = c.b, self.e.dtype, lanes(self.e.dtype)
        x, work = self.bufs["x"], self.bufs["work"]

        def vectors(load):  # load(j, mask): the vector of elements j .. j + n
            strips(b, I64(0), count, n, lambda j, mask: vstore(
                b, load(j, mask), c.element(work, b.add(dst, j)), dt, mask))

        with b.if_else(b.icmp_signed("==", stride, I64(1))) as (unit, strided):
            with unit:
                vectors(lambda j, mask: vload(b, c.element(x, b.add(src, j)), dt, mask))
            with strided, b.if_else(b.icmp_signed("==", stride, I64(2))) as (pairs, other):
                with pairs:
                    vectors(lambda j, mask: self.even_lanes(
                        c, b.add(src, b.mul(j, I64(2))), n if mask is None else b.sub(count, j)))
                with other, for_range(b, count, "q") as q:
                    c.store(work, b.add(dst, q), c.load(x, b.add(src, b.mul(q, stride))))

    def sources(self, c, n, ch) -> list:
        """``[(input offset of the channel's plane, valid)]`` of workspace channel ``ch`` of
        image ``n``: the channel itself (valid None), or in units the ``group`` channels
        it interleaves (:func:`.conv_units.sources`)."""
        if self.product.group > 1:
            return conv_units.sources(self, c, n, ch)
        s = c.syms
        return [(c.b.mul(c.b.add(c.b.mul(n, s["c"]), ch), c.b.mul(s["h"], s["wd"])), None)]

    def even_lanes(self, c, at, count):
        """Input elements ``at, at + 2, ...`` (``count`` of them, at most a vector; in units,
        a vector of units' worth of each channel): the even lanes of two vector loads,
        which read no element past the last one taken."""
        b, dt = c.b, self.product.a
        n, x = (lanes(self.product.unit) if self.product.group > 1 else lanes(dt)), self.bufs["x"]
        reach = b.sub(b.mul(I64(count) if isinstance(count, int) else count, I64(2)), I64(1))
        lo = vload(b, c.element(x, at), dt, None if isinstance(count, int) else lane_mask(b, reach, n), n)
        hi = vload(b, c.element(x, b.add(at, I64(n))), dt, lane_mask(b, b.sub(reach, I64(n)), n), n)
        return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, n), list(range(0, 2 * n, 2))))

    @staticmethod
    def unit_of(c, unit) -> tuple:
        """(group, band, image) of a unit: groups vary fastest, then bands, so that a
        thread's range of units is a range of rows of every group (a grouped conv's
        neighbours in the model split their work by rows, not channels)."""
        b, s = c.b, c.syms
        grp, rest = b.srem(unit, s["groups"]), b.sdiv(unit, s["groups"])
        bands = ceil_div(b, s["oh"], s["rows"])
        return grp, b.srem(rest, bands), b.sdiv(rest, bands)

    def pack_band(self, c, unit, packs_next) -> None:
        """Pack the plane rows band ``unit`` (:meth:`unit_of`) reads, in every plane of
        every channel of its group: the grid rows of its output rows, and the rows below
        them that its window reaches unless the next band of its group is packed here
        too (``unit + groups < packs_next``); the image's last band of its last group
        also zeroes the slack after the image's last channel."""
        b, s = c.b, c.syms
        grp, band, n = self.unit_of(c, unit)
        last = b.icmp_signed("==", band, b.sub(ceil_div(b, s["oh"], s["rows"]), I64(1)))
        r0 = b.mul(band, s["rows"])
        r1 = smin(b, b.add(r0, s["rows"]), s["oh"])
        reach = b.sub(b.sdiv(s["plane"], s["wq"]), s["oh"])  # plane rows below the last output row
        next_here = b.and_(b.icmp_signed("<", b.add(unit, s["groups"]), packs_next), b.not_(last))
        r1 = b.select(next_here, r1, b.add(r1, reach))
        cg = self.channels(c)
        ch0 = b.mul(grp, cg)
        with for_range(b, b.add(ch0, cg), "ch", start=ch0) as ch:
            self.pack_rows(c, n, ch, r0, r1)
        with b.if_then(b.and_(last, b.icmp_signed("==", grp, b.sub(s["groups"], I64(1))))):
            packed = s["c"] if self.product.group == 1 else b.mul(s["groups"], cg)  # channels packed
            tail = b.add(b.mul(n, s["img"]), b.mul(packed, s["chan"]))
            self.memset0(c, tail, b.sub(b.add(b.mul(n, s["img"]), s["img"]), tail))

    def pack_rows(self, c, n, ch, r0, r1) -> None:
        """Rows ``r0 .. r1`` of every plane of input channel ``ch`` of image ``n``: the
        input's pixels where the plane table says they are valid, zeros elsewhere."""
        with for_range(c.b, c.syms["planes"], "p") as p:
            self.pack_plane(c, n, ch, p, r0, r1)

    def plane_fields(self, c, p) -> tuple:
        """Plane ``p``'s row of the plane table (:data:`PLANE_FIELDS`)."""
        b = c.b
        table = b.inttoptr(c.syms["planetab"], PTR)
        return tuple(b.load(b.gep(table, [b.add(b.mul(p, I64(PLANE_FIELDS)), I64(f))], source_etype=I64), typ=I64)
                     for f in range(PLANE_FIELDS))

    def plane_at(self, c, n, ch, p) -> ir.Value:
        """The workspace offset of plane ``p`` of channel ``ch`` of image ``n``."""
        b, s = c.b, c.syms
        return b.add(b.add(b.mul(n, s["img"]), b.mul(ch, s["chan"])), b.mul(p, s["plane"]))

    def pack_plane(self, c, n, ch, p, r0, r1) -> None:
        """Rows ``r0 .. r1`` of plane ``p`` of input channel ``ch`` of image ``n``."""
        b, s = c.b, c.syms
        srcs = self.sources(c, n, ch)
        rshift, cshift, r_lo, r_hi, q_lo, q_hi = self.plane_fields(c, p)
        plane = self.plane_at(c, n, ch, p)
        lo, hi = smax(b, r0, r_lo), smin(b, r1, r_hi)  # the valid rows of the range
        for z0, z1 in ((r0, smin(b, r1, r_lo)), (smax(b, r0, r_hi), r1)):  # zero rows above, below
            self.memset0(c, b.add(plane, b.mul(z0, s["wq"])), b.mul(smax(b, I64(0), b.sub(z1, z0)), s["wq"]))
        with for_range(b, hi, "r", start=lo) as r:
            row = b.add(plane, b.mul(r, s["wq"]))
            firsts = [(b.add(b.add(src, b.mul(b.add(b.mul(r, s["sh"]), rshift), s["wd"])),
                             b.add(b.mul(q_lo, s["sw"]), cshift)), valid) for src, valid in srcs]
            if self.product.group > 1:
                self.row_zeros(c, row, I64(0), q_lo)
                self.row_zeros(c, row, q_hi, s["wq"])
                conv_units.row_copy(self, c, b.add(row, q_lo), firsts, b.sub(q_hi, q_lo), s["sw"])
            else:
                with b.if_else(b.icmp_signed("==", s["sw"], I64(1))) as (unit, strided):
                    with unit:
                        self.row_padded(c, row, firsts[0][0], q_lo, q_hi)
                    with strided:
                        self.row_zeros(c, row, I64(0), q_lo)
                        self.row_zeros(c, row, q_hi, s["wq"])
                        self.row_copy(c, b.add(row, q_lo), firsts[0][0], b.sub(q_hi, q_lo), s["sw"])

    # ---- 2. compute ----------------------------------------------------------------------------
    def task(self, c, t) -> None:
        b, s, e = c.b, c.syms, self.e
        blocks = ceil_div(b, s["kg"], I64(e.j))
        blk, unit = b.srem(t, blocks), b.sdiv(t, blocks)
        grp, band, n = self.unit_of(c, unit)
        oc0 = b.add(b.mul(grp, s["kg"]), b.mul(blk, I64(e.j)))
        jn = smin(b, I64(e.j), b.sub(s["kg"], b.mul(blk, I64(e.j))))
        r0 = b.mul(band, s["rows"])
        r1 = smin(b, b.add(r0, s["rows"]), s["oh"])
        pstart = b.mul(r0, s["wq"])
        pend = b.add(b.mul(b.sub(r1, I64(1)), s["wq"]), s["ow"])
        span = I64(e.v * e.lanes)
        xbase = b.add(b.mul(n, s["img"]), b.mul(grp, b.mul(self.channels(c), s["chan"])))
        wrows = self.weight_rows(c, oc0, jn)
        with b.goto_block(b.function.entry_basic_block):
            accs = [b.alloca(self.acc_vt) for _ in range(e.j * e.v)]
        with for_range(b, ceil_div(b, b.sub(pend, pstart), span), "chunk") as k:
            p0 = b.add(pstart, b.mul(k, span))
            self.accumulate(c, b.add(xbase, p0), wrows, accs)
            self.store_chunk(c, n, oc0, jn, p0, pend, accs)
        registry.call_back(b, s["epi"], s["env"], [n, oc0, jn, r0, b.sub(r1, r0)])

    def weight_rows(self, c, oc0, jn) -> list:
        """Per channel j of the block, the offset of its weights (of input channel 0, tap
        0) in ``w``: OIHW rows (channels past ``jn`` re-read the last one's), or, packed
        (``w`` is ``K/J`` blocks of ``Cin/groups x taps x J``: the block's J weights of a tap
        are one contiguous run, :func:`jitbyoc.tvm.conv_weights.pack`), the block's start
        plus j."""
        b, s, e = c.b, c.syms, self.e
        ktaps = b.mul(self.channels(c), s["taps"])
        if e.packed:
            return [b.add(b.mul(oc0, ktaps), I64(j)) for j in range(e.j)]
        return [b.mul(b.add(oc0, smin(b, I64(j), b.sub(jn, I64(1)))), ktaps) for j in range(e.j)]

    def accumulate(self, c, xoff, wrows, accs) -> None:
        """``accs[j*V + v] = sum over channels and taps`` for the chunk at ``xoff``: per
        channel a loop over the tap table, or the window unrolled (:attr:`ConvEngine.kh`)."""
        b, s, e, vt, elem = c.b, c.syms, self.e, self.acc_vt, self.elem
        taps = b.inttoptr(s["taptab"], PTR)
        tap_at = lambda t: b.load(b.gep(taps, [t], source_etype=I64), typ=I64)  # noqa: E731
        rows = [tap_at(I64(i * e.kw)) for i in range(e.kh)]  # loop-invariant: hoisted
        for a in accs:
            b.store(ir.Constant(vt, None), a)
        with for_range(b, self.channels(c), "ic") as ic:
            xp = c.element(self.bufs["work"], b.add(xoff, b.mul(ic, s["chan"])))
            wps = [c.element(self.bufs["w"], b.add(w, b.mul(b.mul(ic, s["taps"]), self.tap_step)))
                   for w in wrows]
            # not inbounds: the last channels' windows ahead lie past the workspace (never read)
            ahead = b.gep(c.ptrs[self.bufs["work"].storage],
                          [b.add(xoff, b.mul(b.add(ic, I64(PREFETCH_CHANNELS)), s["chan"]))], source_etype=elem.ir)
            if e.kh:
                self.update(b, accs, lambda vals: self.window(c, xp, ahead, rows, wps, vals))
            else:
                with for_range(b, s["taps"], "tap") as t:
                    ahead_by = [v * e.lanes for v in sorted({0, e.v - 1})]
                    self.update(b, accs, lambda vals: self.tap(c, xp, ahead, tap_at(t), wps, t, vals, ahead_by))

    def update(self, b, accs, compute) -> None:
        """``accs`` (allocas) = ``compute(their values)``."""
        for a, val in zip(accs, compute([b.load(a, typ=self.acc_vt) for a in accs])):
            b.store(val, a)

    def window(self, c, xp, ahead, rows, wps, vals) -> list:
        """Every tap of the window, unrolled: row ``i``'s taps at ``rows[i] + 0 .. kw - 1``."""
        b, e, elem = c.b, self.e, self.elem
        # a window row reads V vectors and kw - 1 elements, from any alignment: a line
        # every 64 bytes of them, and one more
        row_lines = range(0, (e.v * e.lanes + e.kw - 1) * elem.nbytes + 63, 64)
        for i, row in enumerate(rows):
            for col in range(e.kw):
                vals = self.tap(c, xp, ahead, b.add(row, I64(col)), wps, I64(i * e.kw + col), vals,
                                [] if col else [line // elem.nbytes for line in row_lines])
        return vals

    @property
    def tap_step(self):
        """Elements between a channel's weights of two taps."""
        return I64(self.e.j if self.e.packed else 1)

    def tap(self, c, xp, ahead, off, wps, t, vals, prefetches: list[int]) -> list:
        """One tap ``t`` at offset ``off`` of the channel at ``xp``: ``V`` vector loads, ``J``
        broadcast weights, ``J * V`` FMAs into the accumulator values ``vals`` (returned
        updated); first prefetches of a later channel's window at ``ahead + off`` plus each
        of ``prefetches`` elements, while this one computes."""
        b, e, vt, elem = c.b, self.e, self.vt, self.elem
        at = b.gep(ahead, [off], source_etype=elem.ir)
        for ahead_by in prefetches:
            prefetch(b, b.gep(at, [I64(ahead_by)], source_etype=elem.ir))
        vals = list(vals)
        xs = [b.load(b.gep(xp, [b.add(off, I64(v * e.lanes))], source_etype=elem.ir), typ=vt, align=elem.nbytes)
              for v in range(e.v)]
        for j in range(e.j):
            at = b.gep(wps[j], [b.mul(t, self.tap_step)], source_etype=elem.ir)
            wv = splat(b, b.load(at, typ=elem.ir), e.lanes)
            for v in range(e.v):
                vals[j * e.v + v] = multiply_units(b, self.product, xs[v], wv, vals[j * e.v + v])
        return vals

    def store_chunk(self, c, n, oc0, jn, p0, pend, accs) -> None:
        """Store the chunk at grid pixel ``p0`` (the band's grid pixels end at ``pend``),
        vector by vector: a vector inside one output row (or, in a layout without halo
        columns, inside the band) is one plain store per channel of the block; any other
        takes :meth:`store_rows`. A masked store costs Zen 4 several times a plain one:
        stores only ever masked held a 3-channel stem conv to 35 % of peak."""
        b, s, e = c.b, c.syms, self.e
        lanes = e.lanes
        dense = b.icmp_signed("==", s["wq"], s["ow"])  # grid pixel = output pixel
        for v in range(e.v):
            q = b.add(p0, I64(v * lanes))
            row = b.sdiv(q, s["wq"])
            col = b.sub(q, b.mul(row, s["wq"]))
            whole = b.and_(b.icmp_signed("<=", b.add(q, I64(lanes)), pend),
                           b.or_(dense, b.icmp_signed("<=", b.add(col, I64(lanes)), s["ow"])))
            with b.if_else(whole) as (plain, edge):
                with plain:
                    for j in range(e.j):
                        with b.if_then(b.icmp_signed("<", I64(j), jn)):
                            at = c.element(self.bufs["out"], self.output_at(c, n, oc0, j, row, col))
                            vstore(b, b.load(accs[j * e.v + v], typ=self.acc_vt), at, self.product.out)
                with edge:
                    self.store_rows(c, n, oc0, jn, q, row, col, pend, [accs[j * e.v + v] for j in range(e.j)])

    def store_rows(self, c, n, oc0, jn, q, row0, col0, pend, accs) -> None:
        """Store the vector at grid pixel ``q`` (row ``row0``, column ``col0`` of the grid)
        of each channel of the block: it covers parts of a few output rows; one masked
        store per row keeps the lanes inside the row (no halo columns), the band (grid
        pixels < ``pend``) and the block (channels < jn)."""
        b, s, e, vt = c.b, c.syms, self.e, self.acc_vt
        lanes = e.lanes
        it = ir.VectorType(I32, lanes)
        iota = ir.Constant(it, list(range(lanes)))
        touched = b.add(b.sdiv(b.add(s["wq"], I64(lanes - 2)), s["wq"]), I64(1))
        ow = splat(b, b.trunc(s["ow"], I32), lanes)
        band = b.icmp_signed("<", b.add(splat(b, b.trunc(q, I32), lanes), iota), splat(b, b.trunc(pend, I32), lanes))
        with for_range(b, touched, "sr") as r:
            row, shift = b.add(row0, r), b.sub(col0, b.mul(r, s["wq"]))
            cols = b.add(iota, splat(b, b.trunc(shift, I32), lanes))
            inside = b.and_(b.icmp_signed(">=", cols, ir.Constant(it, None)), b.icmp_signed("<", cols, ow))
            inside = b.and_(inside, band)
            for j, acc in enumerate(accs):
                live = splat(b, b.icmp_signed("<", I64(j), jn), lanes)
                at = self.output_at(c, n, oc0, j, row, shift)
                # not inbounds: lane 0 may sit before the row; masked-off lanes are never touched
                ptr = b.gep(c.ptrs[self.bufs["out"]], [at], source_etype=vt.element)
                vstore(b, b.load(acc, typ=vt), ptr, self.product.out, b.and_(inside, live))

    @staticmethod
    def output_at(c, n, oc0, j, row, col):
        """The output element index of channel ``oc0 + j`` of image ``n`` at ``(row, col)``."""
        b, s = c.b, c.syms
        chan = b.add(b.mul(n, s["k"]), b.add(oc0, I64(j)))
        return b.add(b.mul(b.add(b.mul(chan, s["oh"]), row), s["ow"]), col)


# ---- the region's side -----------------------------------------------------------------------

def _table(ctx, kind: str, values: list[int]) -> ir.Value:
    """A constant i64 array in the region's module, as an i64 address."""
    ty = ir.ArrayType(I64, max(1, len(values)))
    g = ir.GlobalVariable(ctx.module, ty, f"{ctx.name}_{kind}{len(ctx.module.globals)}")
    g.global_constant, g.linkage = True, "private"
    g.initializer = ir.Constant(ty, values or [0])
    return ctx.b.ptrtoint(g, I64)


def call(stage, ctx, plan=None, engine=None, img: int | None = None, weight=None, callback=None) -> None:
    """Emit the call of ``stage``'s (a :class:`~.conv2d.Conv2d`) engine, with its epilogue
    outlined into a callback: ``plan`` (default ``stage.plan``) on ``engine`` (default
    its :class:`ConvEngine`); ``img`` overrides the elements of one image in the
    workspace (:mod:`.conv_channels`: no slack); ``weight``, a pointer to the weight
    packed in blocks (default: the stage's weight, packed as ``stage.packed`` says);
    ``callback``, ``(nargs, body(ctx, args))`` of an engine that calls back with other
    arguments than a finished band's (:mod:`.conv_tiles`)."""
    g, out = stage.geo, stage.out
    plan = plan or stage.plan
    dt = stage.inputs[0].dtype  # the product
    packed = int(stage.packed or weight is not None)
    engine = engine or ConvEngine(dt, plan.lanes, plan.j, plan.v, packed, *unrolled_window(plan))

    def epilogue(c, args):
        n, oc0, jn, r0, rows = args
        if out.ndim == 3:
            c.epilogue(stage, [n, oc0, I64(0)], [1, jn, g.ow])
        else:
            c.epilogue(stage, [n, oc0, r0, I64(0)], [1, jn, rows, g.ow])

    epi, env = ctx.outline("epi", *(callback or (5, epilogue)))  # empty without an epilogue: the engine calls it
    lay = plan.layout
    x, w = stage.inputs
    img = workspace_size(plan, dt) if img is None else img
    sizes = [ctx.dim(g.n), g.c, g.h, g.w, g.k, g.oh, g.ow, g.groups, g.cg, g.kg, g.taps, lay.wq,
             lay.plane_size, lay.channel_size(), img, lay.planes, plan.rows, *lay.geo.stride]  # packing: the layout's
    # "work": each thread packs into a workspace of its own (Emit.banded); the slot is unused
    ptrs = [ctx.element(buf, I64(0)) for buf in (x, w, x, out)]
    ptrs[1] = ptrs[1] if weight is None else weight
    registry.call(ctx, engine, ptrs + sizes + [_table(ctx, "taps", tap_table(plan)),
                                              _table(ctx, "planes", plane_table(plan)), epi, env])
