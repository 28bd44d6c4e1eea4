"""LLVM rendering of a depthwise :class:`~jitbyoc.kernels.conv2d.Conv2d` (groups = input
channels = output channels: MobileNet, EfficientNet, ShuffleNet, ConvNeXt).

Each output channel reads one input plane and ``KH x KW`` weights, so there is no
channel reuse to block registers over, and the general engine's packed, zero-padded
workspace costs more than the arithmetic. Here a task takes whole (image, channel)
planes and computes each output row one vector of ``lanes`` columns at a time (row by
row up to :data:`ROW_MAJOR_TAPS` taps, else column block by column block), straight
from the input: per tap one masked load (stride 1) or one wider masked load whose every
``stride``-th lane is kept (stride 2 to :data:`MAX_STRIDE`), and one fused multiply-add
with the tap's weight, splatted once per plane. Which lanes of a tap fall inside the
input's columns depends only on the column block and the tap, all static, so those masks
are constants; a tap row above or below the input masks every lane (no memory is
touched). The epilogue runs on each finished plane while it is in cache.

Accumulation: per output, the taps in row-major order with fused multiply-adds, taps
outside the input skipped (TVM adds their ``0 * w``: the same value), as
:mod:`jitbyoc.kernels.conv2d` documents for the general engine.

Byte inputs (a quantized model's uint8 or int8 activations and weights, summed in int32)
run the same loop in float32: each byte converted as it is loaded, each weight once per
plane, the sum converted to int32 at the end. Every product and partial sum is an integer
below ``2**24`` in size while ``taps * 255 * 128 < 2**24`` (kernels up to 22 x 22), so
float32 holds them exactly and the int32 result is the integer convolution's. The
general engine ran these as ``vpdpbusd`` products over one channel (a quarter of each
instruction used, the rest padding): MobileNetV2's ten depthwise layers took half of its
int8 run.
"""

from __future__ import annotations

from llvmlite import ir

from ..engines.products import UNIFORM
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I1, I32, I64
from ..ir.ops import op_def
from ..render.loops import for_range, threaded
from ..render.vectors import VectorLiteral, lanes, multiply_add, splat, vload, vstore, vtype

MAX_STRIDE = 4  # a wider load per tap costs stride registers' worth of loads
BYTES = ("uint8", "int8")
EXACT = 2 ** 24  # float32 holds every integer below it


def fits(geo, dt: str) -> bool:
    """Whether :func:`emit` takes this convolution: depthwise with one filter per
    channel, a float dtype or bytes whose sums float32 holds exactly, a column stride it
    can load as a vector."""
    exact = dt in UNIFORM or (dt in BYTES and geo.taps * 255 * 128 < EXACT)
    return geo.groups == geo.c == geo.k and geo.cg == 1 and exact and 1 <= geo.stride[1] <= MAX_STRIDE


def _sums_dtype(stage) -> str:
    """What the loop computes in: the output's dtype, or float32 for bytes (exact)."""
    return "float32" if stage.inputs[0].dtype in BYTES else stage.out.dtype


def _cast(b, v, dt: str, to: str):
    """``v`` (of ``dt``, a scalar or a vector) as ``to``: the ``astype`` rule's cast (a
    no-op where the dtypes are the same)."""
    lanes_of_v = v.type.count if isinstance(v.type, ir.VectorType) else 1
    return op_def("astype").llvm(b, lookup_dtype(dt).with_lanes(lanes_of_v), v, to=to)


def _column_masks(geo, n: int, ow0: int) -> list[list[bool] | None]:
    """Per kernel column j: which of the ``n * stride`` loaded lanes to keep for the output
    block starting at column ``ow0`` (lane ``q`` holds input column ``base + q``; output
    lane ``l`` takes lane ``l * stride``), or None when no lane is inside the input."""
    sw, dw, pl = geo.stride[1], geo.dilation[1], geo.pad[1]
    out = []
    for j in range(geo.kw):
        keep = [False] * (n * sw)
        for l in range(min(n, geo.ow - ow0)):
            col = (ow0 + l) * sw + j * dw - pl
            keep[l * sw] = 0 <= col < geo.w
        out.append(keep if any(keep) else None)
    return out


def _tap(c, stage, n: int, row_ptr, offset: int, keep: list[bool], row_valid):
    """The ``n`` input values of one tap for one output block: a masked load of
    ``n * stride`` columns from ``row_ptr + offset``, every ``stride``-th lane kept."""
    b, dt = c.b, stage.inputs[0].dtype
    sw = stage.geo.stride[1]
    mask = b.and_(ir.Constant(ir.VectorType(I1, n * sw), keep), splat(b, row_valid, n * sw))
    # not inbounds: at the image's edge the block starts left of the row (those lanes are masked)
    ptr = b.gep(row_ptr, [I64(offset)], source_etype=lookup_dtype(dt).ir)
    wide = vload(b, ptr, dt, mask, n * sw)
    if sw > 1:
        picks = ir.Constant(ir.VectorType(I32, n), [l * sw for l in range(n)])
        wide = b.shuffle_vector(wide, VectorLiteral(wide.type, "poison"), picks)
    return _cast(b, wide, dt, _sums_dtype(stage))


def _row(c, stage, n, src, ow0, masks, weights, oh):
    """One output block: row ``oh``, columns ``ow0 .. ow0 + n``; returns the sums."""
    b, g = c.b, stage.geo
    vt = vtype(_sums_dtype(stage), n)
    x = stage.inputs[0]
    (sh, sw), (dh, dw), (pt, pl, _, _) = g.stride, g.dilation, g.pad
    acc = VectorLiteral(vt, "zeroinitializer")
    for i in range(g.kh):
        ih = b.add(b.mul(oh, I64(sh)), I64(i * dh - pt))
        inside = b.and_(b.icmp_signed(">=", ih, I64(0)), b.icmp_signed("<", ih, I64(g.h)))
        row_ptr = c.b.gep(c.ptrs[x.storage], [b.add(src, b.mul(ih, I64(g.w)))],
                          source_etype=lookup_dtype(x.dtype).ir)
        for j, keep in enumerate(masks):
            if keep is not None:
                v = _tap(c, stage, n, row_ptr, ow0 * sw + j * dw - pl, keep, inside)
                acc = multiply_add(b, v, weights[i * g.kw + j], acc)
    return acc


def _block(c, stage, n, src, dst, ow0, weights, oh) -> None:
    """Output row ``oh``, columns ``ow0 .. ow0 + n`` of the plane at ``src``/``dst``:
    computed and stored."""
    b, g, dt = c.b, stage.geo, stage.out.dtype
    masks = _column_masks(g, n, ow0)
    store_mask = None if ow0 + n <= g.ow else \
        ir.Constant(ir.VectorType(I1, n), [ow0 + l < g.ow for l in range(n)])
    sums = _row(c, stage, n, src, ow0, masks, weights, oh)
    acc = _cast(b, sums, _sums_dtype(stage), dt)  # exact (module doc)
    at = b.add(dst, b.add(b.mul(oh, I64(g.ow)), I64(ow0)))
    vstore(b, acc, c.element(stage.out, at), dt, store_mask)


# Windows of up to this many taps compute a plane row by row, every column block of a row
# before the next row: each input row is read while in cache. Larger windows go column
# block by column block down the plane (their weights take the registers). MobileNetV2 at
# 0.97-0.98x the time (both builds in one process, in turns; a stride-2 96-channel 112x112
# layer alone 0.91x, a 144-channel 56x56 one 0.73x); EfficientNet-B0 with its 5x5 layers
# row by row too 1.04x, with them column by column 0.99x (Zen 5).
ROW_MAJOR_TAPS = 9


def _planes(stage, c, lo, hi) -> None:
    b, g, sums = c.b, stage.geo, _sums_dtype(stage)
    w, out = stage.inputs[1], stage.out
    n = lanes(sums)
    while n // 2 >= g.ow and n > 4:  # a 7-wide map fills 7 of 8 lanes, not 7 of 16
        n //= 2
    with for_range(b, hi, "pl", start=lo) as pl:
        ch = b.srem(pl, I64(g.c))
        src, dst = b.mul(pl, I64(g.h * g.w)), b.mul(pl, I64(g.oh * g.ow))
        weights = [splat(b, _cast(b, c.load(w, b.add(b.mul(ch, I64(g.taps)), I64(t))), w.dtype, sums), n)
                   for t in range(g.taps)]
        if g.taps <= ROW_MAJOR_TAPS:
            with for_range(b, I64(g.oh), "oh") as oh:
                for ow0 in range(0, g.ow, n):
                    _block(c, stage, n, src, dst, ow0, weights, oh)
        else:
            for ow0 in range(0, g.ow, n):
                with for_range(b, I64(g.oh), "oh") as oh:
                    _block(c, stage, n, src, dst, ow0, weights, oh)
        if stage.epilogue is not None:
            c.epilogue(stage, [b.sdiv(pl, I64(g.c)), ch] + [I64(0)] * (out.ndim - 2),
                       [1, 1] + list(out.shape[2:]))


def emit(stage, ctx) -> None:
    """The convolution at ``ctx``'s insertion point, planes split across the thread pool
    when there is enough work."""
    g = stage.geo
    planes = ctx.product((g.n, g.c))
    if threaded(stage.out.shape, "stage"):
        ctx.parallel_for(planes, lambda c, lo, hi, _: _planes(stage, c, lo, hi))
    else:
        _planes(stage, ctx, ir.Constant(I64, 0), planes)
