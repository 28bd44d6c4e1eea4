"""LLVM rendering of :class:`~jitbyoc.kernels.conv2d.Conv2d`: a direct convolution.

1. *Pack*: each input channel is copied into the zero-padded planes of the plan's
   :class:`~.conv_plan.Layout`, so that every tap of the window reads a contiguous run.
2. *Compute*: a chunk of ``V * lanes`` consecutive grid pixels times ``J`` output
   channels lives in ``J * V`` vector accumulators; per input channel and tap it costs
   ``V`` vector loads, ``J`` broadcast weights and ``J * V`` FMAs. A finished chunk is
   stored with masked vector stores (one per output row it touches), and a finished
   band of rows gets the fused epilogue while it is in cache.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ..dtypes import dtype as lookup_dtype
from ..lowering.loops import I64, for_range
from .conv_plan import UNROLL_COLUMNS, Plan, workspace_size

I1, I8, I32 = ir.IntType(1), ir.IntType(8), ir.IntType(32)
PTR = ir.PointerType()


def _declare(module, name, ret, args):
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args), name)


def _smin(b, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


def _smax(b, x, y):
    return b.select(b.icmp_signed(">", x, y), x, y)


def _entry_alloca(b, typ, count=None):
    with b.goto_block(b.function.entry_basic_block):
        return b.alloca(typ, size=count)


def _memset0(c, buf, offset, count: int) -> None:
    if count <= 0:
        return
    b = c.b
    fn = _declare(c.module, "llvm.memset.p0.i64", ir.VoidType(), [PTR, I8, I64, I1])
    nbytes = count * lookup_dtype(buf.dtype).nbytes
    b.call(fn, [c.element(buf, offset), I8(0), I64(nbytes), I1(0)])


# ---- 1. pack ---------------------------------------------------------------------------------

def _pack_channel(stage, c, n, ch) -> None:
    """The planes of channel ``ch`` of image ``n`` (all sizes static but ``n``)."""
    b, g, lay = c.b, stage.geo, stage.plan.layout
    x, work = stage.inputs[0], stage.work
    (sh, sw), (pt, pl, _, _) = g.stride, g.pad
    img = workspace_size(stage.plan, x.dtype)
    src = b.mul(b.add(b.mul(n, I64(g.c)), ch), I64(g.h * g.w))
    dst0 = b.add(b.mul(n, I64(img)), b.mul(ch, I64(lay.channel_size())))
    for k, (a, bb) in enumerate(lay.plane_sources()):
        plane = b.add(dst0, I64(k * lay.plane_size))
        # plane row r reads input row sh*r + a - pt; plane column q input column sw*q + bb - pl
        r_lo, r_hi = _valid_range(lay.hq, sh, a - pt, g.h)
        q_lo, q_hi = _valid_range(lay.wq, sw, bb - pl, g.w)
        if r_lo >= r_hi or q_lo >= q_hi:
            _memset0(c, work, plane, lay.plane_size)
            continue
        _memset0(c, work, plane, r_lo * lay.wq)
        _memset0(c, work, b.add(plane, I64(r_hi * lay.wq)), (lay.hq - r_hi) * lay.wq)
        with for_range(b, I64(r_hi), "r", start=I64(r_lo)) as r:
            row = b.add(plane, b.mul(r, I64(lay.wq)))
            _memset0(c, work, row, q_lo)
            _memset0(c, work, b.add(row, I64(q_hi)), lay.wq - q_hi)
            srow = b.add(src, b.mul(b.add(b.mul(r, I64(sh)), I64(a - pt)), I64(g.w)))
            with for_range(b, I64(q_hi), "q", start=I64(q_lo)) as q:
                col = b.add(b.mul(q, I64(sw)), I64(bb - pl))
                c.store(work, b.add(row, q), c.load(x, b.add(srow, col)))
    last = b.icmp_signed("==", ch, I64(g.c - 1))
    with b.if_then(last):
        tail = g.c * lay.channel_size()
        _memset0(c, work, b.add(b.mul(n, I64(img)), I64(tail)), img - tail)


def _valid_range(count: int, step: int, shift: int, size: int) -> tuple[int, int]:
    """The indices q in [0, count) with 0 <= step*q + shift < size, as [lo, hi)."""
    lo = max(0, -(shift // step)) if shift < 0 else 0
    hi = min(count, (size - 1 - shift) // step + 1) if size - 1 - shift >= 0 else 0
    return lo, max(lo, hi)


# ---- 2. compute ------------------------------------------------------------------------------

def _fma(c, vt):
    bits = 32 if isinstance(vt.element, ir.FloatType) else 64
    return _declare(c.module, f"llvm.fma.v{vt.count}f{bits}", vt, [vt, vt, vt])


def _splat(b, scalar, vt):
    undef = ir.Constant(vt, ir.Undefined)
    one = b.insert_element(undef, scalar, I32(0))
    return b.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vt.count), None))


def _accumulate(stage, c, jn: int, plan: Plan, xoff, woffs, accs) -> None:
    """``accs[j*V + v] = sum over channels and taps`` for the chunk at ``xoff``."""
    b, g, lay = c.b, stage.geo, plan.layout
    (x, w), work = stage.inputs, stage.work
    vt = accs[0].allocated_type
    elem = lookup_dtype(x.dtype)
    fma = _fma(c, vt)
    for a in accs:
        b.store(ir.Constant(vt, None), a)

    def tap(xp, wps, widx, off):
        vals = [b.load(a, typ=vt) for a in accs]
        xs = [b.load(b.gep(xp, [b.add(off, I64(v * plan.lanes))], source_etype=elem.ir),
                     typ=vt, align=elem.nbytes) for v in range(plan.v)]
        for j in range(jn):
            wv = _splat(b, b.load(b.gep(wps[j], [widx], source_etype=elem.ir), typ=elem.ir), vt)
            for v in range(plan.v):
                vals[j * plan.v + v] = b.call(fma, [xs[v], wv, vals[j * plan.v + v]])
        for a, val in zip(accs, vals):
            b.store(val, a)

    with for_range(b, I64(g.cg), "ic") as ic:
        xp = c.element(work, b.add(xoff, b.mul(ic, I64(lay.channel_size()))))
        wps = [c.element(w, b.add(wo, b.mul(ic, I64(g.taps)))) for wo in woffs]
        for i0, count, step in tap_classes(g.kh, g.stride[0], g.dilation[0]):
            with _maybe_loop(b, count, "ki") as m:
                i = b.add(I64(i0), b.mul(m, I64(step)))
                row = b.mul(m, I64(step * g.dilation[0] // g.stride[0] * lay.wq))
                for widx, off in _row_taps(b, g, lay, i, i0, row):
                    tap(xp, wps, widx, off)


def _row_taps(b, g, lay, i, i0: int, row):
    """(weight index, workspace offset) of the taps of kernel row ``i`` (of class ``i0``,
    ``row`` its offset within the class): unrolled columns, or column phase classes
    looped at run time (grid layout with a wide window; each class one plane)."""
    if lay.dense or g.kw <= UNROLL_COLUMNS:
        for j in range(g.kw):
            yield b.add(b.mul(i, I64(g.kw)), I64(j)), b.add(row, I64(lay.tap(i0, j)))
        return
    for j0, cols, cstep in tap_classes(g.kw, g.stride[1], g.dilation[1]):
        with _maybe_loop(b, cols, "kj") as q:
            j = b.add(I64(j0), b.mul(q, I64(cstep)))
            shift = b.mul(q, I64(cstep * g.dilation[1] // g.stride[1]))
            yield b.add(b.mul(i, I64(g.kw)), j), b.add(row, b.add(I64(lay.tap(i0, j0)), shift))


def tap_classes(k: int, stride: int, dilation: int) -> list[tuple[int, int, int]]:
    """Kernel indices [0, k) grouped by the stride phase they read, as (first, count,
    step): within a class the phase plane is fixed and the offset grows linearly."""
    step = stride // math.gcd(stride, dilation)
    return [(i0, len(range(i0, k, step)), step) for i0 in range(min(step, k))]


class _maybe_loop:
    """A runtime loop over [0, count), or just index 0 when count is 1."""

    def __init__(self, b, count: int, name: str):
        self.loop = for_range(b, I64(count), name) if count > 1 else None

    def __enter__(self):
        return self.loop.__enter__() if self.loop else I64(0)

    def __exit__(self, *exc):
        return self.loop.__exit__(*exc) if self.loop else False


def _store_chunk(stage, c, jn: int, plan: Plan, n, oc0, p0, r1, accs) -> None:
    """Store the accumulators of the chunk at grid pixel ``p0`` into ``out``: a vector of
    grid pixels covers parts of at most ``rows`` output rows; one masked store per row
    keeps the lanes inside the row (no halo columns) and inside the band (rows < r1)."""
    b, g, out, lanes = c.b, stage.geo, stage.out, plan.lanes
    vt = accs[0].allocated_type
    it = ir.VectorType(I32, lanes)
    iota = ir.Constant(it, list(range(lanes)))
    rows = (plan.layout.wq + lanes - 2) // plan.layout.wq + 1
    bits = 32 if isinstance(vt.element, ir.FloatType) else 64
    # the (value, ptr, i32 align, mask) signature; LLVM 22 upgrades it to an align attribute
    store = _declare(c.module, f"llvm.masked.store.v{lanes}f{bits}.p0", ir.VoidType(),
                     [vt, PTR, I32, ir.VectorType(I1, lanes)])
    for v in range(plan.v):
        q = b.add(p0, I64(v * lanes))
        row0 = b.sdiv(q, I64(plan.layout.wq))
        col0 = b.sub(q, b.mul(row0, I64(plan.layout.wq)))
        for r in range(rows):
            row, shift = b.add(row0, I64(r)), b.sub(col0, I64(r * plan.layout.wq))
            cols = b.add(iota, _splat(b, b.trunc(shift, I32), it))
            inside = b.and_(b.icmp_signed(">=", cols, ir.Constant(it, None)),
                            b.icmp_signed("<", cols, ir.Constant(it, [g.ow] * lanes)))
            mask = b.and_(inside, _splat(b, b.icmp_signed("<", row, r1), ir.VectorType(I1, lanes)))
            for j in range(jn):
                chan = b.add(b.mul(n, I64(g.k)), b.add(oc0, I64(j)))
                at = b.add(b.mul(b.add(b.mul(chan, I64(g.oh)), row), I64(g.ow)), shift)
                # not inbounds: lane 0 may sit before the row; masked-off lanes are never touched
                ptr = b.gep(c.ptrs[out.storage], [at], source_etype=vt.element)
                b.call(store, [b.load(accs[j * plan.v + v], typ=vt), ptr,
                               I32(lookup_dtype(out.dtype).nbytes), mask])


def _block(stage, c, jn: int, plan: Plan, n, grp, oc0, band) -> None:
    """Output channels [oc0, oc0 + jn) of group ``grp``, rows of ``band``, image ``n``."""
    b, g = c.b, stage.geo
    vt = ir.VectorType(lookup_dtype(stage.out.dtype).ir, plan.lanes)
    accs = [_entry_alloca(b, vt) for _ in range(jn * plan.v)]
    r0 = b.mul(band, I64(plan.rows))
    r1 = _smin(b, b.add(r0, I64(plan.rows)), I64(g.oh))
    pstart = b.mul(r0, I64(plan.layout.wq))
    pend = b.add(b.mul(b.sub(r1, I64(1)), I64(plan.layout.wq)), I64(g.ow))
    span = plan.v * plan.lanes
    chunks = b.sdiv(b.add(b.sub(pend, pstart), I64(span - 1)), I64(span))
    xbase = b.add(b.mul(n, I64(workspace_size(plan, stage.out.dtype))),
                  b.mul(grp, I64(g.cg * plan.layout.channel_size())))
    woffs = [b.mul(b.add(oc0, I64(j)), I64(g.cg * g.taps)) for j in range(jn)]
    with for_range(b, chunks, "chunk") as k:
        p0 = b.add(pstart, b.mul(k, I64(span)))
        _accumulate(stage, c, jn, plan, b.add(xbase, p0), woffs, accs)
        _store_chunk(stage, c, jn, plan, n, oc0, p0, r1, accs)
    if stage.out.ndim == 3:
        c.epilogue(stage, [n, oc0, I64(0)], [1, jn, g.ow])
    else:
        c.epilogue(stage, [n, oc0, r0, I64(0)], [1, jn, b.sub(r1, r0), g.ow])


def emit_conv(stage, ctx) -> None:
    """Pack the input, then run every (image, group, channel block, band) task."""
    g, plan = stage.geo, stage.plan
    blocks = math.ceil(g.kg / plan.j)
    bands = math.ceil(g.oh / plan.rows)
    rem = g.kg % plan.j

    def pack(c, lo, hi, _extra):
        with for_range(c.b, hi, "t", start=lo) as t:
            _pack_channel(stage, c, c.b.sdiv(t, I64(g.c)), c.b.srem(t, I64(g.c)))

    def task(c, t):
        b = c.b
        band = b.srem(t, I64(bands))
        rest = b.sdiv(t, I64(bands))
        blk = b.srem(rest, I64(blocks))
        rest = b.sdiv(rest, I64(blocks))
        grp, n = b.srem(rest, I64(g.groups)), b.sdiv(rest, I64(g.groups))
        oc0 = b.add(b.mul(grp, I64(g.kg)), b.mul(blk, I64(plan.j)))
        if not rem:
            _block(stage, c, plan.j, plan, n, grp, oc0, band)
        else:
            _tail_or_full(stage, c, rem, plan, n, grp, oc0, band, b.icmp_signed("==", blk, I64(blocks - 1)))

    ctx.parallel_for(ctx.product([g.n, g.c]), pack)
    _dynamic_for(ctx, ctx.product([g.n, g.groups * blocks * bands]), task)


def _dynamic_for(ctx, count, body) -> None:
    """``body(c, t)`` for every task t in [0, count) on the thread pool, each worker
    claiming the next task from a shared atomic counter: a worker that the OS preempts
    (a busy machine) then delays one task, not a fixed share of them."""
    b = ctx.b
    with b.goto_block(b.function.entry_basic_block):
        counter = b.alloca(I64)
    b.store(I64(0), counter)

    def worker(c, _lo, _hi, extra):
        cb = c.b
        shared = cb.inttoptr(extra[0], PTR)
        claim, work, done = (cb.append_basic_block(f"task.{k}") for k in ("claim", "run", "done"))
        cb.branch(claim)
        cb.position_at_end(claim)
        t = cb.atomic_rmw("add", shared, I64(1), "monotonic")
        cb.cbranch(cb.icmp_signed("<", t, extra[1]), work, done)
        cb.position_at_end(work)
        body(c, t)
        cb.branch(claim)
        cb.position_at_end(done)

    ctx.parallel_for(count, worker, extra=[b.ptrtoint(counter, I64), count])


def _tail_or_full(stage, c, rem, plan, n, grp, oc0, band, is_tail) -> None:
    b = c.b
    with b.if_else(is_tail) as (tail, full):
        with tail:
            _block(stage, c, rem, plan, n, grp, oc0, band)
        with full:
            _block(stage, c, plan.j, plan, n, grp, oc0, band)
