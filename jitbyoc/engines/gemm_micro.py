"""LLVM building blocks of the GEMM engine (:mod:`.gemm`): the register-blocked
microkernel, vector masks, and panel packers (vector row copies; in-register transposes).
A custom operand's ``pack_llvm`` may call :func:`pack_rows` / :func:`pack_transposed`.

Everything works on explicit ``<VL x T>`` vectors (VL = 64 bytes / element size, one
AVX-512 register) so the code does not depend on the loop vectorizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import BFLOAT, I1, I32, I64, PTR
from ..render import isa
from ..render.isa import VECTOR_BYTES
from ..render.loops import for_range
from ..render.vectors import (
    intrinsic,
    lane_mask,
    lanes,
    multiply_add,
    prefetch,
    splat,
    vload,
    vstore,
    vtype,
)
from . import registry
from .products import PRODUCTS

EDGE_UNROLL = 1  # edge tiles are few: their microkernels are not unrolled (smaller engine)


def gep(b, ptr, offset, dt):
    off = I64(offset) if isinstance(offset, int) else offset
    return b.gep(ptr, [off], source_etype=lookup_dtype(dt).ir, inbounds=True)


def transpose(b: ir.IRBuilder, rows: list) -> list:
    """Transpose a VL x VL block held as VL row vectors (VL a power of two).

    Stage ``d`` swaps bit ``d`` of the row index with bit ``d`` of the lane index between
    rows ``i`` and ``i + d``; after every bit has been swapped the block is transposed.
    Each step is one two-source shuffle (``vpermt2ps`` / ``vunpck*`` / ``vshuf*``)."""
    n = len(rows)
    rows = list(rows)
    d = n // 2
    while d:
        lo = ir.Constant(ir.VectorType(I32, n), [l if not l & d else n + l - d for l in range(n)])
        hi = ir.Constant(ir.VectorType(I32, n), [l + d if not l & d else n + l for l in range(n)])
        for i in range(n):
            if not i & d:
                a, c = rows[i], rows[i + d]
                rows[i], rows[i + d] = b.shuffle_vector(a, c, lo), b.shuffle_vector(a, c, hi)
        d //= 2
    return rows


MICRO_TYPE = ir.FunctionType(ir.VoidType(), [PTR, I64, I64, PTR, I64, I64, PTR, I64, I64, I64, I1])
# the GEMM engine's pipeline (gemm_engine.GemmEngine), and its microkernels', which were
# compiled inside it before they were engines of their own: the driver's packed-panel
# addressing needs strength reduction (2x slower without); lean passes vs O1: MLP +0.7 %,
# its torch.export form -2 %, encoder -0.3 %, sgemm 1000^3 equal (alternating A/B),
# compile 117 -> 80 ms
GEMM_PIPELINE = registry.Pipeline(speed_level=0, vectorize=False, lsr=True)


@registry.kind
@dataclass(frozen=True)
class Micro(registry.Engine):
    """One microkernel (:func:`microkernel`) as a library engine: compiled once per machine
    and shared by every product that calls it, the GEMM engines, inline products and
    fused attention alike (ViT's two GEMM engines and its attention region each carried
    their own copies: 170 of a GEMM engine's 255 KB of IR)."""
    kind = "micro"
    pipeline = GEMM_PIPELINE
    dtype: str
    mr: int
    nv: int
    unroll: int
    masked: int
    full: int

    def signature(self) -> ir.FunctionType:
        return MICRO_TYPE

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        _micro_body(fn, self.dtype, self.mr, self.nv, self.unroll, bool(self.masked), bool(self.full))


def microkernel(module: ir.Module, dt: str, mr: int, nv: int, unroll: int, masked: bool,
                full: bool = False) -> ir.Function:
    """``micro(a, axs, aks, b, bks, kc, c, ldc, mv, nvalid, accumulate)``: the ``mr x nv*VL``
    tile ``C (+)= A B`` over ``kc`` steps, declared in ``module`` (a :class:`Micro` engine).
    ``A[i, k]`` is read at ``a + i*axs + k*aks`` (a
    packed panel is ``axs=1, aks=MR``); rows past ``mv`` re-read row ``mv-1``, so an edge
    tile never reads outside A. ``B[k, j]`` is read as vectors at ``b + k*bks + j`` (a
    packed panel, or B itself when its rows are contiguous); with ``masked`` the lanes past
    ``nvalid`` are not read (B read in place at an edge). Only the ``mv x nvalid`` corner
    is stored. Accumulators live in registers as loop-carried values; k is unrolled. With
    ``full`` the kernel is only called for whole tiles (``mv = mr``, ``nvalid = nv*VL``):
    no clamped rows, no edge stores."""
    return registry.use(module, Micro(dt, mr, nv, unroll, int(masked), int(full)))


def _micro_body(fn: ir.Function, dt: str, mr: int, nv: int, unroll: int, masked: bool, full: bool) -> None:
    """The kernel of the product :data:`~.products.PRODUCTS` ``[dt]``: A and B in its
    units (:attr:`~.products.Product.unit`; ``kc`` counts units), C in its accumulator's
    dtype."""
    product = PRODUCTS[dt]
    unit, acc = product.unit, product.acc
    vl = lanes(acc)
    ap, axs, aks, bp, bks, kc, c, ldc, mvalid, nvalid, accumulate = fn.args
    for p in (ap, bp, c):
        p.add_attribute("noalias")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    last = b.sub(mvalid, I64(1))
    rows = [gep(b, ap, b.mul(I64(i) if full else b.select(b.icmp_signed("<", I64(i), mvalid), I64(i), last),
                             axs), unit) for i in range(mr)]
    masks = [lane_mask(b, b.sub(nvalid, I64(j * vl)), vl) if masked else None for j in range(nv)]
    step = _dot_step(b, product, rows, aks, bp, bks, masks)
    main = b.sdiv(kc, I64(unroll))

    def unrolled(k, accs):
        base = b.mul(k, I64(unroll))
        for u in range(unroll):
            accs = step(b.add(base, I64(u)), accs)
        return accs

    _prefetch_tile(b, acc, c, ldc, mr, nv)
    accs = _carry_loop(b, I64(0), main, [ir.Constant(vtype(acc), None)] * (mr * nv), unrolled, "ku")
    accs = _carry_loop(b, b.mul(main, I64(unroll)), kc, accs, step, "kr")
    if full:
        _rows(b, acc, accs, c, ldc, accumulate, mr, nv, [None] * nv, None)
    else:
        _store_tile(b, acc, accs, c, ldc, mvalid, nvalid, accumulate, mr, nv)
    b.ret_void()


def _dot_step(b, product, rows, aks, bp, bks, masks):
    """One k unit as a function of the accumulators: load the B vectors of unit row k,
    then per A row broadcast ``A[i, k]`` and multiply-add it into that row's
    accumulators (:func:`multiply_units`)."""
    unit = product.unit
    vl, et = lanes(product.acc), lookup_dtype(unit).ir
    nv = len(masks)

    def step(k, accs):
        brow = gep(b, bp, b.mul(k, bks), unit)
        bvec = [vload(b, gep(b, brow, j * vl, unit), unit, masks[j], vl) for j in range(nv)]
        out, koff = list(accs), b.mul(k, aks)
        for i, row in enumerate(rows):
            a = splat(b, b.load(gep(b, row, koff, unit), typ=et), vl)
            for j in range(nv):
                out[i * nv + j] = multiply_units(b, product, a, bvec[j], accs[i * nv + j])
        return out
    return step


# the bfloat16 pair dot product per accumulator lanes: AVX512_BF16's zmm form; on ymm,
# its VL form. Without the ymm form a half-width plan summed its pairs by two widening
# multiply-adds (_units_widened): Zen 4, 2 threads, Inception v2's bf16 3x3 96->128 on
# 14x14 on the pixel engine's 5x5 block of 8 lanes took 408 us, 138 on 16 lanes
DPBF16PS = {16: ("llvm.x86.avx512bf16.dpbf16ps.512", (("avx512bf16",),)),
            8: ("llvm.x86.avx512bf16.dpbf16ps.256", (("avx512bf16", "avx512vl"),))}
# the int8 dot product per accumulator lanes: AVX512_VNNI's zmm form; on ymm, AVX-VNNI's
# VEX form (Alder Lake and later Intel client cores, Zen 5) or AVX512_VNNI with VL
VPDPBUSD = {16: ("llvm.x86.avx512.vpdpbusd.512", (("avx512vnni",),)),
            8: ("llvm.x86.avx512.vpdpbusd.256", (("avxvnni",), ("avx512vnni", "avx512vl")))}


def _dot_instruction(product, lanes: int):
    """``(intrinsic, operand type)`` of ``product``'s dot-product instruction on ``lanes``
    accumulator lanes, or None where the machine has none."""
    machine = isa.current()
    table, element = (DPBF16PS, BFLOAT) if product.a == "bfloat16" else (VPDPBUSD, ir.IntType(8))
    name, needs = table.get(lanes, (None, ()))
    if any(all(machine.has(f) for f in features) for features in needs):
        return name, ir.VectorType(element, product.group * lanes)
    return None


def multiply_units(b, product, a, bvec, acc):
    """``acc + sum over the group of a * b`` lane by lane (vectors of units). A float row:
    one fused multiply-add; bfloat16 pairs and int8 quads: their dot-product instruction
    where the machine has it for the vector's width, else exactly in wider lanes
    (:func:`_units_widened`)."""
    if product.group == 1:
        return multiply_add(b, a, bvec, acc)
    vt = acc.type
    instruction = _dot_instruction(product, vt.count)
    if instruction is None:
        return _units_widened(b, product, a, bvec, acc)
    name, operands = instruction
    fn = intrinsic(b.module, name, vt, [vt, operands, operands])
    first, second = (bvec, a) if product.a == "int8" else (a, bvec)  # vpdpbusd: unsigned first
    return b.call(fn, [acc, b.bitcast(first, operands), b.bitcast(second, operands)])


def _units_widened(b, product, a, bvec, acc):
    """The dot-product step without its instruction, exact. bfloat16 pairs: each half
    widened to float32 (its bits shifted up, or the low half masked off), two fused
    multiply-adds. int8 quads: each byte extended to int32 (zero-extended for the uint8
    operand, sign-extended for the int8 one), four multiply-adds, exact in int32 as
    ``vpdpbusd`` is."""
    vt, n = acc.type, acc.type.count
    if product.a == "bfloat16":
        high = ir.Constant(a.type, [-65536] * n)
        sixteen = ir.Constant(a.type, [16] * n)
        for half in (lambda v: b.shl(v, sixteen), lambda v: b.and_(v, high)):  # k even, then odd
            acc = multiply_add(b, b.bitcast(half(a), vt), b.bitcast(half(bvec), vt), acc)
        return acc
    bits = ir.Constant(vt, [24] * n)
    down_a, down_b = (b.lshr, b.ashr) if product.a == "uint8" else (b.ashr, b.lshr)
    for e in range(4):  # byte e of each unit is k = 4u + e
        up = ir.Constant(vt, [24 - 8 * e] * n)
        acc = b.add(acc, b.mul(down_a(b.shl(a, up), bits), down_b(b.shl(bvec, up), bits)))
    return acc


def add_values(b, x, y):
    """``x + y`` of two values of a product's accumulator type, float or integer."""
    return b.add(x, y) if isinstance(x.type.element if isinstance(x.type, ir.VectorType) else x.type,
                                     ir.IntType) else b.fadd(x, y)


def _prefetch_tile(b, dt, c, ldc, mr, nv):
    """Ask for the C tile (for writing) before the k loop, so its read-modify-write at the
    end does not wait on memory; a prefetch never faults, so edge rows need no guard."""
    for i in range(mr):
        prefetch(b, gep(b, c, b.mul(I64(i), ldc), dt), write=True, nbytes=nv * VECTOR_BYTES)


def _carry_loop(b, start, stop, init, body, name):
    """``for k in [start, stop)``: ``values = body(k, values)``; returns the final values
    (a :func:`for_range` loop with the values carried in phis)."""
    pre = b.block
    with for_range(b, stop, name, start=start) as k:
        phis = []
        for v in init:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        new = body(k, phis)
        for p, v in zip(phis, new):
            p.add_incoming(v, b.block)
        last = b.block
    out = []
    for v0, v in zip(init, new):
        p = b.phi(v0.type)
        if isinstance(pre.terminator, ir.ConditionalBranch):  # the guard may skip the loop
            p.add_incoming(v0, pre)
        p.add_incoming(v, last)
        out.append(p)
    return out


def _store_tile(b, dt, accs, c, ldc, mvalid, nvalid, accumulate, mr, nv):
    """``C (+)= acc``: unmasked for a full tile; per row and masked per vector at edges."""
    vl = lanes(dt)
    full = b.and_(b.icmp_signed("==", mvalid, I64(mr)), b.icmp_signed("==", nvalid, I64(nv * vl)))
    with b.if_else(full, likely=True) as (then, otherwise):
        with then:
            _rows(b, dt, accs, c, ldc, accumulate, mr, nv, [None] * nv, None)
        with otherwise:
            masks = [lane_mask(b, b.sub(nvalid, I64(j * vl)), vl) for j in range(nv)]
            _rows(b, dt, accs, c, ldc, accumulate, mr, nv, masks, mvalid)


def _rows(b, dt, accs, c, ldc, accumulate, mr, nv, masks, mvalid):
    vl = lanes(dt)
    for i in range(mr):
        def row(i=i):
            ptrs = [gep(b, c, b.add(b.mul(I64(i), ldc), I64(j * vl)), dt) for j in range(nv)]
            with b.if_else(accumulate) as (then, otherwise):
                with then:
                    for j, p in enumerate(ptrs):
                        old = vload(b, p, dt, masks[j])
                        vstore(b, add_values(b, old, accs[i * nv + j]), p, dt, masks[j])
                with otherwise:
                    for j, p in enumerate(ptrs):
                        vstore(b, accs[i * nv + j], p, dt, masks[j])
        if mvalid is None:
            row()
        else:
            with b.if_then(b.icmp_signed("<", I64(i), mvalid)):
                row()


def pack_rows(b, dt, dst, src, kstride, nx, kc, width: int) -> None:
    """Panels from rows that are contiguous along ``x``, all ``ceil(nx / width)`` of them
    in one pass along k: ``dst[(q*kc + kk)*width + r] = src[kk*kstride + q*width + r]``
    for ``q*width + r < nx``, 0 up to the last panel's ``width``; per k step one vector
    copy per VL columns, masked only in a last panel that reaches past ``nx``. One pass
    reads each k row's ``nx`` elements as one stream; a panel at a time read one line
    every ``kstride`` elements, a page apart for a 1024-wide B, which the prefetchers do
    not follow (AVX2's 16-wide panels are always packed: :func:`.gemm_llvm.b_in_place`)."""
    vl = lanes(dt)
    groups = range(0, width, vl)
    whole = b.sdiv(nx, I64(width))
    span = b.mul(kc, I64(width))  # elements of one panel

    def copy(row, at, limit=None):  # one panel's width at k row ``row`` to ``at``
        for g in groups:
            mask = None if limit is None else lane_mask(b, b.sub(limit, I64(g)), vl)
            v = vload(b, gep(b, row, g, dt), dt, mask)
            vstore(b, v, gep(b, at, g, dt), dt, None if width - g >= vl else lane_mask(b, width - g, vl))

    with for_range(b, kc, "pk") as kk:
        row, out = gep(b, src, b.mul(kk, kstride), dt), gep(b, dst, b.mul(kk, I64(width)), dt)
        with for_range(b, whole, "pq") as q:
            copy(gep(b, row, b.mul(q, I64(width)), dt), gep(b, out, b.mul(q, span), dt))
        first = b.mul(whole, I64(width))
        with b.if_then(b.icmp_signed("<", first, nx)):
            copy(gep(b, row, first, dt), gep(b, out, b.mul(whole, span), dt), b.sub(nx, first))


def pack_transposed(b, dt, dst, src, xstride, nx, kc, width: int) -> None:
    """Panel from rows that are contiguous along ``k``: ``dst[kk*width + r] =
    src[r*xstride + kk]`` (0 for ``r >= nx``), by loading VL x VL blocks as rows and
    transposing them in registers; the last, partial block is masked, not branched.
    VL rows at a time are walked along k to the end (VL read streams, not ``width``: the
    hardware prefetcher follows 16 streams, not 64). The groups of VL rows are a loop when
    they are all whole (unrolled, a 64-wide float32 packer was 1,850 lines of IR: a
    quarter of an attention region's LLVM time)."""
    vl = lanes(dt)
    if width % vl == 0 and width > vl:
        with for_range(b, I64(width // vl), "pg") as q:
            _transposed_rows(b, dt, dst, src, xstride, nx, kc, width, b.mul(q, I64(vl)))
        return
    for g in range(0, width, vl):
        _transposed_rows(b, dt, dst, src, xstride, nx, kc, width, g)


def _transposed_rows(b, dt, dst, src, xstride, nx, kc, width: int, g) -> None:
    """Rows ``g .. g + VL`` of :func:`pack_transposed`'s panel (``g`` an int, or an i64
    when every group is whole). A whole VL x VL block (VL more k steps, VL rows below
    ``nx``) is loaded and stored plainly; only edge blocks take masks. AVX2's masked
    loads and stores (``vmaskmovps``) cost Zen 4 several plain ones: with every block
    masked, packing a 1024 x 784 weight took a third of a 64-row AVX2 linear layer's
    time (``perf``: 0.24 ms; AVX-512's masked pack 0.09 ms). Exported builds alternating,
    Zen 4, 2 threads, AVX2: that layer 0.918 -> 0.673 ms, the MLP 784-1024-1024-10 in
    torch's linear form 2.023 -> 1.543 ms; AVX-512 0.598 -> 0.582 and 1.445 -> 1.423."""
    vl = lanes(dt)
    static = isinstance(g, int)
    first = I64(g) if static else g
    whole = min(vl, width - g) if static else vl
    with for_range(b, _ceil(b, kc, vl), "pt") as t:
        kk = b.mul(t, I64(vl))
        krem = b.sub(kc, kk)
        if whole < vl:
            _transposed_block(b, dt, dst, src, xstride, nx, width, first, kk, krem, whole, masked=True)
        else:
            inside = b.and_(b.icmp_signed(">=", krem, I64(vl)), b.icmp_signed("<=", b.add(first, I64(vl)), nx))
            with b.if_else(inside, likely=True) as (plain, edge):
                with plain:
                    _transposed_block(b, dt, dst, src, xstride, nx, width, first, kk, krem, whole, masked=False)
                with edge:
                    _transposed_block(b, dt, dst, src, xstride, nx, width, first, kk, krem, whole, masked=True)


def _transposed_block(b, dt, dst, src, xstride, nx, width: int, first, kk, krem, whole: int, masked: bool) -> None:
    """The VL x VL block at k step ``kk`` of the rows from ``first``: ``whole`` rows of the
    panel (zeros past it); with ``masked``, rows past ``nx`` read nothing and k steps
    past ``krem`` are neither read nor stored."""
    vl = lanes(dt)
    base = gep(b, src, kk, dt)
    rows = []
    for i in range(vl):
        if i >= whole:
            rows.append(ir.Constant(vtype(dt), None))
            continue
        r = b.add(first, I64(i))
        ptr = b.gep(base, [b.mul(r, xstride)], source_etype=lookup_dtype(dt).ir)
        limit = b.select(b.icmp_signed("<", r, nx), krem, I64(0))
        rows.append(vload(b, ptr, dt, lane_mask(b, limit, vl) if masked else None))
    for l, v in enumerate(transpose(b, rows)):
        at = gep(b, dst, b.add(b.mul(b.add(kk, I64(l)), I64(width)), first), dt)
        lanes_ = b.select(b.icmp_signed("<", I64(l), krem), I64(whole), I64(0))
        vstore(b, v, at, dt, lane_mask(b, lanes_, vl) if masked else None)


def _ceil(b, x, y: int):
    return b.sdiv(b.add(x, I64(y - 1)), I64(y))


def call_packer(b: ir.IRBuilder, kind: str, dt: str, dst, src, stride, nx, kc, width: int) -> None:
    """Call :func:`pack_rows` (``kind="rows"``) or :func:`pack_transposed`
    (``"transposed"``) emitted once per module as a function of its own, so a region with
    many products carries one copy of each packer."""
    name = f"{b.module.name}_pack_{kind}_{dt}_w{width}"
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64, I64]), name)
        fn.linkage = "internal"
        for p in fn.args[:2]:
            p.add_attribute("noalias")
        inner = ir.IRBuilder(fn.append_basic_block("entry"))
        emit = pack_rows if kind == "rows" else pack_transposed
        emit(inner, dt, *fn.args, width)
        inner.ret_void()
    b.call(fn, [dst, src, stride, nx, kc])
