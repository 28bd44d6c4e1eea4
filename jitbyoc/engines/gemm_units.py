"""Packers of the GEMM engine's panels for products in units of several k
(:mod:`.products`: a bfloat16 pair is one 32-bit unit). A panel of units is laid out as
a float panel is, one unit where the float panel has one element: ``dst[(kk*width + r)
* group + e] = X(b, x0 + r, (k0 + kk)*group + e)``, zero past the rows and past K.

* :func:`pack_row_units`: an operand whose rows are contiguous along ``x`` (B of a
  row-major product: activations times activations, a 1x1 convolution's pixels). Per
  unit row, ``group`` row vectors are interleaved in registers (two-source shuffles,
  pairs first) and stored as one vector of units.
* :func:`pack_units`: any operand, element by element (the general, slow one).
"""

from __future__ import annotations

from dataclasses import replace

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64, PTR
from ..ir import kir
from ..render.loops import ceil_div, for_range, smin, workspace
from ..render.vectors import lane_mask, splat, vload, vstore
from .gemm import Panels, _dims, static_size
from .gemm_micro import gep

PACK_ONCE_MAX_BYTES = 1 << 20  # see packed_once
ROW_VECTOR = 16  # columns per interleave: 16 of each row, one 64-byte vector of bfloat16 pairs or int8 quads


def interleave(b: ir.IRBuilder, rows: list) -> ir.Value:
    """``[r0[0], r1[0], ..., r0[1], r1[1], ...]`` of equal-length vectors (a power of two
    of them): pairs interleaved, then the pairs' results, one two-source shuffle each."""
    if len(rows) == 1:
        return rows[0]
    a, c = interleave(b, rows[0::2]), interleave(b, rows[1::2])
    n = a.type.count
    order = [i // 2 + (n if i % 2 else 0) for i in range(2 * n)]
    return b.shuffle_vector(a, c, ir.Constant(ir.VectorType(I32, 2 * n), order))


def pack_row_units(b, dt, dst, src, kstride, nx, kvalid, kc, width: int, group: int) -> None:
    """All ``ceil(nx / width)`` panels of ``kc`` units from rows contiguous along ``x``
    (``src[k*kstride + x]``), in one pass along k; ``kvalid``: the k (elements) of this
    block, below ``kc * group`` in a block that ends on half a unit (those rows read as
    zeros)."""
    n = ROW_VECTOR
    whole = b.sdiv(nx, I64(width))
    with for_range(b, kc, "uk") as u:
        rows = [gep(b, src, b.mul(b.add(b.mul(u, I64(group)), I64(e)), kstride), dt) for e in range(group)]
        present = [b.icmp_signed("<", b.add(b.mul(u, I64(group)), I64(e)), kvalid) for e in range(group)]
        out = gep(b, dst, b.mul(b.mul(u, I64(width)), I64(group)), dt)

        def panel(q, limit):
            at = b.mul(q, I64(width))
            to = gep(b, out, b.mul(b.mul(q, b.mul(kc, I64(width))), I64(group)), dt)
            for g0 in range(0, width, n):
                cols = lane_mask(b, b.sub(limit, I64(g0)), n)
                vecs = [vload(b, gep(b, row, b.add(at, I64(g0)), dt),
                              dt, b.and_(cols, splat(b, ok, n)), n) for row, ok in zip(rows, present)]
                vstore(b, interleave(b, vecs), gep(b, to, g0 * group, dt), dt)

        with for_range(b, whole, "uq") as q:
            panel(q, I64(width))
        first = b.mul(whole, I64(width))
        with b.if_then(b.icmp_signed("<", first, nx)):
            panel(whole, b.sub(nx, first))


def call_row_units(b: ir.IRBuilder, dt: str, dst, src, kstride, nx, kvalid, kc, width: int, group: int) -> None:
    """Call :func:`pack_row_units`, emitted once per module as a function of its own."""
    name = f"{b.module.name}_pack_row_units_{dt}_w{width}_g{group}"
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I64, I64, I64]), name)
        fn.linkage = "internal"
        for p in fn.args[:2]:
            p.add_attribute("noalias")
        inner = ir.IRBuilder(fn.append_basic_block("entry"))
        pack_row_units(inner, dt, *fn.args, width, group)
        inner.ret_void()
    b.call(fn, [dst, src, kstride, nx, kvalid, kc])


def pack_units(g, operand, c, dst, bidx, x0, nx, k0, kc, width) -> None:
    """One panel of ``kc`` units from any operand, element by element (see the module
    docstring); ``k0`` and ``kc`` count units. The slow, general packer: for operands
    :func:`pack_row_units` does not take (k contiguous, or strided both ways)."""
    b, group, dt = c.b, g.product.group, operand.dtype
    with for_range(b, kc, "uk") as kk:
        with for_range(b, I64(width), "ur") as r:
            for e in range(group):
                kel = b.add(b.mul(b.add(k0, kk), I64(group)), I64(e))
                at = gep(b, dst, b.add(b.mul(b.add(b.mul(kk, I64(width)), r), I64(group)), I64(e)), dt)
                _element_or_zero(g, operand, c, at, bidx, (x0, r, nx), kel)


def _element_or_zero(g, operand, c, at, bidx, row, kel) -> None:
    """``*at = X(b, x0 + r, kel)``, or 0 past the ``nx`` rows (``row = (x0, r, nx)``) or
    past K: a padded element of an element-by-element packer."""
    b, (x0, r, nx) = c.b, row
    inside = b.and_(b.icmp_signed("<", r, nx), b.icmp_signed("<", kel, c.product(_dims(g.k))))
    with b.if_else(inside) as (then, otherwise):
        with then:
            b.store(operand.element_llvm(c, bidx, b.add(x0, r), kel), at)
        with otherwise:
            b.store(ir.Constant(lookup_dtype(operand.dtype).ir, 0), at)


def pack_unit_rows(g, operand, c, dst, bidx, x0, nx, k0, kc) -> None:
    """Rows ``x0 .. x0+nx`` of ``operand`` (A), ``kc`` units of k from unit ``k0`` each, as
    rows: ``dst[(r*kc + kk)*group + e] = X(b, x0 + r, (k0 + kk)*group + e)``, zero past
    K; the rows up to a whole tile of the AMX blocking zero too (the tile kernel reads
    A in rows of k: :mod:`.gemm_tiles`). Element by element: an A that is not read in
    place is small (a stem's weight, whose k is no whole number of units)."""
    b, group, dt, mr = c.b, g.product.group, operand.dtype, g.blocking.mr
    rows = b.mul(ceil_div(b, nx, I64(mr)), I64(mr))
    with for_range(b, rows, "ur") as r:
        row = gep(b, dst, b.mul(b.mul(r, kc), I64(group)), dt)
        with for_range(b, b.mul(kc, I64(group)), "ue") as e:
            kel = b.add(b.mul(k0, I64(group)), e)
            _element_or_zero(g, operand, c, gep(b, row, e, dt), bidx, (x0, r, nx), kel)


def pack_all_units(g, operand, c, dst, bidx, x0, nx, k0, kc, width) -> bool:
    """Every panel at once with :func:`pack_row_units` when ``operand``'s rows are
    contiguous along ``x``; False (nothing emitted) otherwise."""
    if not getattr(operand, "contiguous_x", False) or not hasattr(operand, "offset_llvm"):
        return False
    b, group = c.b, g.product.group
    k = c.product(_dims(g.k))
    src = c.element(operand.buf, operand.offset_llvm(c, bidx, x0, b.mul(k0, I64(group))))
    kvalid = b.sub(k, b.mul(k0, I64(group)))
    kstride = c.product(_dims(operand.k))
    call_row_units(b, operand.dtype, dst, src, kstride, nx, kvalid, kc, width, group)
    return True


def packed_once(g, ctx):
    """``(g, workspace)``: for a product in units whose B is a buffer contiguous along
    ``x`` (activations; a 1x1 convolution's pixels), B packed into the engine's panels
    once, by the thread pool, before the product (``g`` then reads them in place as
    :class:`~.gemm.Panels`; the caller frees the workspace after it); else ``(g, None)``.
    Packed inside the product instead, B is packed again by every chunk of rows that
    reads it. Only for a product split along M (M > N, static sizes) whose B fits in
    1 MiB. Measured (Zen 4, 2 threads, bf16 1x1 convolutions of ResNet-50, alternating
    builds): 1024->256 on 14x14 318 vs 342 us; 256->1024 on 14x14, 512->2048 on 7x7 and
    128->512 on 28x28 level (+-1 %). Packed once, a B split along N (each chunk packs
    only its own columns) or a larger one (streamed back from memory, where packing
    block by block keeps it in L2) ran slower: 128x768x3072 365 -> 308 GFLOP/s."""
    k, m, n_static = static_size(g.k), static_size(g.m), static_size(g.n)
    if g.product.group == 1 or g.batch or None in (k, m, n_static) or isinstance(g.b, Panels) \
            or not getattr(g.b, "contiguous_x", False) or not hasattr(g.b, "offset_llvm") \
            or m <= n_static or k * n_static * lookup_dtype(g.b.dtype).nbytes > PACK_ONCE_MAX_BYTES:
        return g, None
    b, group, nr = ctx.b, g.product.group, g.nr
    units = -(-k // group)
    n = ctx.product(_dims(g.n))
    panels = ceil_div(b, n, I64(nr))
    ptr = workspace(ctx, g.product.unit, b.mul(panels, I64(nr * units)))
    buf = kir.Buffer(f"panels{len(ctx.ptrs)}", (), g.b.dtype)
    ctx.ptrs[buf] = ptr
    kstride = ctx.product(_dims(g.b.k))

    def pack(c, lo, hi, _extra):
        x0 = c.b.mul(lo, I64(nr))
        nx = smin(c.b, c.b.mul(c.b.sub(hi, lo), I64(nr)), c.b.sub(n, x0))
        src = c.element(g.b.buf, g.b.offset_llvm(c, (), x0, I64(0)))
        dst = c.element(buf, c.b.mul(x0, I64(units * group)))
        with c.b.if_then(c.b.icmp_signed(">", nx, I64(0))):
            call_row_units(c.b, g.b.dtype, dst, src, kstride, nx, I64(k), I64(units), nr, group)

    ctx.parallel_for(panels, pack)
    return replace(g, b=Panels(buf, (), units * group, nr, group)), ptr
