"""A convolution on AMX tiles as a product on its windows, gathered straight into the
product's B panels (implicit im2col).

On AMX tiles (:mod:`jitbyoc.engines.gemm_tiles`) a convolution with overlapping windows,
or a strided 1x1, runs as one matrix product on its windows
(:attr:`.conv2d.ConvGeometry.columns`): ``out (K x OH*OW) = W (K x KH*KW*C) @ cols``.
The product reads B in panels of ``NR`` columns whose rows are units of ``group`` k
interleaved (:class:`jitbyoc.engines.gemm.Panels`: bfloat16 pairs, int8 quads). Before,
the windows were gathered as a matrix (nine times a 3x3 conv's input) and the product
then packed that matrix into panels: two passes over it besides the product's own read.

Here k runs *tap-major*, ``k = (ky, kx, c)`` (the weight packed ``O, KH, KW, I`` at build
time, :func:`jitbyoc.tvm.conv_weights.tap_major_conv`), so a unit is ``group``
consecutive channels of one tap: every unit of a tap shares the tap's shift and its
zero-padding masks. Per output row, 16 pixels at a time (from a multiple of 16: half a
panel's row) and per tap, each unit's ``group`` channel rows are loaded as vectors (zero
where the window leaves the input), interleaved in registers and stored as one aligned
64-byte run of its panel row, masked where the output row starts or ends inside it. The
columns past the map in the last panel are zero.

A stem (a few channels, one or two units a tap, several taps: :func:`unit_planes`) has
its input packed once into *unit planes* first (:func:`pack_units`): each channel unit's
plane, zero-padded by the convolution's padding, a unit (a quad or pair of channels at a
pixel) one 32-bit element. A tap's 16 pixels of a unit are then one vector load (two and
a shuffle at stride 2) where they were ``group`` masked channel loads and their
interleave, 49 times over for a 7x7 window.

Where the product is split along its pixels (at least as many pixels as output channels)
each block of the product gathers its own ``KC x NC`` panels as it would pack them
(:class:`Windows`), in cache for the tiles that read them; split along the output
channels, every chunk would gather the same columns again, so they are gathered into
whole panels once first (:func:`gather`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from ..engines import conv_tiles, gemm_tiles
from ..engines.gemm import Operand, Panels, panel_width
from ..engines.products import PRODUCTS
from ..ir import kir
from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64
from ..render.loops import ceil_div, for_range, smax, smin, threaded
from ..render.vectors import concatenated, splat, strips, vload, vstore, vtype

PIXELS = 16  # pixels per vector: 16 units of 4 bytes, one 64-byte row of a tile
MAX_VECTOR_STRIDE = 4  # column strides read as one wide vector then a shuffle; larger: lane by lane


def tap_major(geo, weight_dtype: str) -> bool:
    """Whether ``geo`` runs gathered on tiles, its weight read tap-major: a product in
    units of several k on AMX tiles, windows gathered (overlapping, or a strided 1x1),
    one group."""
    group = PRODUCTS[weight_dtype].group if weight_dtype in PRODUCTS else 1
    return geo.gathers and not geo.patches and geo.tiles and group > 1 and geo.groups == 1


def direct(geo, weight_dtype: str) -> bool:
    """Whether ``geo`` runs tap-major on the direct tile engine
    (:mod:`jitbyoc.engines.conv_tiles`), which reads the input where it lies, not
    gathered into panels."""
    return tap_major(geo, weight_dtype) and conv_tiles.fits(geo, weight_dtype)


# the weight packed tile by tile, T[K/16, KH, KW, Cp/(16 units), 16, 16 units], as OIHW:
# reshape(permute_dims(T, TILE_AXES), (K, Cp, KH, KW))
TILE_AXES = (0, 4, 3, 5, 1, 2)


UNIT_SLACK = PIXELS * MAX_VECTOR_STRIDE  # units a strip's loads may read past the planes' end
# unit planes for at most this many units a tap (a stem's 3 channels: one int8 quad, two
# bfloat16 pairs): alone on the AMX Xeon, ResNet-50's 7x7/2 stem int8 281 -> 227 us, bf16
# 360 -> 280; but 3x3 convs of 64 channels on 56x56 90 -> 94, of 128 at stride 2 97 -> 103,
# of 256 at stride 2 level: many units a tap gather as fast from the channels themselves,
# and the planes are one more pass
UNIT_PLANE_UNITS = 2


def unit_planes(geo, weight_dtype: str) -> tuple | None:
    """``(units, height, width)`` of the zero-padded unit planes the gather reads
    (:func:`pack_units`) where they pay: a product in units of several channels, gathered
    (not on the direct engine), several taps, a column stride read as wide vectors; else
    None."""
    group = PRODUCTS[weight_dtype].group if weight_dtype in PRODUCTS else 1
    if not tap_major(geo, weight_dtype) or direct(geo, weight_dtype) or geo.taps == 1 \
            or geo.stride[1] > MAX_VECTOR_STRIDE or group == 1 or -(-geo.cg // group) > UNIT_PLANE_UNITS:
        return None
    return _planes(geo, group)


def _planes(geo, group: int) -> tuple:
    pt, pl, pb, pr = geo.pad
    return -(-geo.cg // group), geo.h + pt + pb, geo.w + pl + pr


def units_buffer(geo, weight_dtype: str, name: str) -> kir.Buffer | None:
    """The unit planes of every image (a batch may be symbolic), int32 elements (one unit
    each), each image's followed by slack."""
    planes = unit_planes(geo, weight_dtype)
    if planes is None:
        return None
    return kir.Buffer(name, (geo.n, _image_units(planes)), "int32")


def _image_units(planes: tuple) -> int:
    units, height, width = planes
    return units * height * width + UNIT_SLACK


def pack_units(stage, ctx) -> None:
    """Fill ``stage.units`` (:func:`unit_planes`): threads over (image, unit, padded row);
    a row inside the input interleaves its ``group`` channel rows, 16 pixels a vector
    (zero in the padding columns and for channels past the input's), a padding row is
    zeros."""
    g, x, units = stage.geo, stage.inputs[0], stage.units
    group = PRODUCTS[x.dtype].group
    planes = _planes(g, group)
    count, height, width = planes
    pt, pl = g.pad[0], g.pad[1]

    def rows(c, lo, hi, _extra=()):
        b = c.b
        with for_range(b, hi, "ur", start=lo) as at:
            plane, yp = b.sdiv(at, I64(height)), b.srem(at, I64(height))
            img, cu = b.sdiv(plane, I64(count)), b.srem(plane, I64(count))
            y = b.sub(yp, I64(pt))
            inside = b.and_(b.icmp_signed(">=", y, I64(0)), b.icmp_signed("<", y, I64(g.h)))
            row = _input_row(b, g, img, y)
            to = b.add(b.mul(img, I64(_image_units(planes))),
                       b.mul(b.add(b.mul(cu, I64(height)), yp), I64(width)))

            def strip(col, mask):  # units col .. col + 16 of the padded row
                first = b.sub(I64(pl), col)
                past = b.select(inside, b.sub(I64(pl + g.w), col), I64(-1))
                live = _between(b, first, past, PIXELS)
                start = b.add(row, b.sub(col, I64(pl)))
                loads = []
                for e in range(group):
                    channel = b.add(b.mul(cu, I64(group)), I64(e))
                    real = splat(b, b.icmp_signed("<", channel, I64(g.cg)), PIXELS)
                    loads.append(vload(b, _at(c, x, b.add(start, b.mul(channel, I64(g.h * g.w)))), x.dtype,
                                       b.and_(live, real), PIXELS))
                value = b.bitcast(_interleave(b, loads), vtype("int32", PIXELS))
                vstore(b, value, _at(c, units, b.add(to, col)), "int32", mask)
            strips(b, I64(0), I64(width), PIXELS, strip)

    n = ctx.product((g.n, count * height))
    if threaded((g.n, count * height, width, group), "elementwise"):  # an interleave, not a copy
        ctx.parallel_for(n, rows)
    else:
        rows(ctx, I64(0), n)


def tile_shape(geo, weight_dtype: str) -> tuple:
    """The shape of the weight packed tile by tile (:func:`tile_packed`)."""
    c = gemm_tiles.TILE_BYTES // lookup_dtype(weight_dtype).nbytes
    return (geo.k // 16, geo.kh, geo.kw, channels(geo, weight_dtype) // c, 16, c)


def tile_packed(taps: np.ndarray) -> np.ndarray:
    """The weight packed tap-major ``(K, KH, KW, Cp)`` as the direct tile engine reads it:
    ``(K/16, KH, KW, Cp/c, 16, c)`` with ``c`` the channels of 16 units, each tile of A
    (16 output channels x 16 units of one tap) 1 KB in one piece. A view: the constant
    made of it is its one copy."""
    k, kh, kw, cp = taps.shape
    c = gemm_tiles.TILE_BYTES // taps.dtype.itemsize
    return taps.reshape(k // 16, 16, kh, kw, cp // c, c).transpose(0, 2, 3, 4, 1, 5)


def channels(geo, weight_dtype: str) -> int:
    """The input channels of each tap in k: whole units, the ones past ``geo.cg`` zero (a
    stem's 3 channels as 4: the weight packed with zero channels, the gather's loads of
    them masked off); on the direct engine, whole blocks of 16 units."""
    group = PRODUCTS[weight_dtype].group
    if direct(geo, weight_dtype):
        return conv_tiles.units(geo, weight_dtype) * group
    return -(-geo.cg // group) * group


def whole(geo) -> bool:
    """Whether the panels are gathered whole before the product (it is split along its
    output channels: more of them than pixels), else block by block inside it."""
    return geo.kg > geo.oh * geo.ow


def shape(geo, weight_dtype: str) -> tuple:
    """The whole panels' buffer: ``(N, panels, units, NR, group)``."""
    group, width = PRODUCTS[weight_dtype].group, panel_width(weight_dtype)
    return (geo.n, -(-(geo.oh * geo.ow) // width), channels(geo, weight_dtype) * geo.taps // group, width, group)


def operand(work: kir.Buffer, batch: tuple) -> Panels:
    """The product's B: ``work`` read as panels (``batch``: one image's stride, or none)."""
    _, count, units, width, group = work.shape
    return Panels(work, (count * units * width * group,) if batch else (), units * group, width, group)


def gather(stage, ctx) -> None:
    """Fill ``stage.work`` (:func:`shape`), threads over (image, output row)."""
    g, work = stage.geo, stage.work
    _, count, units, width, group = work.shape
    image = count * units * width * group

    def rows(c, lo, hi, _extra=()):
        b = c.b

        def pointer(offset):
            return _at(c, work, offset)

        with for_range(b, hi, "po", start=lo) as at:
            img, oy = b.sdiv(at, I64(g.oh)), b.srem(at, I64(g.oh))
            base = b.mul(img, I64(image))
            window = (b.mul(oy, I64(g.ow)), b.mul(b.add(oy, I64(1)), I64(g.ow)))
            _gather(g, c, stage.inputs[0], img, (window, (I64(0), I64(units))),
                    _placer(b, base, (I64(0), I64(0)), I64(units), width, group), pointer, width, stage.units)
            if (g.oh * g.ow) % width:
                with b.if_then(b.icmp_signed("==", oy, I64(g.oh - 1))):
                    last = b.add(base, I64((count - 1) * units * width * group))
                    _zero_columns(c, work.dtype, pointer, last, I64(units), I64((g.oh * g.ow) % width), width, group)

    n = ctx.product((g.n, g.oh))
    if threaded(work.shape, "copy"):
        ctx.parallel_for(n, rows)
    else:
        rows(ctx, I64(0), n)


@dataclass(frozen=True)
class Windows(Operand):
    """B of a tap-major convolution's product read through its windows: ``X(b, pixel, k)
    = x[b, c, oy*sh + ky*dh - pt, ox*sw + kx*dw - pl]`` (k = (ky, kx, c), pixel = (oy,
    ox); zero outside), gathered into the product's panels as it packs them
    (:meth:`pack_panels_llvm`, the only way the GEMM driver reads it): no gathered
    matrix."""
    buf: kir.Buffer
    geo: object
    units: kir.Buffer = None  # the input's unit planes (pack_units), where it has them

    @property
    def dtype(self) -> str:
        return self.buf.dtype

    def pack_panels_llvm(self, g, c, dst, bidx, x0, nx, k0, kc, width: int) -> None:
        """Columns ``x0 .. x0 + nx`` (``x0`` a whole number of panels in) and units ``k0 ..
        k0 + kc`` as panels of ``width`` at ``dst``, zero past ``nx``."""
        b, group = c.b, g.product.group
        etype = lookup_dtype(self.buf.dtype).storage_ir

        def pointer(offset):  # no inbounds: see _at
            return b.gep(dst, [offset], source_etype=etype)

        _gather(self.geo, c, self.buf, bidx[0] if bidx else I64(0), ((x0, b.add(x0, nx)), (k0, b.add(k0, kc))),
                _placer(b, I64(0), (x0, k0), kc, width, group), pointer, width, self.units)
        rest = b.srem(nx, I64(width))
        with b.if_then(b.icmp_signed(">", rest, I64(0))):
            last = b.mul(b.sdiv(nx, I64(width)), b.mul(kc, I64(width * group)))
            _zero_columns(c, self.buf.dtype, pointer, last, kc, rest, width, group)


def _gather(g, c, x, img, window, place, pointer, width: int, units=None) -> None:
    """Pixels ``[p0, p1)`` and units ``[u0, u1)`` (``window``) of image ``img``'s gathered
    columns, unit ``u`` of pixel ``p`` stored at ``pointer(place(p, u))``: per output row
    the window crosses, per tap, every unit of the tap in the range, in strips of the 16
    pixels from a multiple of 16 (half a panel's row: one aligned 64-byte store, masked
    where the row starts or ends inside it). Strips that followed the rows from their
    first pixel crossed panels and wrote parts of two lines: on 56x56, 30 % of a
    gather's samples sat on its stores."""
    b, group = c.b, PRODUCTS[x.dtype].group
    (p0, p1), (u0, u1) = window
    per_tap = -(-g.cg // group)
    with for_range(b, b.add(b.sub(b.sdiv(b.sub(p1, I64(1)), I64(g.ow)), b.sdiv(p0, I64(g.ow))), I64(1)), "gy") as r:
        oy = b.add(b.sdiv(p0, I64(g.ow)), r)
        row0 = b.mul(oy, I64(g.ow))
        first, past = smax(b, p0, row0), smin(b, p1, b.add(row0, I64(g.ow)))  # the row's pixels in the window
        aligned = b.sub(first, b.srem(first, I64(PIXELS)))
        chunks = b.select(b.icmp_signed(">", past, first), ceil_div(b, b.sub(past, aligned), I64(PIXELS)), I64(0))
        with for_range(b, chunks, "gs") as strip:
            chunk = b.add(aligned, b.mul(strip, I64(PIXELS)))  # a whole 16 pixels in: one panel's half-row
            lanes = [b.mul(b.sub(v, chunk), I64(group))
                     for v in (smax(b, first, chunk), smin(b, past, b.add(chunk, I64(PIXELS))))]
            mask = _between(b, *lanes, PIXELS * group)  # the lanes of the row's pixels
            with for_range(b, b.add(b.sub(b.sdiv(b.sub(u1, I64(1)), I64(per_tap)), b.sdiv(u0, I64(per_tap))),
                                    I64(1)), "gt") as t:
                tap = b.add(b.sdiv(u0, I64(per_tap)), t)
                value = _unit_values(g, c, x, units, img, tap, oy, b.sub(chunk, row0))
                start = smax(b, u0, b.mul(tap, I64(per_tap)))
                with for_range(b, b.sub(smin(b, u1, b.mul(b.add(tap, I64(1)), I64(per_tap))), start), "gu") as i:
                    u = b.add(start, i)
                    unit = value(b.sub(u, b.mul(tap, I64(per_tap))))  # the tap's channel unit
                    vstore(b, unit, pointer(place(chunk, u)), x.dtype, mask)


def _unit_values(g, c, x, units, img, tap, oy, ox0):
    """``value(cu)``: channel unit ``cu``'s 16 pixels of the tap, one 64-byte run: from the
    unit planes where the conv has them (:func:`_unit_loader`), else its ``group`` channel
    rows loaded (:func:`_tap_loader`) and interleaved."""
    if units is not None:
        return _unit_loader(g, c, units, x.dtype, img, tap, oy, ox0)
    b, group = c.b, PRODUCTS[x.dtype].group
    load = _tap_loader(g, c, x, img, tap, oy, ox0)
    return lambda cu: _interleave(b, [load(b.add(b.mul(cu, I64(group)), I64(e))) for e in range(group)])


def _placer(b, base, origin, height, width: int, group: int):
    """``place(pixel, u)``: the element of unit ``u`` of column ``pixel`` in panels of
    ``height`` unit rows from ``base``, whose first column and unit are ``origin``."""
    x0, k0 = origin

    def place(pixel, u):
        rel = b.sub(pixel, x0)
        row = b.add(b.mul(b.sdiv(rel, I64(width)), height), b.sub(u, k0))  # the panel's, then the unit's
        return b.add(base, b.mul(b.add(b.mul(row, I64(width)), b.srem(rel, I64(width))), I64(group)))
    return place


def _tap_loader(g, c, x, img, tap, oy, ox0):
    """``load(channel)``: the 16 pixels of output row ``oy`` from column ``ox0`` that the
    tap ``tap`` reads in ``channel`` of image ``img`` (zero outside the input); the
    shift and masks are the tap's, computed once."""
    b = c.b
    (sh, sw), (dh, dw), (pt, pl, _, _) = g.stride, g.dilation, g.pad
    ky, kx = b.sdiv(tap, I64(g.kw)), b.srem(tap, I64(g.kw))
    iy = b.sub(b.add(b.mul(oy, I64(sh)), b.mul(ky, I64(dh))), I64(pt))
    live = b.and_(b.icmp_signed(">=", iy, I64(0)), b.icmp_signed("<", iy, I64(g.h)))
    start = b.add(b.sub(b.mul(kx, I64(dw)), I64(pl)), b.mul(ox0, I64(sw)))  # column of lane 0
    row = b.add(_input_row(b, g, img, iy), start)
    first, past = b.neg(start), b.select(live, b.sub(I64(g.w), start), I64(-1))  # the lanes' valid columns
    dt, n = x.dtype, PIXELS
    plane, padded = g.h * g.w, g.cg % PRODUCTS[x.dtype].group != 0

    def real(channel):  # a padding channel (see channels) reads nothing
        return b.icmp_signed("<", channel, I64(g.cg))

    if sw <= MAX_VECTOR_STRIDE:
        mask = _between(b, first, past, n * sw)

        def load(channel):
            where = b.and_(mask, splat(b, real(channel), n * sw)) if padded else mask
            wide = vload(b, _at(c, x, b.add(row, b.mul(channel, I64(plane)))), dt, where, n * sw)
            if sw == 1:
                return wide
            return b.shuffle_vector(wide, ir.Constant(wide.type, None),
                                    ir.Constant(ir.VectorType(I32, n), [lane * sw for lane in range(n)]))
        return load

    def load_lanes(channel):  # one element a lane
        vector, at = ir.Constant(vtype(dt, n), None), b.add(row, b.mul(channel, I64(plane)))
        for lane in range(n):
            col = I64(lane * sw)
            ok = b.and_(real(channel), b.and_(b.icmp_signed(">=", col, first), b.icmp_signed("<", col, past)))
            value = c.load(x, b.select(ok, b.add(at, col), I64(0)))
            vector = b.insert_element(vector, b.select(ok, value, ir.Constant(value.type, None)), I32(lane))
        return vector
    return load_lanes


def _input_row(b, g, img, y):
    """The element of image ``img``'s channel 0 where its input row ``y`` starts (``y``
    clamped into the input: a row outside it is masked off by the caller)."""
    return b.mul(b.add(b.mul(img, I64(g.c * g.h)), smax(b, smin(b, y, I64(g.h - 1)), I64(0))), I64(g.w))


def _unit_loader(g, c, units, dt: str, img, tap, oy, ox0):
    """``load(cu)``: the 16 pixels of output row ``oy`` from column ``ox0`` that the tap
    ``tap`` reads in channel unit ``cu``, from the zero-padded unit planes (:func:`pack_units`)
    as ``16 * group`` elements of ``dt``: one wide load, every ``sw``-th unit of it."""
    b = c.b
    (sh, sw), (dh, dw) = g.stride, g.dilation
    planes = _planes(g, PRODUCTS[dt].group)
    _, height, width = planes
    ky, kx = b.sdiv(tap, I64(g.kw)), b.srem(tap, I64(g.kw))
    iy = b.add(b.mul(oy, I64(sh)), b.mul(ky, I64(dh)))
    ix = b.add(b.mul(ox0, I64(sw)), b.mul(kx, I64(dw)))
    row = b.add(b.add(b.mul(img, I64(_image_units(planes))), b.mul(iy, I64(width))), ix)
    n, plane = PIXELS, height * width

    def load(cu):
        wide = vload(b, _at(c, units, b.add(row, b.mul(cu, I64(plane)))), "int32", None, n * sw)
        if sw > 1:
            wide = b.shuffle_vector(wide, ir.Constant(wide.type, None),
                                    ir.Constant(ir.VectorType(I32, n), [lane * sw for lane in range(n)]))
        return b.bitcast(wide, vtype(dt, n * PRODUCTS[dt].group))
    return load


def _interleave(b, vectors: list) -> ir.Value:
    """``out[l * group + e] = vectors[e][l]``: the units of 16 pixels, one 64-byte run."""
    group, n = len(vectors), PIXELS
    halves = [concatenated(b, vectors[:group // 2]), concatenated(b, vectors[group // 2:])]  # int8 quads: pairs
    order = [(r % group) * n + r // group for r in range(n * group)]
    return b.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, n * group), order))


def _zero_columns(c, dt: str, pointer, start, units, rest, width: int, group: int) -> None:
    """Zero columns ``rest ..`` of the panel at element ``start`` in each of its
    ``units`` rows."""
    b, n = c.b, PIXELS * group
    zero = ir.Constant(vtype(dt, n), None)
    with for_range(b, units, "gz") as u:
        row = b.add(start, b.mul(b.add(b.mul(u, I64(width)), rest), I64(group)))
        strips(b, I64(0), b.mul(b.sub(I64(width), rest), I64(group)), n,
               lambda j, mask: vstore(b, zero, pointer(b.add(row, j)), dt, mask))


def _between(b, lo, hi, n: int) -> ir.Value:
    """``<n x i1>``: lane ``l`` set when ``lo <= l < hi`` (i64 values)."""
    iota = ir.Constant(ir.VectorType(I32, n), list(range(n)))
    lo32, hi32 = (b.trunc(smax(b, smin(b, v, I64(n)), I64(0)), I32) for v in (lo, hi))
    return b.and_(b.icmp_signed(">=", iota, splat(b, lo32, n)), b.icmp_signed("<", iota, splat(b, hi32, n)))


def _at(c, buf: kir.Buffer, offset) -> ir.Value:
    """Pointer to element ``offset`` of ``buf`` without ``inbounds``: a masked access may
    start before the row it reads (its unset lanes touch no memory)."""
    return c.b.gep(c.ptrs[buf.storage], [offset], source_etype=lookup_dtype(buf.dtype).storage_ir)
