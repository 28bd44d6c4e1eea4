"""A reusable packed GEMM engine: ``C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]``, then an epilogue.

This is not a kernel on its own (it registers nothing): kernels that are a matrix product
underneath (matmul, conv2d via im2col / implicit GEMM, ...) describe their operands
and, from their stage's ``emit_llvm``, call the library engine
(:func:`.gemm_engine.call` when :func:`.gemm_engine.fits`) or the inline driver
(:func:`.gemm_llvm.emit`); from ``emit_c``, :meth:`Gemm.emit_c`.

API
---
::

    g = Gemm(m=M, n=N, k=K, batch=(B0, B1), dtype="float32",
             a=Strided(x, batch=(sx0, sx1), x=K, k=1),        # A[b, m, k] = x[b*.. + m*K + k]
             b=Strided(w, batch=(0, 0), x=1, k=N),            # B[b, k, n] = w[k*N + n]
             c=Output(out, batch=(B1 * M * N, M * N), row=N), # C[b, m, n] = out[.. + m*N + n]
             epilogue=box_epilogue(stage))                    # or your own callable
    gemm_engine.call(g, ctx)  # in the stage's emit_llvm (or gemm_llvm.emit(g, ctx))
    g.emit_c(ctx)             # in its emit_c

* Dims (entries of ``batch``) are ints or symbolic names, as in :mod:`jitbyoc.ir.kir`;
  ``m``, ``n``, ``k`` are dims or tuples of dims (their product: e.g. batch dims folded
  into the rows when B is shared by every batch item). ``batch`` is the shape of the batch
  space (``()`` for one matrix); the engine walks it in row-major order and hands operands,
  output and epilogue ``b``, the tuple of per-dim batch indices (i64 values; C: ``int64_t``
  expressions).
* **Operands.** A and B are both seen as a panel source ``X(b, x, k)``: for A, ``x`` is the
  row ``m``; for B, ``x`` is the column ``n``. An operand implements

  - ``element_llvm(ctx, b, x, k) -> ir.Value`` and ``element_c(ctx, b, x, k) -> str``: the
    scalar ``X(b, x, k)`` (a padded conv returns 0 outside the image here);
  - optionally ``pack_llvm(ctx, dst, b, x0, nx, k0, kc, width)``: fill the panel
    ``dst[kk * width + r] = X(b, x0 + r, k0 + kk)`` for ``kk < kc``, ``r < nx``, and 0 for
    ``nx <= r < width``. ``dst`` is an LLVM pointer to ``dtype`` elements (element-aligned);
    ``width`` is the engine's register-tile size (MR for A, NR for B), ``nx <= width``;
    ``x0``/``nx``/``k0``/``kc`` are i64 values. The default (:class:`Operand`) packs element by
    element through ``element_llvm``; :class:`Strided` packs a unit-stride side with vector
    loads and a unit-stride ``k`` with in-register 16x16 transposes. A conv operand can
    override ``pack_llvm`` to gather im2col panels straight from the image, padding on the fly;
  - optionally ``direct_llvm(ctx, b) -> (ptr, x_stride, k_stride)`` (i64 strides): X is
    dense in memory at ``ptr + x*x_stride + k*k_stride``. The engine then reads A in place,
    never packing it, and B too when ``contiguous_x`` is true (``x_stride == 1``), so a
    row-major B is streamed straight from its rows. :class:`Strided` provides both.

  :class:`Strided` covers every dense layout: element ``(b, x, k)`` at
  ``sum(unravel(b)[i] * batch[i]) + x * x_stride + k * k_stride`` of a buffer, strides being
  dims or tuples of dims (products), 0 for a broadcast batch dim. A transposed operand is
  the same buffer with the two strides swapped. :class:`Panels` is a B packed at build
  time into the engine's own column panels (a constant weight: see
  :func:`jitbyoc.tvm.linear.prepacked_weight`); its ``direct_llvm`` gives the panel
  height as the x stride (valid at panel starts, which are all the engine asks for) and
  the panel width as the k stride, so the engine streams each panel in place.
* **Output.** :class:`Output` places ``C[b, m, n]`` at ``sum(unravel(b)[i] * batch[i]) +
  m * row + n`` of a buffer (unit stride along ``n``, so tiles are stored as vectors).
* **Epilogue.** ``epilogue(ctx, b, m0, mc, n0, nc)`` is called (in both renderers) once
  for every finished block ``C[b, m0:m0+mc, n0:n0+nc]``, right after its last update while
  it is hot in cache; values are i64 (LLVM) or C expressions. :func:`box_epilogue` maps the
  block to the ``ctx.epilogue(stage, origin, extent)`` box of a ``(*batch, M, N)`` output
  (dims of size 1 dropped, as in a 1-D matmul operand, are skipped); :func:`rows_epilogue`
  does it row by row when ``m`` is several output dims folded. ``None``: no epilogue.
  With ``private_c`` (C is a temp nothing but a box epilogue reads: a product whose
  epilogue writes another dtype) the LLVM rendering may keep C in a scratch of its own
  and pass the epilogue ``acc=(pointer, row stride)``, where the block's sums are.
* **Threads.** the LLVM emitters and ``emit_c`` run ``ctx.parallel_for`` themselves (so never
  call them from inside one). The LLVM rendering splits the larger of M and N (unless it
  has too few parts to share out: :func:`.gemm_llvm.split_side`) into chunks that tasks
  take from atomic counters, their own range first (:mod:`.gemm_llvm`); the C rendering
  splits rows statically. Packing buffers come from ``TVMBackendAllocWorkspace`` inside
  each task; static problems under :data:`SERIAL_MAX_MACS` stay on the calling thread.
* **Layers.** :mod:`.gemm_micro` holds the LLVM pieces a custom operand may reuse
  (``pack_rows``, ``pack_transposed``, ``transpose``, masked vector loads/stores);
  :mod:`.gemm_llvm` the driver (blocking, chunks, microkernel dispatch).
* **Accumulation order.** Per output element, the LLVM rendering sums ``k`` in order
  within blocks of at most :data:`KC` with fused multiply-adds (one rounding each), then
  adds the blocks in order into C; the C rendering sums ``k`` in order with separate
  multiply and add. Callers document tolerances from this (see :mod:`.matmul`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Callable, Union

from llvmlite import ir

from ..ir import bfloat
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I64
from ..render.indexing import dot
from ..render.isa import vector_bits, vector_registers
from ..render.loops import THREAD_MIN, for_range
from ..render.portable import LLVM, C
from . import gemm_micro as mk
from .gemm_tiles import TILE_ROWS, has_tiles
from .products import PRODUCTS, Product

Dim = Union[int, str]
Stride = Union[Dim, tuple]  # a dim, or a tuple of dims whose product is the stride


@dataclass(frozen=True)
class Blocking:
    """Register tile ``mr x nv*VL`` and cache blocks (elements) of one dtype.

    Loop order, outermost first: MC rows of A (when A is packed; it lives in L3), KC of K,
    NC columns of B (``kc x nc``, lives in L2), MR rows (the A micro-panel stays in L1
    while) NR columns stream B micro-panels from L2 through the microkernel.

    Measured on znver4 (1 core, GFLOP per CPU-second, 2048^3 and 64x1024x1024): tiles
    6x64, 8x48, 12x32, 14x32, 7x64 and k unrolls 1/2/4 all reach 100-104 and 103-109 of the
    117 the FMA loop reaches; 6x64 wastes least on small M (64 = 10*6+4) and N. Unroll 2:
    the same speed as 4 at half the code (builds of a 2048^3 product 0.64 s -> 0.33 s)."""
    mr: int
    nv: int
    unroll: int
    mc: int
    kc: int
    nc: int
    tiles: bool = False  # whole tiles on AMX (:mod:`.gemm_tiles`), edges on the vector kernel
    chunks: int = 8  # chunks per batch item that threads take (:func:`.gemm_llvm.chunk_count`)


# per register file (jitbyoc.render.isa: vector bits, registers): AVX-512's 32 zmm hold a
# 6x64 float32 tile (24 accumulators); AVX2's 16 ymm the classic 6x16 (12 accumulators,
# each 64-byte vector is two ymm), with B panels sized for a 512 KiB L2; SSE2's 16 xmm a
# 2x16 (8 accumulators: a 64-byte vector is four xmm); NEON's 32 q registers a 6x16 (24).
# ``kc`` is the same for a dtype everywhere: it fixes the summation order (see above).
# A bfloat16 product blocks as float32 does, its kc counted in pairs (units: see
# .products): the same bytes of B per panel row, twice the k. An int8 product (units of
# four k, summed exactly: no order to keep) has float32's kc in units: the same bytes of B
# per panel, four times the k.
_F32, _F64 = dict(unroll=2, mc=1020, kc=384), dict(unroll=2, mc=516, kc=256)
_BF16 = dict(_F32, kc=_F32["kc"] // 2)
_TILES = {(512, 32): (6, 4, 512, 320), (256, 16): (6, 1, 256, 128), (128, 16): (2, 1, 256, 128),
          (128, 32): (6, 1, 256, 128)}  # mr, nv, nc (float64's nc last)
_F64_MR = {(512, 32): 12}
BLOCKINGS = {regs: {"float32": Blocking(mr=mr, nv=nv, nc=nc, **_F32),
                    "float64": Blocking(mr=_F64_MR.get(regs, mr), nv=max(1, nv // 2), nc=nc64, **_F64),
                    "bfloat16": Blocking(mr=mr, nv=nv, nc=nc, **_BF16),
                    "uint8": Blocking(mr=mr, nv=nv, nc=nc, **_F32),
                    "int8": Blocking(mr=mr, nv=nv, nc=nc, **_F32)}
             for regs, (mr, nv, nc, nc64) in _TILES.items()}
KC = _F32["kc"]


def blocking_for(dtype: str) -> Blocking:
    """The blocking of the product ``dtype`` (a key of :data:`.products.PRODUCTS`) on the
    build's machine (:func:`jitbyoc.render.isa.current`): with AMX for the product, the
    tile kernel's ``32 x 32`` (:mod:`.gemm_tiles`)."""
    blocking = BLOCKINGS[vector_bits(), vector_registers()][dtype]
    if has_tiles(dtype):
        chunks = TILE_CHUNKS.get(dtype, blocking.chunks)
        return replace(blocking, mr=2 * TILE_ROWS, nv=2, unroll=1, tiles=True, chunks=chunks)
    return blocking


# chunks of a product on tiles, by dtype: a bfloat16 chunk takes twice an int8 one's time,
# and the thread that finishes first waits for the other's last chunk. ResNet-50 bf16
# (activations bf16, alternating exported builds, the AMX Xeon) 0.961x / 0.966x / 0.968x
# the time with 16 chunks, 24 1.013x; its QDQ int8 copy 1.03x with 16 (0.99-1.01x once
# chunks start on whole lines: gemm_llvm.line_parts), 12 0.996x: int8 stays at 8
TILE_CHUNKS = {"bfloat16": 16}


SERIAL_MAX_MACS = THREAD_MIN["gemm"]  # a static problem smaller than this runs on the calling thread
C_COLUMN_BLOCK = 64        # the C rendering applies the epilogue per row and 64 columns


def _dims(stride: Stride) -> tuple:
    return stride if isinstance(stride, tuple) else (stride,)


def _all_dims(g) -> tuple:
    return _dims(g.m) + _dims(g.n) + _dims(g.k) + tuple(g.batch)


def static_size(stride: Stride) -> int | None:
    """The size of a dim or product of dims when it is static, else None."""
    dims = _dims(stride)
    return reduce(lambda x, y: x * y, dims, 1) if all(isinstance(d, int) for d in dims) else None


def _is_one(stride: Stride) -> bool:
    return static_size(stride) == 1


def _linear(e, terms):
    """``sum(index * stride)`` in the portable facade ``e`` (:mod:`jitbyoc.render.portable`);
    zero strides drop out."""
    terms = [(index, s) for index, s in terms if not any(d == 0 for d in _dims(s))]
    return e.i(dot(e, [index for index, _ in terms], [e.product(_dims(s)) for _, s in terms]))


class Operand:
    """A panel source ``X(b, x, k)``; subclasses give elements and may pack faster."""
    dtype: str

    def element_llvm(self, ctx, b, x, k) -> ir.Value:
        raise NotImplementedError(f"{type(self).__name__} must define element_llvm")

    def element_c(self, ctx, b, x, k) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define element_c")

    def pack_all_llvm(self, ctx, dst, b, x0, nx, k0, kc, width: int) -> bool:
        """Pack all ``ceil(nx / width)`` panels at once (panel ``q`` at ``dst + q*kc*width``)
        where the operand has a faster way than :meth:`pack_llvm` per panel; False when
        it has none (nothing emitted)."""
        return False

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
class _InBuffer(Operand):
    """An operand held in a buffer, ``batch`` giving each batch dim's stride."""
    buf: object
    batch: tuple

    @property
    def dtype(self) -> str:
        return self.buf.dtype


@dataclass(frozen=True)
class Strided(_InBuffer):
    """``X(b, x, k) = buf[sum(b[i] * batch[i]) + x * x_stride + k * k_stride]``; as B,
    ``packed`` packs it even when its rows could be read in place (see
    :func:`.gemm_engine.call`)."""
    x: Stride
    k: Stride
    packed: bool = False

    def offset_llvm(self, ctx, b, x, k) -> ir.Value:
        return _linear(LLVM(ctx), list(zip(b, self.batch)) + [(x, self.x), (k, self.k)])

    def element_llvm(self, ctx, b, x, k) -> ir.Value:
        return ctx.load(self.buf, self.offset_llvm(ctx, b, x, k))

    def element_c(self, ctx, b, x, k) -> str:
        return ctx.element(self.buf, _linear(C(ctx), list(zip(b, self.batch)) + [(x, self.x), (k, self.k)]))

    @property
    def contiguous_x(self) -> bool:
        """Unit stride along ``x``: as B, rows of the panel can be read in place as vectors."""
        return _is_one(self.x)

    def direct_llvm(self, ctx, b) -> tuple:
        """``(pointer to X(b, 0, 0), x stride, k stride)``: the engine reads A in place
        through this instead of packing it (see :func:`.gemm_micro.microkernel`)."""
        return (ctx.element(self.buf, self.offset_llvm(ctx, b, I64(0), I64(0))),
                ctx.product(_dims(self.x)), ctx.product(_dims(self.k)))

    def pack_all_llvm(self, ctx, dst, b, x0, nx, k0, kc, width: int) -> bool:
        """Every panel of ``nx`` columns in one pass along k (:func:`.gemm_micro.pack_rows`)
        when rows are contiguous along ``x``; False (nothing emitted) otherwise."""
        if not _is_one(self.x):
            return False
        src = ctx.element(self.buf, self.offset_llvm(ctx, b, x0, k0))
        mk.call_packer(ctx.b, "rows", self.dtype, dst, src, ctx.product(_dims(self.k)), nx, kc, width)
        return True

    def pack_llvm(self, ctx, dst, b, x0, nx, k0, kc, width: int) -> None:
        if self.pack_all_llvm(ctx, dst, b, x0, nx, k0, kc, width):
            return
        src = ctx.element(self.buf, self.offset_llvm(ctx, b, x0, k0))
        if _is_one(self.k):
            mk.call_packer(ctx.b, "transposed", self.dtype, dst, src, ctx.product(_dims(self.x)), nx, kc, width)
        else:
            super().pack_llvm(ctx, dst, b, x0, nx, k0, kc, width)


@dataclass(frozen=True)
class Panels(_InBuffer):
    """B packed at build time into the engine's column panels (:func:`panel_width` of
    them, ``k_size`` rows each, one after another): ``X(b, x, k) = buf[sum(b[i] *
    batch[i]) + (x // width) * width * k_size + k * width + x % width]``. The engine reads
    each panel in place: one contiguous run, where a row-major B puts every row of a
    micro-panel ``N`` elements (a page, for N >= 1024) from the last. A product of units
    of ``group`` k (:mod:`.products`) has them interleaved: each panel row is ``width``
    columns of ``group`` consecutive k (``k_size`` a multiple of ``group``)."""
    k_size: Dim
    width: int
    group: int = 1

    def _offset(self, e, b, x, k):
        g = self.group
        panel = e.mul(e.div(x, self.width), e.mul(e.dim(self.k_size), self.width))
        if g == 1:
            inner = e.add(e.mul(k, self.width), e.rem(x, self.width))
        else:  # unit k // g of column x, then k's place in it
            inner = e.add(e.mul(e.add(e.mul(e.div(k, g), self.width), e.rem(x, self.width)), g), e.rem(k, g))
        return e.i(e.add(_linear(e, list(zip(b, self.batch))), e.add(panel, inner)))

    def element_llvm(self, ctx, b, x, k) -> ir.Value:
        return ctx.load(self.buf, self._offset(LLVM(ctx), b, x, k))

    def element_c(self, ctx, b, x, k) -> str:
        return ctx.element(self.buf, self._offset(C(ctx), b, x, k))

    def direct_llvm(self, ctx, b) -> tuple:
        """``(pointer to X(b, 0, 0), k_size, width)``, strides in units of ``group``
        elements: column ``x`` of a panel start is ``x * k_size`` elements in, and a
        panel's rows are ``width`` units apart."""
        e = LLVM(ctx)
        units = e.i(e.div(e.dim(self.k_size), self.group)) if self.group > 1 else e.i(e.dim(self.k_size))
        return ctx.element(self.buf, self._offset(e, b, I64(0), I64(0))), units, I64(self.width)


def panel_width(dtype: str) -> int:
    """The engine's NR for the product ``dtype`` on the build's machine: the column-panel
    width :class:`Panels` are packed in (64 float32 columns with AVX-512, 16 with AVX2)."""
    return blocking_for(dtype).nv * mk.lanes(PRODUCTS[dtype].acc)


@dataclass(frozen=True)
class Output:
    """``C[b, m, n]`` at ``buf[sum(b[i] * batch[i]) + m * row + n]``."""
    buf: object
    batch: tuple
    row: Stride

    def offset_llvm(self, ctx, b, m, n) -> ir.Value:
        return ctx.b.add(_linear(LLVM(ctx), list(zip(b, self.batch)) + [(m, self.row)]), ctx.i64(n))

    def offset_c(self, ctx, b, m, n) -> str:
        return f"{_linear(C(ctx), list(zip(b, self.batch)) + [(m, self.row)])} + ({n})"


def box_epilogue(stage, has_m: bool = True, has_n: bool = True) -> Callable:
    """An engine epilogue applying ``stage.epilogue`` to the block's box of ``stage.out``,
    an output shaped ``(*batch, [M], [N])`` (``has_m``/``has_n`` False: that dim dropped)."""
    def apply(ctx, b, m0, mc, n0, nc, acc=None):
        origin = list(b) + ([m0] if has_m else []) + ([n0] if has_n else [])
        extent = [1] * len(b) + ([mc] if has_m else []) + ([nc] if has_n else [])
        if acc is None:
            ctx.epilogue(stage, origin, extent)
        else:  # only where has_m and has_n (Gemm.private_c): the scratch's rows are M's
            ctx.epilogue(stage, origin, extent, acc=acc)
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


@dataclass
class Gemm:
    """One (batched) matrix product; see the module docstring for the contract."""
    m: Stride  # a dim, or a tuple of dims (their product: batch dims folded into rows)
    n: Stride
    k: Stride
    a: Operand
    b: Operand
    c: Output
    dtype: str = "float32"  # the product (a key of .products.PRODUCTS)
    batch: tuple = ()
    epilogue: Callable | None = None
    blocking: Blocking = field(default=None)
    private_c: bool = False  # C is read by the (box) epilogue only: see the module docstring
    # bytes of the narrowest element stored in C's place (C's, or the epilogue's outputs'):
    # a chunk of columns starts on a whole cache line of it (.gemm_llvm.line_parts)
    stored: int = 4
    # A is a weight read from memory once a call (a convolution's): while a row tile's
    # columns compute, the next tile's rows are prefetched (.gemm_llvm.next_rows); True,
    # or in the engine the name of its run-time flag
    stream_a: bool | str = False

    def __post_init__(self):
        self.blocking = self.blocking or blocking_for(self.dtype)

    @property
    def product(self) -> Product:
        return PRODUCTS[self.dtype]

    @property
    def nr(self) -> int:
        return self.blocking.nv * mk.lanes(self.product.acc)

    def static(self) -> bool:
        return all(isinstance(d, int) for d in _all_dims(self))

    def serial(self) -> bool:
        return self.static() and reduce(lambda x, y: x * y, _all_dims(self), 1) < SERIAL_MAX_MACS

    # ---- C -------------------------------------------------------------------------------------
    def emit_c(self, ctx) -> None:
        """A plain nest with the same contract: rows in parallel, ``k`` summed in order."""
        rows = f"({ctx.product(self.batch)}) * ({ctx.product(_dims(self.m))})"
        if self.serial():
            self._c_rows(ctx, "0", rows, ())
        else:
            ctx.parallel_for(rows, self._c_rows)

    def _c_rows(self, c, lo, hi, _extra) -> None:
        """Rows ``lo .. hi``; A's and B's elements are widened to the accumulator's dtype
        (bfloat16 exactly to float32) and summed there."""
        # parenthesized: a symbolic product ("INT64_C(1) * sym0") is one operand of / and %
        m, n, k = (f"({c.product(_dims(d))})" for d in (self.m, self.n, self.k))
        ctype = lookup_dtype(self.product.acc).c
        with c.loop("gr", hi, lo):
            bidx = c.unravel(f"(gr / {m})", self.batch) if self.batch else []
            i = f"(gr % {m})"
            with c.block(f"for (int64_t gj0 = 0; gj0 < {n}; gj0 += {C_COLUMN_BLOCK})"):
                c.line(f"const int64_t gjn = {n} - gj0 < {C_COLUMN_BLOCK} ? {n} - gj0 : {C_COLUMN_BLOCK};")
                # a row of accumulators, k outermost: each sum still runs in k order, and the
                # inner loop walks a row of B (the compiler vectorizes it)
                c.line(f"{ctype} acc[{C_COLUMN_BLOCK}] = {{0}};")
                with c.loop("gk", k):
                    a, b = (lookup_dtype(x.dtype) for x in (self.a, self.b))
                    c.line(f"const {ctype} a = {bfloat.widened_c(a, self.a.element_c(c, bidx, i, 'gk'))};")
                    with c.loop("gj", "gjn"):
                        c.line(f"acc[gj] += a * {bfloat.widened_c(b, self.b.element_c(c, bidx, '(gj0 + gj)', 'gk'))};")
                with c.loop("gj", "gj0 + gjn", "gj0"):
                    c.line(f"{c.element(self.c.buf, self.c.offset_c(c, bidx, i, 'gj'))} = acc[gj - gj0];")
                if self.epilogue is not None:
                    self.epilogue(c, bidx, i, "1", "gj0", "gjn")

