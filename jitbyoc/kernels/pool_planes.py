"""LLVM rendering of :class:`~jitbyoc.kernels.pool2d.Pool2d`: one (image, channel) plane
per task step; see the module docstring of :mod:`jitbyoc.kernels.pool2d`."""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I1, I32, I64
from ..render.llvm import Emitter
from ..render.loops import for_range, threaded
from ..render.portable import LLVM
from ..render.vectors import lane_mask, lanes, splat, vload, vstore, vtype

MAX_VECTOR_STRIDE = 4  # column strides whose rows take explicit vectors (a load spans stride x lanes)


def lowest(dt) -> float | int:
    """What a max pool starts from and pads with, as TVM's: the dtype's lowest finite value."""
    d = np.dtype(str(dt))
    return float(np.finfo(d).min) if d.kind == "f" else int(np.iinfo(d).min)


def emit_pool(stage, ctx) -> None:
    if stage.row.adaptive:
        body = _adaptive_planes
    elif lookup_dtype(stage.out.dtype).is_float and stage.stride[1] <= MAX_VECTOR_STRIDE:
        body = _vector_planes
    else:
        body = _window_planes
    planes = ctx.product(stage.planes)
    if threaded(stage.out.shape, "rows"):
        ctx.parallel_for(planes, lambda c, lo, hi, _: body(stage, c, lo, hi))
    else:
        body(stage, ctx, ir.Constant(I64, 0), planes)


def _kernel_rows(stage, b, ops, hs):
    """Kernel rows [lo, hi) whose input row ``hs + kh * dh`` lies inside the input."""
    h, dh, kh = stage.inputs[0].shape[2], stage.dilation[0], stage.size[0]
    lo = ops.max(ops.div(ops.sub(dh - 1, hs), dh), 0)
    below = ops.sub(h - 1, hs)  # negative: the window starts under the input
    hi = b.select(b.icmp_signed("<", below, I64(0)), I64(0), ops.add(ops.div(below, dh), 1))
    return lo, ops.min(hi, kh)


def _identity(stage) -> float | int:
    """What a window starts from and what taps outside the input count as."""
    return 0 if stage.row.average else lowest(stage.out.dtype)


def _combine_op(stage) -> str:
    return "add" if stage.row.average else "maximum"


def _input_row(stage, b, src, hs, kh):
    """Offset of the input row kernel row ``kh`` reads for the output row whose window
    starts at input row ``hs``, in the plane at ``src``."""
    w = stage.inputs[0].shape[3]
    return b.add(src, b.mul(b.add(hs, b.mul(kh, I64(stage.dilation[0]))), I64(w)))


def _window_planes(stage, c, lo, hi) -> None:
    """Integer pools and column strides above MAX_VECTOR_STRIDE: whole output rows
    combined in memory, tap by tap (see :func:`_vector_planes` for the rest)."""
    b, ops = c.b, LLVM(c)
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    init = c.em.const(_identity(stage), dt)
    with for_range(b, hi, "pl", start=lo) as pl:
        src, dst = b.mul(pl, I64(h * w)), b.mul(pl, I64(oh_n * ow_n))
        with for_range(b, I64(oh_n), "oh") as oh:
            row = b.add(dst, b.mul(oh, I64(ow_n)))
            with for_range(b, I64(ow_n), "ow") as ow:
                c.store(out, b.add(row, ow), init)
            hs = ops.sub(ops.mul(oh, stage.stride[0]), stage.pad[0])
            k0, k1 = _kernel_rows(stage, b, ops, hs)
            with for_range(b, k1, "kh", start=k0) as kh:
                xrow = _input_row(stage, b, src, hs, kh)
                for kw in range(stage.size[1]):
                    _combine_row(stage, c, row, xrow, kw)
            if stage.row.average:
                ch = stage.counts(0, oh, ops)
                with for_range(b, I64(ow_n), "ow") as ow:
                    cnt = ops.max(b.mul(ch, stage.counts(1, ow, ops)), 1)
                    at = b.add(row, ow)
                    c.store(out, at, b.fdiv(c.load(out, at), b.sitofp(cnt, lookup_dtype(dt).ir)))
        _plane_epilogue(stage, c, pl)


def _vector_planes(stage, c, lo, hi) -> None:
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
    b, ops, (x,), out, dt = c.b, LLVM(c), stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    width = lanes(dt)
    head, run, tail = _column_runs(stage, width)
    with b.goto_block(b.function.entry_basic_block):
        acc = b.alloca(vtype(dt))
    with for_range(b, hi, "pl", start=lo) as pl:
        src, dst = b.mul(pl, I64(h * w)), b.mul(pl, I64(oh_n * ow_n))
        with for_range(b, I64(oh_n), "oh") as oh:
            hs = ops.sub(ops.mul(oh, stage.stride[0]), stage.pad[0])
            window = (src, hs, _kernel_rows(stage, b, ops, hs), b.add(dst, b.mul(oh, I64(ow_n))),
                      stage.counts(0, oh, ops) if stage.row.average else None)
            for start in head:
                _column_vector(stage, c, acc, window, start)
            if run:
                with for_range(b, I64(run[1]), "q", start=I64(run[0])) as q:
                    _column_vector(stage, c, acc, window, b.mul(q, I64(width)))
            for start in tail:
                _column_vector(stage, c, acc, window, start)
        _plane_epilogue(stage, c, pl)


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


def _column_vector(stage, c, acc, window, start) -> None:
    """Output columns [start, start + lanes) of one output row: ``start`` an int (an edge
    vector: masks and counts from the static columns) or an i64 (an interior vector)."""
    b, dt, width = c.b, stage.out.dtype, lanes(stage.out.dtype)
    src, hs, (k0, k1), row, rows = window
    em = Emitter(b, width)
    b.store(em.const(_identity(stage), dt), acc)
    with for_range(b, k1, "kh", start=k0) as kh:
        xrow = _input_row(stage, b, src, hs, kh)
        for kw in range(stage.size[1]):
            _combine_taps(stage, c, em, acc, xrow, kw, start)
    v = b.load(acc, typ=vtype(dt))
    static = isinstance(start, int)
    if stage.row.average:
        cols = _column_counts(stage, c, start) if static else [stage.size[1]] * width
        v = _divided(b, v, rows, cols if static else ir.Constant(ir.VectorType(I64, width), cols))
    count = min(width, stage.out.shape[3] - start) if static else width
    vstore(b, v, c.element(stage.out, b.add(row, I64(start) if static else start)), dt,
           None if count == width else lane_mask(b, count, width))


def _combine_taps(stage, c, em, acc, xrow, kw: int, start) -> None:
    """acc op= the tap ``kw`` of output columns [start, start + lanes): one (masked) load
    of the input span they read, every ``sw``-th element picked by a shuffle; lanes whose
    tap lies outside the input (or past the row) hold the identity. ``start`` an i64: an
    interior vector, every lane inside."""
    b, (x,), dt = c.b, stage.inputs, stage.out.dtype
    sw, width = stage.stride[1], lanes(dt)
    static = isinstance(start, int)
    c0, c1 = stage.col_range(kw)
    first, last = (max(c0, start), min(c1, start + width)) if static else (0, width)
    if first >= last:
        return
    wide = width * sw
    loaded = ([(first - start) * sw <= e <= (last - 1 - start) * sw for e in range(wide)] if static
              else [True] * wide)
    shift = I64(kw * stage.dilation[1] - stage.pad[1])
    col = I64(start * sw) if static else b.mul(start, I64(sw))
    # not inbounds: lane 0 may sit before the row (its tap is outside); masked lanes are never read
    src = b.gep(c.ptrs[x.storage], [b.add(xrow, b.add(col, shift))], source_etype=lookup_dtype(dt).storage_ir)
    v = vload(b, src, dt, None if all(loaded) else ir.Constant(ir.VectorType(I1, wide), loaded), wide)
    if sw > 1:
        v = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), [k * sw for k in range(width)]))
    if static and not (first == start and last == start + width):
        inside = ir.Constant(ir.VectorType(I1, width), [first <= start + k < last for k in range(width)])
        v = b.select(inside, v, em.const(_identity(stage), dt))
    b.store(em.op(_combine_op(stage), dt, b.load(acc, typ=v.type), v), acc)


def _column_counts(stage, c, start: int):
    """The window's column count of each lane of the vector at ``start``, as i64 lanes
    (build-time constants LLVM folds; lanes past the row count 1)."""
    b, ops, width, ow_n = c.b, LLVM(c), lanes(stage.out.dtype), stage.out.shape[3]
    v = ir.Constant(ir.VectorType(I64, width), [1] * width)
    for k in range(min(width, ow_n - start)):
        v = b.insert_element(v, stage.counts(1, I64(start + k), ops), I32(k))
    return v


def _divided(b, v, ch, cw):
    """``v / max(ch * cw, 1)`` lane by lane (``ch`` the window's rows, ``cw`` its columns
    per lane): one division per element, as TVM's, on a vector."""
    width = v.type.count
    vt64 = ir.VectorType(I64, width)
    one = ir.Constant(vt64, [1] * width)
    cnt = b.mul(splat(b, ch, width), cw)
    cnt = b.select(b.icmp_signed(">", cnt, one), cnt, one)
    return b.fdiv(v, b.sitofp(cnt, v.type))


def _combine_row(stage, c, row, xrow, kw: int) -> None:
    """out[row + ow] op= x[xrow + ow * sw + kw * dw - pl] over the columns inside the input."""
    b, (x,), out = c.b, stage.inputs, stage.out
    c0, c1 = stage.col_range(kw)
    if c0 >= c1:
        return
    base = b.add(xrow, I64(kw * stage.dilation[1] - stage.pad[1]))
    with for_range(b, I64(c1), "ow", start=I64(c0)) as ow:
        v = c.load(x, b.add(base, b.mul(ow, I64(stage.stride[1]))))
        at = b.add(row, ow)
        acc = c.load(out, at)
        c.store(out, at, c.em.op(_combine_op(stage), out.dtype, acc, v))


def _adaptive_planes(stage, c, lo, hi) -> None:
    b = c.b
    (x,), out, dt = stage.inputs, stage.out, stage.out.dtype
    _, _, h, w = x.shape
    _, _, oh_n, ow_n = out.shape
    fty = lookup_dtype(dt).ir
    with b.goto_block(b.function.entry_basic_block):
        acc = b.alloca(fty)
    with for_range(b, hi, "pl", start=lo) as pl:
        src = b.mul(pl, I64(h * w))
        with for_range(b, I64(oh_n), "oh") as oh, for_range(b, I64(ow_n), "ow") as ow:
            h0, h1 = _bin(b, oh, h, oh_n)
            w0, w1 = _bin(b, ow, w, ow_n)
            b.store(ir.Constant(fty, 0.0), acc)
            with for_range(b, h1, "ih", start=h0) as ih, for_range(b, w1, "iw", start=w0) as iw:
                v = c.load(x, b.add(src, b.add(b.mul(ih, I64(w)), iw)))
                b.store(b.fadd(b.load(acc, typ=fty), v), acc)
            cnt = b.sitofp(b.mul(b.sub(h1, h0), b.sub(w1, w0)), fty)
            at = b.add(b.mul(pl, I64(oh_n * ow_n)), b.add(b.mul(oh, I64(ow_n)), ow))
            c.store(out, at, b.fdiv(b.load(acc, typ=fty), cnt))
        _plane_epilogue(stage, c, pl)
    _no_vectorize(c.module, pl)


def _no_vectorize(module, index) -> None:
    """Tag the loop of ``index`` (a :func:`for_range` phi, after the loop) so LLVM does not
    vectorize it: across planes it can only gather, which is slower than scalar sums."""
    flag = module.add_metadata([ir.MetaDataString(module, "llvm.loop.vectorize.enable"),
                                I1(0)])
    loop_id = module.add_metadata([flag, index.name])  # unique placeholder, then self-reference
    loop_id.operands = (loop_id, flag)
    latch = index.incomings[1][1]
    latch.terminator.set_metadata("llvm.loop", loop_id)


def _bin(b, o, size: int, n: int):
    """Adaptive bin [floor(o*size/n), ceil((o+1)*size/n))."""
    start = b.sdiv(b.mul(o, I64(size)), I64(n))
    end = b.sdiv(b.add(b.mul(b.add(o, I64(1)), I64(size)), I64(n - 1)), I64(n))
    return start, end


def _plane_epilogue(stage, c, pl) -> None:
    n, ch = c.unravel(pl, stage.planes)
    c.epilogue(stage, [n, ch, I64(0), I64(0)], [1, 1, stage.out.shape[2], stage.out.shape[3]])
