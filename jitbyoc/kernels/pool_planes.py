"""The planes of :class:`~jitbyoc.kernels.pool2d.Pool2d`, written once against the
portable facade (:mod:`jitbyoc.render.portable`): one (image, channel) plane per task
step; see the module docstring of :mod:`jitbyoc.kernels.pool2d`. In C every vector is
one element wide, so the column vectors of float pools are single output columns."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..ir.dtypes import dtype as lookup_dtype
from ..render.indexing import unravel
from ..render.loops import threaded

MAX_VECTOR_STRIDE = 4  # column strides whose rows take explicit vectors (a load spans stride x lanes)
MIN_TASKS = 8  # (plane, row band) tasks at least, where there are fewer planes
MAX_FLAT_LOADS = 160  # unrolled tap loads of a whole plane in :func:`_flat_planes`


def lowest(dt) -> float | int:
    """What a max pool starts from and pads with, as TVM's: the dtype's lowest finite value."""
    d = np.dtype(str(dt))
    return float(np.finfo(d).min) if d.kind == "f" else int(np.iinfo(d).min)


def _widened(stage, e, v, width: int | None = None):
    """A value loaded from the input as the pool's dtype: a bfloat16 input (a bfloat16
    pool pools in float32: :func:`jitbyoc.kernels.pool2d._builder`) widened to float32,
    exactly; anything else as it is."""
    src, dt = stage.inputs[0].dtype, stage.out.dtype
    if src == dt:
        return v
    return e.op("astype", src, v, to=dt) if width is None else e.vop(width, "astype", src, v, to=dt)


def emit_pool(stage, e) -> None:
    if stage.row.adaptive:
        body, bands = _adaptive_planes, 1
    elif runs_flat(stage, e.lanes(stage.out.dtype)):
        body, bands = _flat_planes, 1
    else:
        body = _vector_planes if _vectors(stage) and stage.stride[1] <= MAX_VECTOR_STRIDE else _window_planes
        bands = row_bands(stage)
    e.parallel(e.mul(e.product(stage.planes), bands), lambda e, lo, hi: body(stage, e, lo, hi),
               threaded(stage.out.shape, "pool"))


def row_bands(stage) -> int:
    """Bands of output rows each plane is split into, the tasks being (plane, band): one,
    unless there are fewer than :data:`MIN_TASKS` planes (counting a symbolic batch as
    one image). ONNX's LRN is an average over channels, viewed as one plane of C rows of
    H*W columns: Inception v1's over 192 x 55 x 55 ran on one thread."""
    planes = 1
    for d in stage.planes:
        planes *= d if isinstance(d, int) else 1
    return 1 if planes >= MIN_TASKS else min(stage.out.shape[2], -(-MIN_TASKS // planes))


@contextmanager
def _units(stage, e, lo, hi):
    """The tasks ``lo .. hi`` of :func:`row_bands`' split, as ``(plane, first row, end
    row)`` in a loop."""
    bands, oh_n = row_bands(stage), stage.out.shape[2]
    with e.loop(hi, lo, "pl") as unit:
        if bands == 1:
            yield unit, 0, oh_n
            return
        rows = -(-oh_n // bands)
        pl = e.let(e.div(unit, bands))
        r0 = e.let(e.mul(e.sub(unit, e.mul(pl, bands)), rows))
        yield pl, r0, e.let(e.min(e.add(r0, rows), oh_n))


def _vectors(stage) -> bool:
    """Whether windows combine per vector of output columns: float pools, and max pools
    of integers (a quantized graph's uint8 maps: no division)."""
    dt = lookup_dtype(stage.out.dtype)
    return dt.is_float or (dt.is_int and not stage.row.average)


def _kernel_rows(stage, e, hs):
    """Kernel rows [lo, hi) whose input row ``hs + kh * dh`` lies inside the input."""
    h, dh, kh = stage.inputs[0].shape[2], stage.dilation[0], stage.size[0]
    lo = e.let(e.max(e.div(e.sub(dh - 1, hs), dh), 0))
    below = e.let(e.sub(h - 1, hs))  # negative: the window starts under the input
    hi = e.let(e.select(e.lt(below, 0), e.i(0), e.add(e.div(below, dh), 1)))
    return lo, e.let(e.min(hi, kh))


def _identity(stage) -> float | int:
    """What a window starts from and what taps outside the input count as."""
    return 0 if stage.row.average else lowest(stage.out.dtype)


def _combine_op(stage) -> str:
    return "add" if stage.row.average else "maximum"


def _input_row(stage, e, src, hs, kh):
    """Offset of the input row kernel row ``kh`` reads for the output row whose window
    starts at input row ``hs``, in the plane at ``src``."""
    w = stage.inputs[0].shape[3]
    return e.let(e.add(src, e.mul(e.add(hs, e.mul(kh, stage.dilation[0])), w)))


def _window_planes(stage, e, lo, hi) -> None:
    """Integer pools and column strides above MAX_VECTOR_STRIDE: whole output rows
    combined in memory, tap by tap (see :func:`_vector_planes` for the rest)."""
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    init = e.const(_identity(stage), dt)
    with _units(stage, e, lo, hi) as (pl, r0, r1):
        src, dst = e.let(e.mul(pl, h * w)), e.let(e.mul(pl, oh_n * ow_n))
        with e.loop(r1, r0, "oh") as oh:
            row = e.let(e.add(dst, e.mul(oh, ow_n)))
            with e.loop(ow_n, 0, "ow") as ow:
                e.store(out, e.add(row, ow), init)
            hs = e.let(e.sub(e.mul(oh, stage.stride[0]), stage.pad[0]))
            k0, k1 = _kernel_rows(stage, e, hs)
            with e.loop(k1, k0, "kh") as kh:
                xrow = _input_row(stage, e, src, hs, kh)
                for kw in range(stage.size[1]):
                    _combine_row(stage, e, row, xrow, kw)
            if stage.row.average:
                ch = e.let(stage.counts(0, oh, e))
                with e.loop(ow_n, 0, "ow") as ow:
                    cnt = e.max(e.mul(ch, stage.counts(1, ow, e)), 1)
                    at = e.let(e.add(row, ow))
                    e.store(out, at, e.op("divide", dt, e.load(out, at), e.as_float(cnt, dt)))
        _plane_epilogue(stage, e, pl, r0, r1)


def _combine_row(stage, e, row, xrow, kw: int) -> None:
    """out[row + ow] op= x[xrow + ow * sw + kw * dw - pl] over the columns inside the input."""
    (x,), out = stage.inputs, stage.out
    c0, c1 = stage.col_range(kw)
    if c0 >= c1:
        return
    base = e.add(xrow, kw * stage.dilation[1] - stage.pad[1])
    with e.loop(c1, c0, "ow") as ow:
        v = _widened(stage, e, e.load(x, e.add(base, e.mul(ow, stage.stride[1]))))
        at = e.let(e.add(row, ow))
        e.store(out, at, e.op(_combine_op(stage), out.dtype, e.load(out, at), v))


def _vector_planes(stage, e, lo, hi) -> None:
    """Float pools with column stride <= MAX_VECTOR_STRIDE: per output row and vector of
    columns, the window is combined in a register (kernel rows, then columns: TVM's
    order), lanes whose tap lies outside the input masked to the identity, then divided
    (averages) and stored once. Combining whole rows in memory, one shifted tap at a
    time, reloaded each partial sum just after a store overlapping it: a failed store
    forward per tap (a 3x3 average over 256x28x28 ran at ~1 ns per output).

    Edge vectors are unrolled, each with its own masks and counts; a long run of interior
    vectors (every tap inside the input) is one loop. Unrolled, ONNX's LRN (an average
    over 5 channels of 109x109 maps: rows of 11881 columns) was 90,000 instructions and
    seconds of build."""
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    width = e.lanes(dt)
    head, run, tail = _column_runs(stage, width)
    acc = e.vvar(dt, width)
    with _units(stage, e, lo, hi) as (pl, r0, r1):
        src, dst = e.let(e.mul(pl, h * w)), e.let(e.mul(pl, oh_n * ow_n))
        with e.loop(r1, r0, "oh") as oh:
            hs = e.let(e.sub(e.mul(oh, stage.stride[0]), stage.pad[0]))
            window = (src, hs, _kernel_rows(stage, e, hs), e.let(e.add(dst, e.mul(oh, ow_n))),
                      e.let(stage.counts(0, oh, e)) if stage.row.average else None)
            for start in head:
                _column_vector(stage, e, acc, window, start)
            if run:
                with e.loop(run[1], run[0], "q") as q:
                    _column_vector(stage, e, acc, window, e.mul(q, width))
            for start in tail:
                _column_vector(stage, e, acc, window, start)
        _plane_epilogue(stage, e, pl, r0, r1)


def runs_flat(stage, width: int) -> bool:
    """Whether a max pool runs by :func:`_flat_planes` on vectors of ``width`` lanes:
    stride 1, output rows as wide as the input's, at least two rows a vector (uint8 maps
    of 13-28 columns on 64 lanes; never in C, one lane wide), whole planes a task, and at
    most :data:`MAX_FLAT_LOADS` taps to unroll."""
    (x,), out = stage.inputs, stage.out
    w = x.shape[3]
    if (stage.row.average or not _vectors(stage) or tuple(stage.stride) != (1, 1) or out.shape[3] != w
            or 2 * w > width or row_bands(stage) != 1):
        return False
    return -(-out.shape[2] * w // width) * stage.size[0] * stage.size[1] <= MAX_FLAT_LOADS


def _flat_planes(stage, e, lo, hi) -> None:
    """Max pools of :func:`runs_flat`: each plane as one flat run of elements, a vector of
    several output rows at a time. With stride 1 and rows of equal width, the tap
    ``(kh, kw)`` of output element ``p`` is input element ``p + (kh*dh - ph) * w + kw*dw
    - pw``: one load per vector and tap, under a constant mask of the lanes whose tap lies
    inside the input (in row and column). A 13-wide row on 64 lanes had a vector of its
    own, a fifth of it used."""
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    size, width = stage.out.shape[2] * w, e.lanes(dt)
    with e.loop(hi, lo, "pl") as pl:
        src, dst = e.let(e.mul(pl, h * w)), e.let(e.mul(pl, size))
        for start in range(0, size, width):
            v = e.vconst(_identity(stage), dt, width)
            for kh in range(stage.size[0]):
                for kw in range(stage.size[1]):
                    rows = kh * stage.dilation[0] - stage.pad[0]
                    cols = kw * stage.dilation[1] - stage.pad[1]
                    inside = [p < size and 0 <= p // w + rows < h and 0 <= p % w + cols < w
                              for p in range(start, start + width)]
                    if any(inside):
                        t = e.vload(e.pointer(x), e.add(src, start + rows * w + cols), x.dtype, width,
                                    e.lanes_where(inside), _identity(stage))
                        t = _widened(stage, e, t, width)
                        v = e.vop(width, "maximum", dt, v, t)
            e.vstore(out, e.add(dst, start), v, dt, e.lanes_where([p < size for p in range(start, start + width)]))
        _plane_epilogue(stage, e, pl)


def _column_runs(stage, width: int) -> tuple[list[int], tuple[int, int] | None, list[int]]:
    """Output column vectors as (unrolled starts before, ``[q0, q1)`` vector indices of an
    interior run taken by a loop, unrolled starts after). A run is only made when it is
    longer than a few vectors; short rows stay fully unrolled."""
    ow_n = stage.out.shape[3]
    starts = list(range(0, ow_n, width))
    ranges = [stage.col_range(kw) for kw in range(stage.size[1])]
    inner = [q for q, s in enumerate(starts)
             if s + width <= ow_n and all(c0 <= s and s + width <= c1 for c0, c1 in ranges)]
    if len(inner) <= 4:
        return starts, None, []
    q0, q1 = inner[0], inner[-1] + 1  # interior vectors are contiguous
    return starts[:q0], (q0, q1), starts[q1:]


def _column_vector(stage, e, acc, window, start) -> None:
    """Output columns [start, start + lanes) of one output row: ``start`` an int (an edge
    vector: masks and counts from the static columns) or a value (an interior vector)."""
    dt = stage.out.dtype
    width = e.lanes(dt)
    src, hs, (k0, k1), row, rows = window
    e.set(acc, e.vconst(_identity(stage), dt, width))
    with e.loop(k1, k0, "kh") as kh:
        xrow = _input_row(stage, e, src, hs, kh)
        for kw in range(stage.size[1]):
            _combine_taps(stage, e, acc, xrow, kw, start)
    v = e.get(acc)
    static = isinstance(start, int)
    if stage.row.average:
        cols = _column_counts(stage, e, start) if static else e.lanes_of("int64", width, stage.size[1], ())
        v = _divided(e, dt, width, v, rows, cols)
    count = min(width, stage.out.shape[3] - start) if static else width
    e.vstore(stage.out, e.add(row, start), v, dt, None if count == width else e.lane_mask(count, width))


def _combine_taps(stage, e, acc, xrow, kw: int, start) -> None:
    """acc op= the tap ``kw`` of output columns [start, start + lanes): every ``sw``-th
    element of the input span they read (:meth:`vload_every`); lanes whose tap lies
    outside the input (or past the row) hold the identity. ``start`` a value: an interior
    vector, every lane inside."""
    (x,), dt, sw = stage.inputs, stage.out.dtype, stage.stride[1]
    width = e.lanes(dt)
    lanes = None
    if isinstance(start, int):
        c0, c1 = stage.col_range(kw)
        lanes = (max(c0, start) - start, min(c1, start + width) - start)
        if lanes[0] >= lanes[1]:
            return
    col = start * sw if isinstance(start, int) else e.mul(start, sw)
    # from the base pointer: lane 0 may sit before the row (its tap is outside); masked lanes are never read
    v = e.vload_every(e.pointer(x), e.add(xrow, e.add(col, kw * stage.dilation[1] - stage.pad[1])), x.dtype,
                      width, sw, lanes, _identity(stage))
    v = _widened(stage, e, v, width)
    e.set(acc, e.vop(width, _combine_op(stage), dt, e.get(acc), v))


def _column_counts(stage, e, start: int):
    """The window's column count of each lane of the vector at ``start``, as int64 lanes
    (build-time constants LLVM folds; lanes past the row count 1)."""
    width, ow_n = e.lanes(stage.out.dtype), stage.out.shape[3]
    counts = (stage.counts(1, e.i(start + k), e) for k in range(min(width, ow_n - start)))
    return e.lanes_of("int64", width, 1, counts)  # lane by lane: each count, then its insert


def _divided(e, dt: str, width: int, v, ch, cw):
    """``v / max(ch * cw, 1)`` lane by lane (``ch`` the window's rows, ``cw`` its columns
    per lane): one division per element, as TVM's, on a vector."""
    cnt = e.vop(width, "multiply", "int64", e.splat(ch, width), cw)
    cnt = e.vop(width, "maximum", "int64", cnt, e.lanes_of("int64", width, 1, ()))
    return e.vop(width, "divide", dt, v, e.vop(width, "astype", "int64", cnt, to=dt))


def _adaptive_planes(stage, e, lo, hi) -> None:
    """Each bin summed in order (scalar), then divided by its size."""
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    acc = e.vvar(dt, 1)
    with e.loop(hi, lo, "pl") as pl:
        src = e.let(e.mul(pl, h * w))
        with e.loop(oh_n, 0, "oh") as oh, e.loop(ow_n, 0, "ow") as ow:
            h0, h1 = _bin(e, oh, h, oh_n)
            w0, w1 = _bin(e, ow, w, ow_n)
            e.set(acc, e.const(0, dt))
            with e.loop(h1, h0, "ih") as ih, e.loop(w1, w0, "iw") as iw:
                v = _widened(stage, e, e.load(x, e.add(src, e.add(e.mul(ih, w), iw))))
                e.set(acc, e.op("add", dt, e.get(acc), v))
            cnt = e.as_float(e.mul(e.sub(h1, h0), e.sub(w1, w0)), dt)
            at = e.add(e.mul(pl, oh_n * ow_n), e.add(e.mul(oh, ow_n), ow))
            e.store(out, at, e.op("divide", dt, e.get(acc), cnt))
        _plane_epilogue(stage, e, pl)
    e.keep_scalar(pl)  # across planes LLVM could only gather, which is slower than scalar sums


def _bin(e, o, size: int, n: int):
    """Adaptive bin [floor(o*size/n), ceil((o+1)*size/n))."""
    start = e.let(e.div(e.mul(o, size), n))
    end = e.let(e.div(e.add(e.mul(e.add(o, 1), size), n - 1), n))
    return start, end


def _plane_epilogue(stage, e, pl, r0=0, r1=None) -> None:
    """The epilogue on rows ``r0 .. r1`` (default: all) of plane ``pl``."""
    if stage.epilogue is not None:
        n, ch = unravel(e, pl, [e.dim(d) for d in stage.planes])
        rows = stage.out.shape[2] if r1 is None else e.sub(r1, r0)
        e.epilogue(stage, [n, ch, r0, 0], [1, 1, rows, stage.out.shape[3]])
