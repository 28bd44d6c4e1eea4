"""A reusable packed GEMM engine: ``C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]``, then an epilogue.

This is not a kernel on its own (it registers nothing): kernels that are a matrix product
underneath (matmul, conv2d via im2col / implicit GEMM, ...) describe their operands
and call :meth:`Gemm.emit_llvm` / :meth:`Gemm.emit_c` from their stage's ``emit_llvm`` /
``emit_c``.

API
---
::

    g = Gemm(m=M, n=N, k=K, batch=(B0, B1), dtype="float32",
             a=Strided(x, batch=(sx0, sx1), x=K, k=1),        # A[b, m, k] = x[b*.. + m*K + k]
             b=Strided(w, batch=(0, 0), x=1, k=N),            # B[b, k, n] = w[k*N + n]
             c=Output(out, batch=(B1 * M * N, M * N), row=N), # C[b, m, n] = out[.. + m*N + n]
             epilogue=box_epilogue(stage, keep))              # or your own callable
    g.emit_llvm(ctx)   # in the stage's emit_llvm; g.emit_c(ctx) in its emit_c

* Dims (entries of ``batch``) are ints or symbolic names, as in :mod:`jitbyoc.kir`;
  ``m``, ``n``, ``k`` are dims or tuples of dims (their product: e.g. batch dims folded
  into the rows when B is shared by every batch item). ``batch`` is the shape of the batch space (``()`` for one matrix);
  the engine walks it in row-major order and hands operands, output and epilogue ``b``,
  the tuple of per-dim batch indices (i64 values; C: ``int64_t`` expressions).
* **Operands.** A and B are both seen as a panel source ``X(b, x, k)``: for A, ``x`` is the
  row ``m``; for B, ``x`` is the column ``n``. An operand implements

  - ``element_llvm(ctx, b, x, k) -> ir.Value`` and ``element_c(ctx, b, x, k) -> str``: the
    scalar ``X(b, x, k)`` (a padded conv returns 0 outside the image here);
  - optionally ``pack_llvm(ctx, dst, b, x0, nx, k0, kc, width)``: fill the panel
    ``dst[kk * width + r] = X(b, x0 + r, k0 + kk)`` for ``kk < kc``, ``r < nx``, and 0 for
    ``nx <= r < width``. ``dst`` is an LLVM pointer to ``dtype`` elements, 64-byte aligned;
    ``width`` is the engine's register-tile size (MR for A, NR for B), ``nx <= width``;
    ``x0``/``nx``/``k0``/``kc`` are i64 values. The default (:class:`Operand`) packs element by
    element through ``element_llvm``; :class:`Strided` packs a unit-stride side with vector
    loads and a unit-stride ``k`` with in-register 16x16 transposes. A conv operand can
    override ``pack_llvm`` to gather im2col panels straight from the image, padding on the fly.

  :class:`Strided` covers every dense layout: element ``(b, x, k)`` at
  ``sum(unravel(b)[i] * batch[i]) + x * x_stride + k * k_stride`` of a buffer, strides being
  dims or tuples of dims (products), 0 for a broadcast batch dim. A transposed operand is
  the same buffer with the two strides swapped.
* **Output.** :class:`Output` places ``C[b, m, n]`` at ``sum(unravel(b)[i] * batch[i]) +
  m * row + n`` of a buffer (unit stride along ``n``, so tiles are stored as vectors).
* **Epilogue.** ``epilogue(ctx, b, m0, mc, n0, nc)`` is called (in both renderers) once
  for every finished block ``C[b, m0:m0+mc, n0:n0+nc]``, right after its last update while
  it is hot in cache; values are i64 (LLVM) or C expressions. :func:`box_epilogue` maps the
  block to the ``ctx.epilogue(stage, origin, extent)`` box of a ``(*batch, M, N)`` output
  (dims of size 1 dropped, as in a 1-D matmul operand, are skipped); :func:`rows_epilogue`
  does it row by row when ``m`` is several output dims folded. ``None``: no epilogue.
* **Threads.** ``emit_llvm`` / ``emit_c`` run ``ctx.parallel_for`` themselves (so never
  call them from inside one) over ``batch x parts``, a part being a range of MR rows or
  NR columns (the larger of M and N is split, so the smaller operand is the one packed
  twice). Packing buffers come from ``TVMBackendAllocWorkspace`` inside each task.
* **Accumulation order.** Per output element, the LLVM rendering sums ``k`` in order
  within blocks of at most :data:`KC` with fused multiply-adds (one rounding each), then
  adds the blocks in order into C; the C rendering sums ``k`` in order with separate
  multiply and add. Callers document tolerances from this (see :mod:`.matmul`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from typing import Callable, Union

from llvmlite import ir

from ..dtypes import dtype as lookup_dtype
from ..lowering.loops import I64, for_range
from . import gemm_micro as mk

Dim = Union[int, str]
Stride = Union[Dim, tuple]  # a dim, or a tuple of dims whose product is the stride


@dataclass(frozen=True)
class Blocking:
    """Register tile ``mr x nv*VL`` and cache blocks (elements) of one dtype.

    Loop order, outermost first: MC rows of A (packed, lives in L3), KC of K, NC columns
    of B (packed ``kc x nc``, lives in L2), MR rows (the A micro-panel stays in L1 while)
    NR columns stream the B micro-panels from L2 through the microkernel."""
    mr: int
    nv: int
    unroll: int
    mc: int
    kc: int
    nc: int


BLOCKING = {"float32": Blocking(mr=12, nv=2, unroll=4, mc=1020, kc=384, nc=480),
            "float64": Blocking(mr=12, nv=2, unroll=4, mc=516, kc=256, nc=320)}
KC = BLOCKING["float32"].kc
SERIAL_MAX_MACS = 1 << 17  # a static problem smaller than this runs on the calling thread
C_COLUMN_BLOCK = 64        # the C rendering applies the epilogue per row and 64 columns


def _dims(stride: Stride) -> tuple:
    return stride if isinstance(stride, tuple) else (stride,)


def _is_one(stride: Stride) -> bool:
    return all(isinstance(d, int) for d in _dims(stride)) and \
        reduce(lambda x, y: x * y, _dims(stride), 1) == 1


def _linear_llvm(ctx, terms) -> ir.Value:
    """``sum(index * stride)`` as i64; zero strides drop out."""
    off = I64(0)
    for index, stride in terms:
        if any(d == 0 for d in _dims(stride)):
            continue
        off = ctx.b.add(off, ctx.b.mul(ctx.i64(index), ctx.product(_dims(stride))))
    return off


def _linear_c(ctx, terms) -> str:
    parts = [f"({index}) * ({ctx.product(_dims(s))})" for index, s in terms
             if not any(d == 0 for d in _dims(s))]
    return " + ".join(parts) or "0"


class Operand:
    """A panel source ``X(b, x, k)``; subclasses give elements and may pack faster."""
    dtype: str

    def element_llvm(self, ctx, b, x, k) -> ir.Value:
        raise NotImplementedError(f"{type(self).__name__} must define element_llvm")

    def element_c(self, ctx, b, x, k) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define element_c")

    def pack_llvm(self, ctx, dst, b, x0, nx, k0, kc, width: int) -> None:
        """``dst[kk*width + r] = X(b, x0 + r, k0 + kk)``, zero for ``nx <= r < width``."""
        bld, zero = ctx.b, ir.Constant(lookup_dtype(self.dtype).ir, 0)
        with for_range(bld, kc, "pk") as kk:
            row = bld.mul(kk, I64(width))
            with for_range(bld, nx, "pr") as r:
                value = self.element_llvm(ctx, b, bld.add(x0, r), bld.add(k0, kk))
                bld.store(value, mk.gep(bld, dst, bld.add(row, r), self.dtype))
            with for_range(bld, I64(width), "pz", start=nx) as r:
                bld.store(zero, mk.gep(bld, dst, bld.add(row, r), self.dtype))


@dataclass(frozen=True)
class Strided(Operand):
    """``X(b, x, k) = buf[sum(b[i] * batch[i]) + x * x_stride + k * k_stride]``."""
    buf: object
    batch: tuple
    x: Stride
    k: Stride

    @property
    def dtype(self) -> str:
        return self.buf.dtype

    def offset_llvm(self, ctx, b, x, k) -> ir.Value:
        return _linear_llvm(ctx, list(zip(b, self.batch)) + [(x, self.x), (k, self.k)])

    def element_llvm(self, ctx, b, x, k) -> ir.Value:
        return ctx.load(self.buf, self.offset_llvm(ctx, b, x, k))

    def element_c(self, ctx, b, x, k) -> str:
        return ctx.element(self.buf, _linear_c(ctx, list(zip(b, self.batch)) + [(x, self.x), (k, self.k)]))

    def pack_llvm(self, ctx, dst, b, x0, nx, k0, kc, width: int) -> None:
        if _is_one(self.x):
            self._pack_rows(ctx, dst, b, x0, nx, k0, kc, width)
        elif _is_one(self.k):
            self._pack_transposed(ctx, dst, b, x0, nx, k0, kc, width)
        else:
            super().pack_llvm(ctx, dst, b, x0, nx, k0, kc, width)

    def _pack_rows(self, ctx, dst, b, x0, nx, k0, kc, width):
        """Unit stride along ``x``: each k step is a (masked) vector copy."""
        bld, dt, vl = ctx.b, self.dtype, mk.lanes(self.dtype)
        groups = range(0, width, vl)
        loads = [mk.lane_mask(bld, bld.sub(nx, I64(g)), vl) for g in groups]
        stores = [None if width - g >= vl else mk.lane_mask(bld, width - g, vl) for g in groups]
        src = ctx.element(self.buf, self.offset_llvm(ctx, b, x0, k0))
        step = ctx.product(_dims(self.k))
        with for_range(bld, kc, "pk") as kk:
            row = bld.gep(src, [bld.mul(kk, step)], source_etype=lookup_dtype(dt).ir)
            for g, lm, sm in zip(groups, loads, stores):
                v = mk.vload(bld, mk.gep(bld, row, g, dt), dt, lm)
                mk.vstore(bld, v, mk.gep(bld, dst, bld.add(bld.mul(kk, I64(width)), I64(g)), dt), dt, sm)

    def _pack_transposed(self, ctx, dst, b, x0, nx, k0, kc, width):
        """Unit stride along ``k``: load VL x VL blocks as rows and transpose in registers."""
        bld, vl = ctx.b, mk.lanes(self.dtype)
        full = bld.sdiv(kc, I64(vl))
        with for_range(bld, full, "pt") as t:
            self._transpose_block(ctx, dst, b, x0, nx, k0, bld.mul(t, I64(vl)), I64(vl), width, False)
        tail = bld.mul(full, I64(vl))
        with bld.if_then(bld.icmp_signed("<", tail, kc)):
            self._transpose_block(ctx, dst, b, x0, nx, k0, tail, bld.sub(kc, tail), width, True)

    def _transpose_block(self, ctx, dst, b, x0, nx, k0, kk, krem, width, guarded):
        bld, dt, vl = ctx.b, self.dtype, mk.lanes(self.dtype)
        xs = ctx.product(_dims(self.x))
        src = ctx.element(self.buf, self.offset_llvm(ctx, b, x0, bld.add(k0, kk)))
        zero = ir.Constant(mk.vtype(dt), None)
        for g in range(0, width, vl):
            rows = []
            for r in range(g, g + vl):
                if r >= width:
                    rows.append(zero)
                    continue
                limit = bld.select(bld.icmp_signed("<", I64(r), nx), krem, I64(0))
                ptr = bld.gep(src, [bld.mul(I64(r), xs)], source_etype=lookup_dtype(dt).ir)
                rows.append(mk.vload(bld, ptr, dt, mk.lane_mask(bld, limit, vl)))
            store_mask = None if width - g >= vl else mk.lane_mask(bld, width - g, vl)
            for l, v in enumerate(mk.transpose(bld, rows)):
                at = mk.gep(bld, dst, bld.add(bld.mul(bld.add(kk, I64(l)), I64(width)), I64(g)), dt)
                if guarded:
                    with bld.if_then(bld.icmp_signed("<", I64(l), krem)):
                        mk.vstore(bld, v, at, dt, store_mask)
                else:
                    mk.vstore(bld, v, at, dt, store_mask)


@dataclass(frozen=True)
class Output:
    """``C[b, m, n]`` at ``buf[sum(b[i] * batch[i]) + m * row + n]``."""
    buf: object
    batch: tuple
    row: Stride

    def offset_llvm(self, ctx, b, m, n) -> ir.Value:
        return ctx.b.add(_linear_llvm(ctx, list(zip(b, self.batch)) + [(m, self.row)]), ctx.i64(n))

    def offset_c(self, ctx, b, m, n) -> str:
        return f"{_linear_c(ctx, list(zip(b, self.batch)) + [(m, self.row)])} + ({n})"


def box_epilogue(stage, has_m: bool = True, has_n: bool = True) -> Callable:
    """An engine epilogue applying ``stage.epilogue`` to the block's box of ``stage.out``,
    an output shaped ``(*batch, [M], [N])`` (``has_m``/``has_n`` False: that dim dropped)."""
    def apply(ctx, b, m0, mc, n0, nc):
        origin = list(b) + ([m0] if has_m else []) + ([n0] if has_n else [])
        extent = [1] * len(b) + ([mc] if has_m else []) + ([nc] if has_n else [])
        ctx.epilogue(stage, origin, extent)
    return apply if stage.epilogue is not None else None


def rows_epilogue(stage, lead) -> Callable:
    """An engine epilogue for an output ``(*lead, N)`` whose ``lead`` dims are folded into
    the GEMM's rows: applies ``stage.epilogue`` to each row of the block."""
    def apply(ctx, b, m0, mc, n0, nc):
        if isinstance(mc, str):  # the C rendering
            with ctx.loop(f"er{len(ctx.lines)}", f"({m0}) + ({mc})", m0) as r:
                ctx.epilogue(stage, ctx.unravel(r, lead) + [n0], [1] * len(lead) + [nc])
        else:
            with for_range(ctx.b, ctx.b.add(m0, mc), "er", start=m0) as r:
                ctx.epilogue(stage, ctx.unravel(r, lead) + [n0], [1] * len(lead) + [nc])
    return apply if stage.epilogue is not None else None


def _ceil_div(b, x, y):
    return b.sdiv(b.add(x, b.sub(y, I64(1))), y)


def _min(b, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


@dataclass
class Gemm:
    """One (batched) matrix product; see the module docstring for the contract."""
    m: Stride  # a dim, or a tuple of dims (their product: batch dims folded into rows)
    n: Stride
    k: Stride
    a: Operand
    b: Operand
    c: Output
    dtype: str = "float32"
    batch: tuple = ()
    epilogue: Callable | None = None
    blocking: Blocking = field(default=None)

    def __post_init__(self):
        self.blocking = self.blocking or BLOCKING[self.dtype]

    @property
    def nr(self) -> int:
        return self.blocking.nv * mk.lanes(self.dtype)

    def serial(self) -> bool:
        dims = _dims(self.m) + _dims(self.n) + _dims(self.k) + tuple(self.batch)
        return all(isinstance(d, int) for d in dims) and \
            reduce(lambda x, y: x * y, dims, 1) < SERIAL_MAX_MACS

    # ---- LLVM ----------------------------------------------------------------------------------
    def emit_llvm(self, ctx) -> None:
        """Emit the product at ``ctx``'s insertion point (runs its own ``parallel_for``)."""
        b, blk = ctx.b, self.blocking
        m, n = ctx.product(_dims(self.m)), ctx.product(_dims(self.n))
        # split the larger side so the smaller operand is the one every task packs again
        split_n = b.icmp_signed(">=", n, m)
        parts = b.select(split_n, _ceil_div(b, n, I64(self.nr)), _ceil_div(b, m, I64(blk.mr)))
        count = b.mul(ctx.product(self.batch), parts)
        extra = [b.zext(split_n, I64), parts]
        if self.serial():
            self._task(ctx, I64(0), count, extra)
        else:
            ctx.parallel_for(count, self._task, extra)

    def _task(self, c, lo, hi, extra) -> None:
        """Tasks own a range of ``batch x parts``; each part is a full Goto loop nest."""
        b, blk, dt = c.b, self.blocking, self.dtype
        split_n, parts = b.trunc(extra[0], ir.IntType(1)), extra[1]
        m, n, k = c.product(_dims(self.m)), c.product(_dims(self.n)), c.product(_dims(self.k))
        kblocks = b.select(b.icmp_signed(">", k, I64(0)), _ceil_div(b, k, I64(blk.kc)), I64(1))
        kcb = _ceil_div(b, k, kblocks)
        mcap = _min(b, I64(blk.mc), b.mul(_ceil_div(b, m, I64(blk.mr)), I64(blk.mr)))
        ncap = _min(b, I64(blk.nc), b.mul(_ceil_div(b, n, I64(self.nr)), I64(self.nr)))
        ap = self._alloc(c, b.mul(mcap, kcb))
        bp = self._alloc(c, b.mul(ncap, kcb))
        with for_range(b, _ceil_div(b, hi, parts), "gb", start=b.sdiv(lo, parts)) as item:
            base = b.mul(item, parts)
            p_lo = b.sub(b.select(b.icmp_signed(">", lo, base), lo, base), base)
            p_hi = b.sub(_min(b, hi, b.add(base, parts)), base)
            rows = (_min(b, b.mul(p_lo, I64(blk.mr)), m), _min(b, b.mul(p_hi, I64(blk.mr)), m))
            cols = (_min(b, b.mul(p_lo, I64(self.nr)), n), _min(b, b.mul(p_hi, I64(self.nr)), n))
            m_lo, m_hi = b.select(split_n, I64(0), rows[0]), b.select(split_n, m, rows[1])
            n_lo, n_hi = b.select(split_n, cols[0], I64(0)), b.select(split_n, cols[1], n)
            bidx = c.unravel(item, self.batch) if self.batch else []
            self._blocks(c, bidx, (m_lo, m_hi), (n_lo, n_hi), (kblocks, kcb), ap, bp)
        self._free(c, bp)
        self._free(c, ap)

    def _blocks(self, c, bidx, mrange, nrange, kplan, ap, bp) -> None:
        b, blk = c.b, self.blocking
        k = c.product(_dims(self.k))
        kblocks, kcb = kplan
        mb = _ceil_div(b, b.sub(mrange[1], mrange[0]), I64(blk.mc))
        mcb = b.mul(_ceil_div(b, _ceil_div(b, b.sub(mrange[1], mrange[0]), mb), I64(blk.mr)), I64(blk.mr))
        with for_range(b, mb, "gi") as ib:
            ic = b.add(mrange[0], b.mul(ib, mcb))
            mc = _min(b, mcb, b.sub(mrange[1], ic))
            with for_range(b, kblocks, "gp") as pb:
                pc = b.mul(pb, kcb)
                kc = _min(b, kcb, b.sub(k, pc))
                self._pack(c, self.a, ap, bidx, ic, mc, pc, kc, blk.mr)
                last = b.icmp_signed("==", pb, b.sub(kblocks, I64(1)))
                self._columns(c, bidx, (ic, mc), (pc, kc, last), nrange, ap, bp)

    def _columns(self, c, bidx, mblock, kblock, nrange, ap, bp) -> None:
        b, blk, dt = c.b, self.blocking, self.dtype
        (ic, mc), (pc, kc, last) = mblock, kblock
        nb = _ceil_div(b, b.sub(nrange[1], nrange[0]), I64(blk.nc))
        ncb = b.mul(_ceil_div(b, _ceil_div(b, b.sub(nrange[1], nrange[0]), nb), I64(self.nr)), I64(self.nr))
        ldc = c.product(_dims(self.c.row))
        accumulate = b.icmp_signed(">", pc, I64(0))
        with for_range(b, nb, "gj") as jb:
            jc = b.add(nrange[0], b.mul(jb, ncb))
            nc = _min(b, ncb, b.sub(nrange[1], jc))
            self._pack(c, self.b, bp, bidx, jc, nc, pc, kc, self.nr)
            with for_range(b, _ceil_div(b, mc, I64(blk.mr)), "gr") as ir_:
                i0 = b.mul(ir_, I64(blk.mr))
                mv = _min(b, I64(blk.mr), b.sub(mc, i0))
                apanel = mk.gep(b, ap, b.mul(i0, kc), dt)
                with for_range(b, _ceil_div(b, nc, I64(self.nr)), "gc") as jr:
                    j0 = b.mul(jr, I64(self.nr))
                    out = c.element(self.c.buf, self.c.offset_llvm(c, bidx, b.add(ic, i0), b.add(jc, j0)))
                    self._micro(c, [apanel, mk.gep(b, bp, b.mul(j0, kc), dt), kc, out, ldc, mv,
                                    _min(b, I64(self.nr), b.sub(nc, j0)), accumulate])
                if self.epilogue is not None:
                    with b.if_then(last):
                        self.epilogue(c, bidx, b.add(ic, i0), mv, jc, nc)

    def _edges(self, dim, width: int) -> list[int]:
        """Edge-tile sizes worth a kernel of their own along a side of ``width``: the
        remainder when the side is static, else 1 (a vector: M=1 inference, N=1)."""
        dims = _dims(dim)
        if all(isinstance(d, int) for d in dims):
            rem = reduce(lambda x, y: x * y, dims, 1) % width
            return [rem] if rem else []
        return [1]

    def _micro(self, c, args) -> None:
        """Call the microkernel sized for this tile: the full one, or for an edge tile the
        cheapest variant covering it (so M=1 or N=10 does not pay for MR rows / NR columns)."""
        b, blk, dt, vl = c.b, self.blocking, self.dtype, mk.lanes(self.dtype)
        mv, nvec = args[5], _ceil_div(b, args[6], I64(vl))
        rows = sorted({blk.mr, *self._edges(self.m, blk.mr)})
        cols = sorted({blk.nv, *(-(-e // vl) for e in self._edges(self.n, self.nr))})
        variants = sorted(((r, v) for r in rows for v in cols), key=lambda rv: rv[0] * rv[1])
        panels = (blk.mr, self.nr)
        done = b.append_basic_block("micro.done")
        for r, v in variants[:-1]:
            fits = b.and_(b.icmp_signed("<=", mv, I64(r)), b.icmp_signed("<=", nvec, I64(v)))
            with b.if_then(fits, likely=False):
                b.call(mk.microkernel(c.module, dt, r, v, blk.unroll, panels), args)
                b.branch(done)
        b.call(mk.microkernel(c.module, dt, blk.mr, blk.nv, blk.unroll, panels), args)
        b.branch(done)
        b.position_at_end(done)

    def _pack(self, c, operand, dst, bidx, x0, nx, k0, kc, width) -> None:
        b = c.b
        with for_range(b, _ceil_div(b, nx, I64(width)), "gq") as q:
            r0 = b.mul(q, I64(width))
            operand.pack_llvm(c, mk.gep(b, dst, b.mul(r0, kc), self.dtype), bidx, b.add(x0, r0),
                              _min(b, I64(width), b.sub(nx, r0)), k0, kc, width)

    def _alloc(self, c, elements):
        d = lookup_dtype(self.dtype)
        from ..lowering.llvm import declare
        alloc = declare(c.module, "TVMBackendAllocWorkspace", mk.PTR, [mk.I32, mk.I32, I64, mk.I32, mk.I32])
        nbytes = c.b.add(c.b.mul(elements, I64(d.nbytes)), I64(mk.VECTOR_BYTES))
        ptr = c.b.call(alloc, [mk.I32(1), mk.I32(0), nbytes, mk.I32(d.dl_code), mk.I32(d.bits)])
        with c.b.if_then(c.b.icmp_unsigned("==", c.b.ptrtoint(ptr, I64), I64(0)), likely=False):
            c.b.ret(mk.I32(-1))  # TVM's allocator has set the error
        return ptr

    def _free(self, c, ptr) -> None:
        from ..lowering.llvm import declare
        free = declare(c.module, "TVMBackendFreeWorkspace", mk.I32, [mk.I32, mk.I32, mk.PTR])
        c.b.call(free, [mk.I32(1), mk.I32(0), ptr])

    # ---- C -------------------------------------------------------------------------------------
    def emit_c(self, ctx) -> None:
        """A plain nest with the same contract: rows in parallel, ``k`` summed in order."""
        rows = f"({ctx.product(self.batch)}) * ({ctx.product(_dims(self.m))})"
        if self.serial():
            self._c_rows(ctx, "0", rows, ())
        else:
            ctx.parallel_for(rows, self._c_rows)

    def _c_rows(self, c, lo, hi, _extra) -> None:
        m, n, k = c.product(_dims(self.m)), c.product(_dims(self.n)), c.product(_dims(self.k))
        ctype = lookup_dtype(self.dtype).c
        with c.loop("gr", hi, lo):
            bidx = c.unravel(f"(gr / {m})", self.batch) if self.batch else []
            i = f"(gr % {m})"
            with c.block(f"for (int64_t gj0 = 0; gj0 < {n}; gj0 += {C_COLUMN_BLOCK})"):
                c.line(f"const int64_t gjn = {n} - gj0 < {C_COLUMN_BLOCK} ? {n} - gj0 : {C_COLUMN_BLOCK};")
                with c.loop("gj", "gj0 + gjn", "gj0"):
                    c.line(f"{ctype} acc = 0;")
                    with c.loop("gk", k):
                        c.line(f"acc += {self.a.element_c(c, bidx, i, 'gk')} * {self.b.element_c(c, bidx, 'gj', 'gk')};")
                    c.line(f"{c.element(self.c.buf, self.c.offset_c(c, bidx, i, 'gj'))} = acc;")
                if self.epilogue is not None:
                    self.epilogue(c, bidx, i, "1", "gj0", "gjn")
