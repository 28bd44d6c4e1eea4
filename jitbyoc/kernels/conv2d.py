"""relax.nn.conv2d (NCHW/OIHW) and relax.nn.conv1d (NCW/OIW): any stride, padding,
dilation and groups, depthwise included, with a fused elementwise epilogue.

LLVM rendering, by geometry:

* *small maps, long reductions* (7x7, 13x13, 14x14 maps, 1x1 or k x k, a constant
  weight; grouped float32 ones in groups of whole vectors of channels, strided or on
  maps at most a vector wide): vectors of output channels times a tile of pixels
  (:mod:`jitbyoc.engines.conv_channels`; float32, bf16 pairs, int8 quads), where
  vectors of pixels waste lanes, chosen
  when its cost model says it beats the path below that would run the conv otherwise
  (a weight that is an input takes that path);
* *pointwise* (1x1, no padding, at least 8 input channels per group): a matrix product
  per group on the GEMM engine, on views of the operands (a strided one first gathers
  the pixels it reads into a workspace);
* *patches* (non-overlapping windows: stride = kernel, no padding or dilation, one group;
  ViT's 16x16/16 patch embedding, ConvNeXt's and Swin's 4x4/4 and 2x2/2): each window
  gathered once as a column of a workspace, then one matrix product on the GEMM engine;
* *on AMX tiles* (bf16 and int8 products, one group): overlapping windows or a strided
  1x1 as one matrix product whose B is gathered straight into the tile kernel's panels,
  the weight read tap-major (:mod:`.conv_panels`);
* *depthwise* (one filter per channel, column stride up to 4): straight from the input,
  vectors of output columns, one masked load per tap (:mod:`.depthwise_llvm`);
* otherwise a call of the direct-convolution library engine (:mod:`jitbyoc.engines.conv_engine`,
  compiled once per register block and shared by every layer). The input is first copied
  into a zero-padded workspace laid out so that every tap of the kernel window reads a
  *contiguous* run of it (:mod:`jitbyoc.engines.conv_plan`: phase planes, or one shifted
  plane per kernel column for small images); outputs are then computed ``lanes`` pixels
  per vector, register-blocked over ``J`` output channels x ``V`` vectors, with weights
  read as broadcast scalars (from blocks of J channels when the weight is a constant,
  :mod:`jitbyoc.tvm.conv_weights`; else from OIHW). Layout, vector width and blocking are
  chosen per conv by a cost model. Threads take (image, group, channel block, row band)
  tasks; each task applies the epilogue to its band while it is in cache.

The C rendering is the plain loop nest.

Accuracy: every output is a sum of ``K = Cin/groups * KH * KW`` products accumulated in
one fixed order per output (LLVM: input channel, then the window's taps in row-major
order, with fused multiply-adds; C: channel, kernel row, kernel column, multiply then
add; TVM: its own). Each result is within ``K * u * sum_i |x_i * w_i|`` of the exact sum
(u: unit roundoff, 2**-24 for float32), so any two agree within twice that: the tests'
tolerance (plus one rounding per epilogue op). Padding zeros take part in the sum
(0 * w), as in TVM's padded input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from ..engines import conv_channel_plan, conv_channels, conv_engine, conv_tiles, gemm_tiles
from ..engines.conv_channel_plan import ChannelPlan
from ..engines.conv_plan import Plan, choose_plan
from ..engines.products import OPERANDS, PRODUCTS, RESULTS, product_of
from ..ir import bfloat, kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64
from ..ir.relax_types import dims, operands_problem
from ..ir.rules import register
from ..render.loops import for_range, smax, smin, threaded
from ..render.vectors import lane_mask, lanes, strips, vload, vstore, vtype
from . import conv_panels, conv_weight_units, depthwise_llvm, winograd
from .matmul import MatMul

MIN_POINTWISE_CG = 8  # input channels per group for a pointwise conv to run as a product
MAX_VECTOR_STRIDE = 4  # column strides the gather reads as vectors (n * stride elements, then a shuffle)
COLUMNS_MAX_PIXELS = 49  # output pixels up to which an int8 conv is gathered (ConvGeometry.columns)
# the reduction (channels x taps) from which an int8 conv on AMX tiles is gathered
# whatever its map, unless its channels are whole quads (gathered tap-major straight into
# the product's panels, kernels.conv_panels: SqueezeNet's QDQ graph 0.934x with its 3x3
# convs of 16 and 32 channels on tiles, alternating processes). Gathered as a matrix and
# packed, SqueezeNet ran in 0.92x the time with those convs (144, 288) and its stem (27)
# on the pixel engine, 0.94x with only 144 and 27 there; Inception v1 and ResNet-50 (432
# and up, stems 147) level either way. A bf16 conv is gathered from any reduction:
# ResNet-50's stem (147) took 1.16 ms on tiles against 2.0 on the pixel engine. Stems of
# fewer than a quad of channels (padded to one) run tap-major on tiles too, since their
# int32 sums stay in the product's scratch (gemm_llvm.scratch_c) where the pixel engine
# wrote them all to memory first: SqueezeNet QDQ 0.893x, ResNet-50 level (alternating)
COLUMNS_TILES_MIN_K = 320


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one convolution; only the batch ``n`` may be symbolic."""
    n: kir.Dim
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    stride: tuple
    dilation: tuple
    pad: tuple  # top, left, bottom, right
    groups: int
    oh: int
    ow: int
    gathered: bool = False  # an int8 product: small maps gathered as columns (see columns)
    tiles: bool = False  # a product on AMX tiles: every map gathered as columns

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def kg(self) -> int:
        return self.k // self.groups

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def pointwise(self) -> bool:
        """A 1x1 convolution, a matrix product per group: ``out[n, g] = W[g] (K/g x C/g)
        @ x[n, g] (C/g x OH*OW)``, ``x`` subsampled first when strided (not for
        depthwise-like groups, whose products are too thin to pay for the engine)."""
        return self.taps == 1 and not any(self.pad) and self.cg >= MIN_POINTWISE_CG

    @property
    def patches(self) -> bool:
        """Non-overlapping windows, a matrix product on the windows gathered as columns:
        ``out[n] = W (K x C*KH*KW) @ work[n] (C*KH*KW x OH*OW)``, each input pixel copied
        once. ViT-B/16's 16x16/16 embedding compiled a direct-conv engine of its own
        (210 ms of LLVM, its largest job) for one layer; ViT's products share one."""
        return (self.taps > 1 and self.stride == (self.kh, self.kw) and self.dilation == (1, 1)
                and not any(self.pad) and self.groups == 1)

    @property
    def columns(self) -> bool:
        """Overlapping windows, each gathered as a column (im2col), then one matrix
        product: the int8 path (:func:`conv_geometry` sets ``gathered``) of a convolution
        with one group whose output map is small. Measured (Zen 4, 2 threads, uint8 x
        int8 3x3 convolutions alone, alternating builds, GOP/s gathered vs the pixel
        engine): 512->512 on 7x7 443 vs 97, 14x14/2 -> 7x7 278 vs 143; but 256 on 14x14
        527 vs 723, 320 on 13x13 419 vs 820, 64 on 56x56 580 vs 753 (the pixel engine
        wastes lanes on a 7-wide map; elsewhere its register blocks win). With AMX
        (:mod:`jitbyoc.engines.gemm_tiles`; int8 and bf16, ``tiles``) every map:
        ResNet-50's QDQ 3x3 layers ran at 409-930 GOP/s gathered against 271-360 on the
        pixel engine (Sapphire Rapids-class Xeon, 2 threads, jitbyoc.profile), from a
        reduction of :data:`COLUMNS_TILES_MIN_K` up. A constant weight's small map runs on
        channel vectors of quads instead where their cost model says so
        (:func:`engine_plan`; 512->512 on 7x7 319 us against 1054 gathered, Zen 4)."""
        small = self.oh * self.ow <= COLUMNS_MAX_PIXELS
        quads = self.groups == 1 and (self.cg % 4 == 0 or self.cg < 4)  # tap-major (kernels.conv_panels), a stem padded
        tiles = self.tiles and (not self.gathered or quads or self.cg * self.taps >= COLUMNS_TILES_MIN_K)
        return self.taps > 1 and self.groups == 1 and (self.gathered and small or tiles)

    @property
    def as_matmul(self) -> bool:
        return self.pointwise or self.patches or self.columns

    @property
    def gathers(self) -> bool:
        """A matrix product on pixels gathered first (strided, patches, columns), not on
        the input where it lies."""
        return self.as_matmul and (self.stride != (1, 1) or self.columns)


def conv_geometry(call) -> ConvGeometry:
    x, w, out = (dims(a.ty) for a in (call.args[0], call.args[1], call))
    a = call.attrs
    if len(x) == 3:  # conv1d: a conv2d with one row
        return ConvGeometry(x[0], x[1], 1, x[2], w[0], 1, w[2], (1, int(a.strides[0])),
                            (1, int(a.dilation[0])), (0, int(a.padding[0]), 0, int(a.padding[1])),
                            int(a.groups), 1, out[2])
    dt = str(call.args[0].ty.dtype)
    group = PRODUCTS.get(dt, PRODUCTS["float32"]).group  # 4: int8 quads; 2: bf16 pairs
    return ConvGeometry(x[0], x[1], x[2], x[3], w[0], w[2], w[3],
                        tuple(int(s) for s in a.strides), tuple(int(d) for d in a.dilation),
                        tuple(int(p) for p in a.padding), int(a.groups), out[2], out[3],
                        group == 4, group > 1 and gemm_tiles.has_tiles(dt))


C_COLUMNS = 64  # output columns per block of accumulators in the C rendering


@dataclass(eq=False)
class Conv2d(kir.KernelStage):
    """``out = conv(x, w)``; ``work`` holds ``x`` packed as ``plan.layout`` says. With
    ``packed`` (:func:`jitbyoc.kernels.fold_permutes.fold_conv_weights`), ``w`` is the
    weight in blocks of ``plan.j`` output channels, ``(K/J, Cin/groups, KH, KW, J)``."""
    geo: ConvGeometry = None
    plan: Plan = None
    work: kir.Buffer = None
    packed: bool = False
    # w is the weight tap-major, (K, KH, KW, Cin) (jitbyoc.tvm.conv_weights.tap_major_conv), and
    # the product gathers its columns into panels (kernels.conv_panels; ``work``: whole panels or None)
    tap_major: bool = False
    units: kir.Buffer = None  # the input's unit planes the tap-major gather reads (conv_panels.pack_units)
    # w is winograd.packed_weight's (p + 9, K, C): the transformed weight, then OIHW; ``work`` holds
    # the transformed input, ``sums`` the products, one per point (kernels.winograd, fold_winograd_weights)
    winograd: bool = False
    sums: kir.Buffer = None
    writes_epilogue_apart = True  # every path calls ctx.epilogue on finished bands

    def emit_llvm(self, ctx) -> None:
        channels = isinstance(self.plan, ChannelPlan)
        if self.winograd:
            winograd.emit(self, ctx)
        elif channels and self.packed:
            conv_channels.call(self, ctx)
        elif self.tap_major and conv_panels.direct(self.geo, self.inputs[1].dtype):
            conv_tiles.call(self, ctx)  # on AMX tiles, the input read where it lies
        elif self.geo.as_matmul:  # the GEMM engine, also for a weight that is an input
            self._emit_as_matmul(ctx)
        elif depthwise_llvm.fits(self.geo, self.inputs[0].dtype):
            depthwise_llvm.emit(self, ctx)
        elif PRODUCTS[self.inputs[0].dtype].group > 1 and not self.packed:  # units need a packed weight
            conv_weight_units.call_packed(self, ctx)
        else:  # the pixel engine (a channel plan's fallback for a weight that is an input)
            conv_engine.call(self, ctx, self.plan.fallback if channels else None)

    def _emit_as_matmul(self, ctx) -> None:
        """A pointwise convolution is a matrix product per group (the GEMM engine runs it
        at GEMM speed, where vectors over pixels waste lanes on 14x14 and 7x7 maps), on
        views of the operands: no copy unless strided. The epilogue runs in the engine's blocks when every
        buffer it reads has a view shaped like the product's output, else once after it."""
        g, (x, w) = self.geo, self.inputs
        if self.tap_major:  # the product's panels gathered from x: whole first, or by its blocks
            if self.units is not None:
                conv_panels.pack_units(self, ctx)
            if self.work is not None:
                conv_panels.gather(self, ctx)
        elif self.work is not None:  # strided or patches: the pixels the product reads, as columns
            _gather_columns(self, ctx)
            x = self.work
        lead = () if g.n == 1 else (g.n,)
        chans = (g.groups,) if g.groups > 1 else ()
        pixels = g.oh * g.ow
        rows = (conv_panels.channels(g, w.dtype) if self.tap_major else g.cg) * g.taps
        stores = self.epilogue_stores()
        flat = _flat_epilogue([e for _, e in stores], self.out, lead, g.groups) if stores else None
        shape = lead + chans + (g.kg, pixels)
        product = MatMul((kir.view(w, chans + (g.kg, rows)), kir.view(x, lead + chans + (rows, pixels))),
                         kir.view(self.out, shape), epilogue=flat and flat[0],
                         epilogue_out=None if flat is None or self.epilogue_out is None
                         else kir.view(self.epilogue_out, shape),
                         epilogue_also=tuple((kir.view(buf, shape), e) for (buf, _), e in zip(stores[1:], flat[1:]))
                         if flat else (), stream_a=True)
        panels = None
        if self.tap_major:  # B is the panels, not the view of x above (which gives the product's shape)
            panels = conv_panels.operand(self.work, lead) if self.work is not None \
                else conv_panels.Windows(x, g, self.units)
        product.emit_llvm(ctx, panels)
        if self.epilogue is not None and flat is None:
            ctx.epilogue(self, [0] * self.out.ndim, [ctx.dim(d) for d in self.out.shape])

    def macs(self) -> tuple:
        g = self.geo
        return (g.n, g.k, g.oh, g.ow, g.cg, g.kh, g.kw)

    def needs_loop_vectorizer(self) -> bool:
        return False  # the conv engine is explicit vectors

    # ---- C: a portable nest (inspection and export) --------------------------------------------
    def emit_c(self, ctx) -> None:
        """(image, output channel) rows in parallel; per output row, a block of column
        accumulators summed over (input channel, tap row, tap column) in that order, the
        inner loop along the columns (the compiler vectorizes it)."""
        g = self.geo
        ctx.parallel_for(f"{ctx.dim(g.n)} * {g.k}", self._c_rows)
        ctx.epilogue(self, ["0"] * self.out.ndim, [ctx.dim(d) for d in self.out.shape])

    def _c_rows(self, c, lo, hi, _extra) -> None:
        g, (x, w), out = self.geo, self.inputs, self.out
        (sh, sw), (dh, dw), (pt, pl, _, _) = g.stride, g.dilation, g.pad
        ctype, block = lookup_dtype(out.dtype).c, C_COLUMNS
        with c.loop("r", hi, lo):
            c.line(f"const int64_t n = r / {g.k}, oc = r % {g.k}, grp = oc / {g.kg};")
            with c.loop("oh", g.oh), c.block(f"for (int64_t ow0 = 0; ow0 < {g.ow}; ow0 += {block})"):
                c.line(f"const int64_t own = {g.ow} - ow0 < {block} ? {g.ow} - ow0 : {block};")
                c.line(f"{ctype} acc[{block}] = {{0}};")
                with c.loop("ic", g.cg), c.loop("i", g.kh):
                    c.line(f"const int64_t ih = oh * {sh} + i * {dh} - {pt};")
                    c.line(f"const int64_t row = ((n * {g.c} + grp * {g.cg} + ic) * {g.h} + ih) * {g.w};")
                    with c.loop("j", g.kw):
                        wv = bfloat.widened_c(lookup_dtype(w.dtype), c.element(w, self._c_weight_index()))
                        c.line(f"const {ctype} wv = {wv};")
                        with c.loop("o", "own"):
                            c.line(f"const int64_t iw = (ow0 + o) * {sw} + j * {dw} - {pl};")
                            xv = bfloat.widened_c(lookup_dtype(x.dtype), c.element(x, 'row + iw'))
                            c.line(f"const {ctype} xv = (ih >= 0 && ih < {g.h} && iw >= 0 && iw < {g.w})"
                                   f" ? {xv} : 0;")
                            c.line("acc[o] += xv * wv;")
                with c.loop("o", "own"):
                    c.line(f"{c.element(out, f'((n * {g.k} + oc) * {g.oh} + oh) * {g.ow} + ow0 + o')} = acc[o];")

    def _c_weight_index(self) -> str:
        """The C index of output channel ``oc``'s weight at (``ic``, ``i``, ``j``) in ``w``
        (packed in units of ``u`` channels: ``(K/J, Cin/u, KH, KW, J, u)``)."""
        g = self.geo
        if self.winograd:  # OIHW after the transformed weight
            return f"{(self.inputs[1].shape[0] - 9) * g.k * g.c} + ((oc * {g.cg} + ic) * {g.kh} + i) * {g.kw} + j"
        if self.tap_major and conv_panels.direct(g, self.inputs[1].dtype):  # tile by tile
            *_, cs, _, c = conv_panels.tile_shape(g, self.inputs[1].dtype)
            return f"((((oc / 16) * {g.kh} + i) * {g.kw} + j) * {cs} + ic / {c}) * {16 * c} + oc % 16 * {c} + ic % {c}"
        if self.tap_major:  # (K, KH, KW, Cin in whole units); a 1x1 in whole units: OIHW as it lies
            return f"((oc * {g.kh} + i) * {g.kw} + j) * {conv_panels.channels(g, self.inputs[1].dtype)} + ic"
        if not self.packed:
            return f"((oc * {g.cg} + ic) * {g.kh} + i) * {g.kw} + j"
        jb, u = self.plan.j, PRODUCTS[self.inputs[0].dtype].group
        if u > 1:
            return (f"(((((oc / {jb}) * {g.cg // u} + ic / {u}) * {g.kh} + i) * {g.kw} + j) * {jb} + oc % {jb})"
                    f" * {u} + ic % {u}")
        return f"((((oc / {jb}) * {g.cg} + ic) * {g.kh} + i) * {g.kw} + j) * {jb} + oc % {jb}"

    @staticmethod
    def reference(x: np.ndarray, w: np.ndarray, strides=(1, 1), padding=(0, 0, 0, 0),
                  dilation=(1, 1), groups: int = 1) -> np.ndarray:
        """NCHW/OIHW convolution accumulated in float64 (NCW/OIW: 2-tuples, 2-padding)."""
        if x.ndim == 3:
            y = Conv2d.reference(x[:, :, None], w[:, :, None], (1, strides[0]),
                                 (0, padding[0], 0, padding[1]), (1, dilation[0]), groups)
            return y[:, :, 0]
        (n, c, h, wd), (k, cg, kh, kw) = x.shape, w.shape
        (sh, sw), (dh, dw), (pt, pl, pb, pr) = strides, dilation, padding
        xp = np.zeros((n, c, h + pt + pb, wd + pl + pr))
        xp[:, :, pt:pt + h, pl:pl + wd] = x
        oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
        ow = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
        xg = xp.reshape(n, groups, cg, *xp.shape[2:])
        wg = w.astype(np.float64).reshape(groups, k // groups, cg, kh, kw)
        out = np.zeros((n, groups, k // groups, oh, ow))
        for i in range(kh):
            for j in range(kw):
                win = xg[:, :, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out += np.einsum("ngchw,gkc->ngkhw", win, wg[:, :, :, i, j])
        return out.reshape(n, k, oh, ow).astype(x.dtype)


def _gather_columns(stage, ctx) -> None:
    """``work[n, (c, ky, kx), (oy, ox)] = x[n, c, oy*sh + ky*dh - pt, ox*sw + kx*dw - pl]``
    (zero outside ``x``), the pixels the product reads as a dense matrix: a strided 1x1
    conv's (ResNet's shortcuts: a quarter of the input), a patch conv's windows (each
    input pixel once), or every window of a gathered one (:attr:`ConvGeometry.columns`)."""
    g = stage.geo

    def planes(c, lo, hi, _extra=()):
        cb = c.b
        with for_range(cb, hi, "pl", start=lo) as pl, for_range(cb, I64(g.taps), "tap") as t:
            ky, kx = cb.sdiv(t, I64(g.kw)), cb.srem(t, I64(g.kw))
            with for_range(cb, I64(g.oh), "oh") as oh:
                _gather_row(stage, c, pl, t, ky, kx, oh)

    count = ctx.product((g.n, g.c))
    if threaded(stage.work.shape, "copy"):
        ctx.parallel_for(count, planes)
    else:
        planes(ctx, I64(0), count)


def _gather_row(stage, c, plane, tap, ky, kx, oh) -> None:
    """Output row ``oh`` of tap ``(ky, kx)`` of input plane ``plane``: its ``ow`` pixels,
    zeros where the window leaves the input; vectors where the row is contiguous
    (stride 1), pixel by pixel otherwise."""
    g, x, work, b = stage.geo, stage.inputs[0], stage.work, c.b
    (sh, sw), (dh, dw), (pt, pl, _, _) = g.stride, g.dilation, g.pad
    iy = b.sub(b.add(b.mul(oh, I64(sh)), b.mul(ky, I64(dh))), I64(pt))
    x0 = b.sub(b.mul(kx, I64(dw)), I64(pl))  # the input column of output column 0
    row_in = b.mul(b.add(b.mul(plane, I64(g.h)), iy), I64(g.w))
    row_out = b.add(b.mul(b.add(b.mul(plane, I64(g.taps)), tap), I64(g.oh * g.ow)), b.mul(oh, I64(g.ow)))
    inside = b.and_(b.icmp_signed(">=", iy, I64(0)), b.icmp_signed("<", iy, I64(g.h)))
    dt = x.dtype
    if sw <= MAX_VECTOR_STRIDE and lookup_dtype(dt).nbytes <= 4:
        n = lanes(dt)
        zero = ir.Constant(vtype(dt, n), None)
        # columns [first, last) read inside the row: ceil(-x0 / sw) and ceil((w - x0) / sw)
        first = smin(b, b.sdiv(b.add(smax(b, b.neg(x0), I64(0)), I64(sw - 1)), I64(sw)), I64(g.ow))
        last = smax(b, smin(b, b.sdiv(smax(b, b.add(b.sub(I64(g.w), x0), I64(sw - 1)), I64(0)), I64(sw)),
                            I64(g.ow)), first)
        first, last = (b.select(inside, v, I64(g.ow)) for v in (first, last))
        store = lambda j, mask, v: vstore(b, v, c.element(work, b.add(row_out, j)), dt, mask)  # noqa: E731
        strips(b, I64(0), first, n, lambda j, mask: store(j, mask, zero))
        strips(b, first, last, n, lambda j, mask: store(j, mask, _strided_load(b, c, x, row_in, x0, j, mask, g)))
        strips(b, last, I64(g.ow), n, lambda j, mask: store(j, mask, zero))
        return
    with for_range(b, I64(g.ow), "ow") as ow:
        ix = b.add(x0, b.mul(ow, I64(sw)))
        ok = b.and_(inside, b.and_(b.icmp_signed(">=", ix, I64(0)), b.icmp_signed("<", ix, I64(g.w))))
        value = c.load(x, b.select(ok, b.add(row_in, ix), I64(0)))
        c.store(work, b.add(row_out, ow), b.select(ok, value, ir.Constant(value.type, None)))


def _strided_load(b, c, x, row_in, x0, j, mask, g):
    """Input columns ``x0 + (j + l) * sw`` of a row for the output lanes ``l`` (``mask``:
    those stored; None: all): at stride 1 one vector; else ``n * sw`` consecutive
    elements, masked at the row's end, every ``sw``-th kept by a shuffle."""
    sw, dt = g.stride[1], x.dtype
    n, start = lanes(dt), b.add(x0, b.mul(j, I64(sw)))
    if sw == 1:
        return vload(b, c.element(x, b.add(row_in, start)), dt, mask, n)
    wide = vload(b, c.element(x, b.add(row_in, start)), dt, lane_mask(b, b.sub(I64(g.w), start), n * sw), n * sw)
    keep = ir.Constant(ir.VectorType(I32, n), [lane * sw for lane in range(n)])
    return b.shuffle_vector(wide, ir.Constant(wide.type, None), keep)


def _flat_epilogue(roots: list, out: kir.Buffer, lead: tuple, groups: int):
    """The epilogue's ``roots`` (over ``out``: N, K, spatial...) over the view the product writes,
    ``lead + [groups,] (K / groups, pixels)``, each load viewed alike (a per-channel bias
    ``(1, K, 1, 1)`` as ``(K, 1)``); None when a load has no such view (it broadcasts
    along some spatial dims but not all, or along the batch of a single image)."""
    spatial, k = tuple(out.shape[2:]), out.shape[1]
    mapping = {}
    for load in (n for n in kir.walk(roots) if isinstance(n, kir.Load)):
        n, c, *where = (1,) * (out.ndim - load.buf.ndim) + tuple(load.buf.shape)
        if (not lead and n != 1) or tuple(where) not in ((1,) * len(spatial), spatial):
            return None
        chans = ((groups, k // groups) if c == k else (1, 1)) if groups > 1 else (c,)
        pixels = 1 if all(d == 1 for d in where) else int(np.prod(spatial))
        mapping[load] = kir.Load(kir.view(load.buf, (n,) * len(lead) + chans + (pixels,)))
    return kir.substitute_all(roots, mapping)


def _layout_problem(call) -> str | None:
    a = call.attrs
    one_d = call.op.name == "relax.nn.conv1d"
    want = ("NCW", "OIW") if one_d else ("NCHW", "OIHW")
    got = (str(a.data_layout), str(a.kernel_layout))
    out_layout = str(a.out_layout) if a.out_layout is not None else got[0]
    if got != want or out_layout != want[0]:
        return f"layout {got[0]}/{got[1]}->{out_layout} not supported (only {want[0]}/{want[1]})"
    return None


def _check(call) -> str | None:
    name = call.op.name
    x, w = call.args
    problem = operands_problem(call, (x, w), OPERANDS) or operands_problem(call, (call,), RESULTS)
    if problem:
        return problem
    rank = 3 if name == "relax.nn.conv1d" else 4
    if len(dims(x.ty)) != rank or len(dims(w.ty)) != rank:
        return f"{name}: operands are not rank {rank}"
    types = (str(x.ty.dtype), str(w.ty.dtype), str(call.ty.dtype))
    if product_of(*types) is None:
        return f"{name}: mixed dtypes {x.ty.dtype}, {w.ty.dtype} -> {call.ty.dtype} (out_dtype) not supported"
    problem = _layout_problem(call)
    if problem:
        return f"{name}: {problem}"
    if any(isinstance(d, str) for d in dims(x.ty)[1:] + dims(w.ty) + dims(call.ty)[1:]):
        return f"{name}: only the batch dim may be symbolic"
    if dims(call.ty)[0] != dims(x.ty)[0]:
        return f"{name}: output batch differs from input batch"
    geo = conv_geometry(call)
    return _geometry_problem(name, geo, dims(w.ty)[1])


def _geometry_problem(name: str, g: ConvGeometry, w_in: int) -> str | None:
    if g.groups < 1 or g.c % g.groups or g.k % g.groups or w_in != g.cg:
        return f"{name}: groups={g.groups} does not divide channels {g.c}->{g.k} (weight in={w_in})"
    if min(g.stride + g.dilation) < 1 or min(g.pad) < 0:
        return f"{name}: stride/dilation < 1 or negative padding"
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = g.stride, g.dilation, g.pad
    want = ((g.h + pt + pb - dh * (g.kh - 1) - 1) // sh + 1, (g.w + pl + pr - dw * (g.kw - 1) - 1) // sw + 1)
    if want != (g.oh, g.ow) or min(want) < 1:
        return f"{name}: output {g.oh}x{g.ow} inconsistent with attributes (expected {want[0]}x{want[1]})"
    return None


def engine_plan(geo: ConvGeometry, dt: str) -> Plan | ChannelPlan | None:
    """The plan of the engine that runs ``geo`` on a constant weight, or None when
    another path runs it: the depthwise kernel, or for a pointwise one, the GEMM engine.
    Small maps with long reductions vectorize over output channels
    (:mod:`jitbyoc.engines.conv_channels`, planned by :mod:`~jitbyoc.engines.conv_channel_plan`) when
    that costs less."""
    if depthwise_llvm.fits(geo, dt) or geo.patches:
        return None
    channels = conv_channel_plan.choose(geo, dt)
    if channels is not None:
        return channels
    return None if geo.as_matmul else choose_plan(geo, dt)


def _build(fe, call, out):
    x, w = fe.buffer(call.args[0]), fe.buffer(call.args[1])
    geo = conv_geometry(call)
    plan = engine_plan(geo, x.dtype)
    if geo.as_matmul:  # a matrix product or channel vectors: a workspace to gather columns
        work = fe.temp((geo.n, geo.c * geo.taps, geo.oh, geo.ow), x.dtype) if geo.gathers else None
        return Conv2d((x, w), out, geo=geo, plan=plan, work=work)
    # the depthwise kernel has no plan; the engines pack into workspaces of each thread's own
    return Conv2d((x, w), out, geo=geo, plan=plan)


register("relax.nn.conv2d", 2, _check, anchor=True, composite="anchor")(_build)
register("relax.nn.conv1d", 2, _check, anchor=True)(_build)
