"""``relax.image.resize2d`` (ONNX ``Resize``, torch's ``interpolate``: the upsampling of
U-Nets, FPNs and YOLO necks), nearest and linear, NCHW and NHWC, float32.

The arithmetic is TVM's topi (``topi/image/resize.py``), operation for operation, in
float32: an output coordinate ``o`` becomes the source coordinate ``(o + 0.5) * s - 0.5``
(``half_pixel``; ``pytorch_half_pixel`` the same, 0 for an output of one pixel),
``(o + 0.5) * s`` (``tf_half_pixel_for_nn``), ``o * s`` (``asymmetric``) or
``(in - 1) / (out - 1) * o`` (``align_corners``), ``s = in / out``. ``nearest_neighbor``
reads the pixel at that coordinate rounded by ``rounding_method`` (``""``: ``round`` for
``align_corners``, else ``floor``; ``round`` is half to even; ``floor`` and ``ceil`` move
the coordinate by 1e-5 first, ``round_prefer_floor`` is ``ceil(v - 0.5)``,
``round_prefer_ceil`` ``floor(v + 0.5)``); an integer upscale with ``asymmetric`` and
``floor`` divides integers instead, as TVM does. ``linear`` blends the four neighbours at
``floor`` of the coordinate: rows first, ``a * (1 - t) + b * t``. Indices outside the
input are clamped to its edge. ``cubic``, ``tf_crop_and_resize`` (a region of interest),
other dtypes and layouts, symbolic spatial sizes stay with TVM, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from ..ir import kir
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import clamped, each_row
from ..render.loops import threaded
from ..render.portable import PortableStage

METHODS = ("nearest_neighbor", "linear")
MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nn")
ROUNDINGS = ("", "round", "round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
EPSILON = 1e-5  # TVM's nudge before floor / ceil


@dataclass(eq=False)
class Resize2d(PortableStage, kir.KernelStage):
    """``inputs``: the image; ``sizes``: (in_h, in_w, out_h, out_w), all static."""
    layout: str = "NCHW"
    method: str = "linear"
    mode: str = "half_pixel"
    rounding: str = ""
    sizes: tuple = ()

    def emit(self, e) -> None:
        x, (_, in_w, _, out_w) = self.inputs[0], self.sizes
        if self.layout == "NHWC":
            body = self._nhwc_pixel
        elif self._repeats(in_w, out_w):  # nearest's integer path: rows of repeated pixels
            body = self._nchw_repeats
        elif phases := _phases(self.method, self.mode, in_w, out_w):
            body = partial(self._nchw_phases, phases=phases)
        else:
            body = self._nchw_row
        channels = e.dim(x.shape[1] if self.layout == "NCHW" else x.shape[3])

        def row(e, r, pos):
            body(e, r, pos, channels)
            if self.epilogue is not None:
                e.epilogue(self, pos + [0], [1] * len(pos) + [e.dim(self.out.shape[-1])])

        each_row(e, self.out.shape, row, threaded(self.out.shape, "rows"))

    def _nchw_row(self, e, r, pos, channels):
        """Output row ``r`` of one (n, c) plane (``pos``: n, c, oy), column by column
        (channels innermost, each column's taps once per image row, measured no faster)."""
        (x,), out = self.inputs, self.out
        in_h, in_w, out_h, out_w = self.sizes
        plane = self._plane(e, pos, channels)
        ys = self._axis(e, pos[2], in_h, out_h)
        with e.loop(out_w, 0, "ox") as ox:
            xs = self._axis(e, ox, in_w, out_w)
            e.store(out, e.add(e.mul(r, out_w), ox), self._value(e, ys, xs, lambda yy, xx: e.load(
                x, e.add(plane, e.add(e.mul(yy, in_w), xx)))))

    def _plane(self, e, pos, channels):
        """The input offset of the (n, c) plane of an NCHW output row at ``pos`` (n, c, oy)."""
        in_h, in_w = self.sizes[:2]
        return e.let(e.mul(e.add(e.mul(pos[0], channels), pos[1]), in_h * in_w))

    def _nchw_phases(self, e, r, pos, channels, phases):
        """Output row ``r`` of one (n, c) plane of a linear upscale by a power of two: output
        column ``i * k + j`` reads columns ``i + d_j`` and ``i + d_j + 1`` at fraction ``t_j``
        (``phases``, from :func:`_phases`, exact in float32 as TVM computes them), so past
        the edge columns the row is ``k`` interleaved vector blends of shifted input rows."""
        (x,), out = self.inputs, self.out
        in_h, in_w, out_h, out_w = self.sizes
        dt = self.out.dtype
        plane = self._plane(e, pos, channels)
        y0, y1, ty = self._axis(e, pos[2], in_h, out_h)
        rows = [e.let(e.add(plane, e.mul(yy, in_w))) for yy in (y0, y1)]

        def column(i, clamp: bool):
            for j, (d, t) in enumerate(phases):
                x0, x1 = ((min(max(i + d + a, 0), in_w - 1) for a in (0, 1)) if clamp else
                          (e.add(i, d), e.add(i, d + 1)))
                tj = e.const(t, dt)
                top, bottom = (_lerp(e, dt, e.load(x, e.add(row, x0)), e.load(x, e.add(row, x1)), tj) for row in rows)
                e.store(out, e.add(e.mul(r, out_w), e.add(e.mul(i, len(phases)), j)), _lerp(e, dt, top, bottom, ty))

        column(0, True)
        with e.loop(in_w - 1, 1, "ix") as ix:
            column(ix, False)
        column(in_w - 1, True)

    def _nchw_repeats(self, e, r, pos, channels):
        """Output row ``r`` of one (n, c) plane where each input pixel fills ``k`` columns."""
        (x,), out = self.inputs, self.out
        in_h, in_w, out_h, out_w = self.sizes
        k = out_w // in_w  # one vector load, k interleaved stores: LLVM vectorizes it
        src = e.let(e.add(self._plane(e, pos, channels), e.mul(self._axis(e, pos[2], in_h, out_h)[0], in_w)))
        with e.loop(in_w, 0, "ix") as ix:
            value = e.load(x, e.add(src, ix))
            for j in range(k):
                e.store(out, e.add(e.mul(r, out_w), e.add(e.mul(ix, k), j)), value)

    def _nhwc_pixel(self, e, r, pos, channels):
        """Output pixel ``pos`` (n, oy, ox), its channels along the row."""
        (x,), out = self.inputs, self.out
        in_h, in_w, out_h, out_w = self.sizes
        ys, xs = self._axis(e, pos[1], in_h, out_h), self._axis(e, pos[2], in_w, out_w)  # once per pixel
        image = e.let(e.mul(pos[0], in_h * in_w))
        with e.loop(channels, 0, "c") as c:
            e.store(out, e.add(e.mul(r, channels), c), self._value(e, ys, xs, lambda yy, xx: e.load(
                x, e.add(e.mul(e.add(image, e.add(e.mul(yy, in_w), xx)), channels), c))))

    def _repeats(self, size: int, target: int) -> bool:
        """Whether output index ``o`` reads input ``o // k`` (TVM's integer path)."""
        return self.method == "nearest_neighbor" and _int_div(self.mode, self.rounding, size, target)

    # ---- one axis: the source index (nearest) or the two indices and the fraction (linear)
    def _axis(self, e, o, size, target):
        dt = self.out.dtype
        if self._repeats(size, target):
            return (e.let(e.div(o, target // size)),)  # o < target = k * size: in range
        v = self._source(e, o, size, target)
        if self.method == "nearest_neighbor":
            return (e.let(clamped(e, e.op("astype", dt, _rounded(e, dt, v, self._rounding()), to="int64"), size)),)
        low = e.let(e.op("astype", dt, e.op("floor", dt, v), to="int64"))
        frac = e.op("subtract", dt, v, e.as_float(low, dt))
        return clamped(e, low, size), clamped(e, e.add(low, 1), size), frac

    def _source(self, e, o, size, target):
        dt = self.out.dtype
        of = e.as_float(o, dt)
        if self.mode == "align_corners":
            return e.op("multiply", dt, e.const(_f32(size - 1) / _f32(target - 1), dt), of)
        if self.mode == "asymmetric":
            return e.op("multiply", dt, e.const(_f32(size) / _f32(target), dt), of)
        if self.mode == "pytorch_half_pixel" and target == 1:
            return e.const(0.0, dt)
        scaled = e.op("multiply", dt, e.op("add", dt, of, e.const(0.5, dt)), e.const(_f32(size) / _f32(target), dt))
        return scaled if self.mode == "tf_half_pixel_for_nn" else e.op("subtract", dt, scaled, e.const(0.5, dt))

    def _rounding(self) -> str:
        if self.rounding:
            return self.rounding
        return "round" if self.mode == "align_corners" else "floor"

    def _value(self, e, ys, xs, pixel):
        if self.method == "nearest_neighbor":
            return pixel(ys[0], xs[0])
        dt = self.out.dtype
        (y0, y1, ty), (x0, x1, tx) = ys, xs
        top = _lerp(e, dt, pixel(y0, x0), pixel(y0, x1), tx)
        bottom = _lerp(e, dt, pixel(y1, x0), pixel(y1, x1), tx)
        return _lerp(e, dt, top, bottom, ty)

    @staticmethod
    def reference(x, size, layout="NCHW", method="linear", mode="half_pixel", rounding=""):
        """The same formulas in numpy, float32 operation for operation."""
        f, nchw = np.float32, layout == "NCHW"
        planes = x if nchw else x.transpose(0, 3, 1, 2)
        ys = _np_axis(x.shape[2 if nchw else 1], size[0], method, mode, rounding)
        xs = _np_axis(x.shape[3 if nchw else 2], size[1], method, mode, rounding)
        pick = lambda yy, xx: planes[:, :, yy[:, None], xx[None, :]]  # noqa: E731
        if method == "nearest_neighbor":
            res = pick(ys[0], xs[0])
        else:
            lerp = lambda a, b, t: a * (f(1) - t) + b * t  # noqa: E731
            tx, ty = xs[2][None, :], ys[2][:, None]
            top, bottom = (lerp(pick(yy, xs[0]), pick(yy, xs[1]), tx) for yy in ys[:2])
            res = lerp(top, bottom, ty)
        res = res.astype(x.dtype)
        return res if nchw else res.transpose(0, 2, 3, 1)


def _np_axis(n: int, target: int, method: str, mode: str, rounding: str) -> tuple:
    """One axis of :meth:`Resize2d.reference`: the source indices (nearest), or the two
    neighbours and the fraction (linear), of every output coordinate."""
    f, o = np.float32, np.arange(target)
    if method == "nearest_neighbor" and _int_div(mode, rounding, n, target):
        return (o // (target // n),)
    of, scale = o.astype(f), f(n) / f(target)
    if mode == "align_corners":
        v = (f(n - 1) / f(target - 1)) * of
    elif mode == "asymmetric":
        v = scale * of
    elif mode == "pytorch_half_pixel" and target == 1:
        v = np.zeros(1, f)
    else:
        v = (of + f(0.5)) * scale
        v = v if mode == "tf_half_pixel_for_nn" else v - f(0.5)
    if method == "nearest_neighbor":
        rule = rounding or ("round" if mode == "align_corners" else "floor")
        return (np.clip(_np_rounded(v.astype(f), rule).astype(np.int64), 0, n - 1),)
    low = np.floor(v).astype(np.int64)
    return np.clip(low, 0, n - 1), np.clip(low + 1, 0, n - 1), (v - low.astype(f)).astype(f)


def _f32(v) -> float:
    return float(np.float32(v))


def _lerp(e, dt, a, b, t):
    one_minus = e.op("subtract", dt, e.const(1.0, dt), t)
    return e.op("add", dt, e.op("multiply", dt, a, one_minus), e.op("multiply", dt, b, t))


def _rounded(e, dt, v, rule: str):
    if rule == "round":
        return e.op("round", dt, v)
    if rule == "round_prefer_floor":
        return e.op("ceil", dt, e.op("subtract", dt, v, e.const(0.5, dt)))
    if rule == "round_prefer_ceil":
        return e.op("floor", dt, e.op("add", dt, v, e.const(0.5, dt)))
    if rule == "floor":
        return e.op("floor", dt, e.op("add", dt, v, e.const(EPSILON, dt)))
    return e.op("ceil", dt, e.op("subtract", dt, v, e.const(EPSILON, dt)))


def _np_rounded(v, rule: str):
    f = np.float32
    return {"round": lambda: np.rint(v), "round_prefer_floor": lambda: np.ceil(v - f(0.5)),
            "round_prefer_ceil": lambda: np.floor(v + f(0.5)), "floor": lambda: np.floor(v + f(EPSILON)),
            "ceil": lambda: np.ceil(v - f(EPSILON))}[rule]()


def _phases(method: str, mode: str, size: int, target: int) -> list | None:
    """For a linear upscale by a power of two ``k`` (half_pixel, pytorch_half_pixel or
    asymmetric, at least 3 input columns): per phase ``j`` of ``k`` the offset ``d_j`` of
    the left neighbour and the fraction ``t_j``, where output ``i * k + j`` reads ``i +
    d_j`` and ``i + d_j + 1``. TVM's float32 coordinate ``(o + 0.5) / k - 0.5`` (or
    ``o / k``) is exact for such ``k``, so ``floor`` and the fraction are the same for every
    ``i``. None otherwise."""
    k = target // size
    if method != "linear" or mode not in ("half_pixel", "pytorch_half_pixel", "asymmetric") or size < 3 \
            or target != k * size or k < 2 or k & (k - 1) or target >= 1 << 22:
        return None
    f, o = np.float32, np.arange(k, dtype=np.float32)
    v = o * (f(1) / f(k)) if mode == "asymmetric" else (o + f(0.5)) * (f(size) / f(target)) - f(0.5)
    low = np.floor(v)
    return [(int(d), float(t)) for d, t in zip(low, (v - low).astype(f))]


def _int_div(mode: str, rounding: str, size: int, target: int) -> bool:
    """TVM's integer path for nearest ``asymmetric`` ``floor`` (``can_convert_multiply_to_intdiv``):
    an integer upscale ``target / size`` no larger than ``1 / (1e-5 * size + 1e-5)``."""
    if mode != "asymmetric" or rounding not in ("", "floor") or target % size:
        return False
    return target / size <= 1 / (EPSILON * size + EPSILON)


def _check(call) -> str | None:
    x, a = call.args[0], call.attrs
    for ty in (x.ty, call.ty):
        problem = tensor_problem(ty, ("float32",))
        if problem:
            return f"relax.image.resize2d: {problem}"
    layout, shape, out = str(a.layout), dims(x.ty), dims(call.ty)
    if layout not in ("NCHW", "NHWC"):
        return f"relax.image.resize2d: layout {layout} (supported: NCHW, NHWC)"
    if str(a.method) not in METHODS:
        return f"relax.image.resize2d: method {a.method} (supported here: {list(METHODS)})"
    if str(a.coordinate_transformation_mode) not in MODES:
        return f"relax.image.resize2d: coordinate_transformation_mode {a.coordinate_transformation_mode} " \
               f"(supported here: {list(MODES)})"
    if str(a.rounding_method) not in ROUNDINGS:
        return f"relax.image.resize2d: rounding_method {a.rounding_method} (supported: {list(ROUNDINGS)})"
    spatial = _spatial(layout, shape) + _spatial(layout, out)
    if not all(isinstance(d, int) and d > 0 for d in spatial) or 0 in shape or 0 in out:
        return "relax.image.resize2d: symbolic or empty spatial sizes"
    if str(a.coordinate_transformation_mode) == "align_corners" and 1 in spatial[2:]:
        return "relax.image.resize2d: align_corners with an output of one row or column divides by zero in TVM"
    return None


def _spatial(layout: str, shape) -> tuple:
    return tuple(shape[2:4]) if layout == "NCHW" else tuple(shape[1:3])


@register("relax.image.resize2d", 2, _check)
def _build(fe, call, out):
    a, layout = call.attrs, str(call.attrs.layout)
    sizes = _spatial(layout, dims(call.args[0].ty)) + _spatial(layout, dims(call.ty))
    return Resize2d((fe.buffer(call.args[0]),), out, layout=layout, method=str(a.method),
                    mode=str(a.coordinate_transformation_mode), rounding=str(a.rounding_method), sizes=sizes)
