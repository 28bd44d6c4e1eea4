"""``relax.vision.roi_align`` (NCHW): for every region of interest ``(batch, x0, y0, x1, y1)``
(in input pixels once scaled by ``spatial_scale``) and every output bin, the average or
the maximum of a grid of bilinear samples inside the bin.

The arithmetic is TVM's topi (``topi/vision/roi_align.py``), operation for operation: the
region's size is at least 1 pixel unless ``aligned``; a bin is ``size / pooled``; the grid
has ``sample_ratio`` samples per side, or ``ceil(size / pooled)`` when that is not
positive; sample ``(i, j)`` of bin ``(ph, pw)`` lies at ``start + ph * bin + (i + 0.5) *
bin / grid``. A sample more than one pixel outside the input is 0; otherwise it is clamped
into the input and interpolated from its four neighbours (x outer, y inner, each term
``wx * wy * pixel``). ``avg`` sums ``sample / count``; ``max`` starts from the dtype's
lowest value. A batch index outside the input is clamped (TVM reads out of bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, operands_problem
from ..ir.rules import register
from ..render.indexing import clamped, unravel
from ..render.loops import threaded
from ..render.portable import PortableStage
from .pool_planes import lowest


@dataclass(eq=False)
class RoiAlign(PortableStage, kir.KernelStage):
    """``inputs``: data (N, C, H, W), rois (R, 5)."""
    pooled: tuple = (1, 1)
    scale: float = 1.0
    sample_ratio: int = -1
    aligned: bool = False
    mode: str = "avg"

    def emit(self, e) -> None:
        x, rois = self.inputs
        out, dt = self.out, self.out.dtype
        ph_n, pw_n = self.pooled

        def body(e, lo, hi):
            with e.loop(hi, lo, "bin") as p:
                r, c, ph, pw = unravel(e, p, [e.dim(d) for d in out.shape])
                roi = [e.load(rois, e.add(e.mul(r, 5), k)) for k in range(5)]
                n = clamped(e, e.op("astype", dt, roi[0], to="int64"), e.dim(x.shape[0]))
                plane = e.let(e.mul(e.add(e.mul(n, e.dim(x.shape[1])), c), e.product(x.shape[2:])))
                axes = [self._axis(e, roi, 2, ph, ph_n), self._axis(e, roi, 1, pw, pw_n)]
                e.store(out, p, self._pool(e, plane, axes))
                if self.epilogue is not None:
                    e.epilogue(self, [r, c, ph, pw], [1, 1, 1, 1])

        e.parallel(e.product(out.shape), body, threaded(out.shape, "rows"))

    def _axis(self, e, roi, k, at, pooled):
        """(start of the bin, bin size, grid count, grid count as a float) along rows (k=2)
        or columns (k=1)."""
        dt = self.out.dtype
        scale = e.const(self.scale, dt)
        start, end = e.op("multiply", dt, roi[k], scale), e.op("multiply", dt, roi[k + 2], scale)
        size = e.op("subtract", dt, end, start)
        if not self.aligned:
            size = e.op("maximum", dt, size, e.const(1.0, dt))
        bin_size = e.op("divide", dt, size, e.const(pooled, dt))
        if self.sample_ratio > 0:
            grid = self.sample_ratio
        else:
            grid = e.let(e.op("astype", dt, e.op("ceil", dt, e.op("divide", dt, size, e.const(pooled, dt))),
                              to="int64"))
        start = e.op("add", dt, start, e.op("multiply", dt, e.as_float(at, dt), bin_size))
        return start, bin_size, grid, e.as_float(grid, dt)

    def _pool(self, e, plane, axes):
        dt = self.out.dtype
        (_, _, gh, gh_f), (_, _, gw, gw_f) = axes
        avg = self.mode == "avg"
        count = e.as_float(e.mul(gh, gw), dt) if avg else None
        acc = e.var(dt, e.const(0 if avg else lowest(dt), dt))
        with e.loop(gh, 0, "gy") as i, e.loop(gw, 0, "gx") as j:
            y = self._coordinate(e, axes[0], i)
            xc = self._coordinate(e, axes[1], j)
            v = self._sample(e, plane, y, xc)
            if avg:
                e.set(acc, e.op("add", dt, e.get(acc), e.op("divide", dt, v, count)))
            else:
                e.set(acc, e.op("maximum", dt, e.get(acc), v))
        return e.get(acc)

    def _coordinate(self, e, axis, i):
        dt = self.out.dtype
        start, bin_size, _, grid_f = axis
        offset = e.op("multiply", dt, e.op("add", dt, e.as_float(i, dt), e.const(0.5, dt)), bin_size)
        return e.op("add", dt, start, e.op("divide", dt, offset, grid_f))

    def _sample(self, e, plane, y, xc):
        """TVM's bilinear sample of the plane at (y, x), 0 more than a pixel outside."""
        data, dt = self.inputs[0], self.out.dtype
        h, w = (e.dim(d) for d in data.shape[2:])
        outside = None
        for v, n in ((y, h), (xc, w)):
            far = e.op("logical_or", "bool", e.op("less", dt, v, e.const(-1.0, dt)),
                       e.op("greater", dt, v, e.as_float(n, dt)))
            outside = far if outside is None else e.op("logical_or", "bool", outside, far)
        corners = []
        for v, n in ((y, h), (xc, w)):
            v = e.op("minimum", dt, e.op("maximum", dt, v, e.const(0.0, dt)), e.as_float(e.sub(n, 1), dt))
            low = e.let(e.op("astype", dt, e.op("floor", dt, v), to="int64"))
            high_w = e.op("subtract", dt, v, e.as_float(low, dt))
            corners.append([(e.op("subtract", dt, e.const(1.0, dt), high_w), low), (high_w, e.let(e.add(low, 1)))])
        val = e.const(0.0, dt)
        for wx, xp in corners[1]:
            for wy, yp in corners[0]:
                inside = e.op("logical_and", "bool", e.lt(yp, h), e.lt(xp, w))
                pixel = e.load(data, e.add(plane, e.add(e.mul(e.min(yp, e.sub(h, 1)), w), e.min(xp, e.sub(w, 1)))))
                term = e.op("multiply", dt, e.op("multiply", dt, wx, wy), pixel)
                val = e.op("add", dt, val, e.select(inside, term, e.const(0.0, dt)))
        return e.select(outside, e.const(0.0, dt), val)

    @staticmethod
    def reference(x, rois, pooled, scale, sample_ratio, aligned, mode) -> np.ndarray:
        """The same formulas in float64, one bin at a time."""
        n_img, chans, h, w = x.shape
        out = np.zeros((len(rois), chans) + tuple(pooled))
        for r, roi in enumerate(rois.astype(np.float64)):
            img = x[min(max(int(roi[0]), 0), n_img - 1)].astype(np.float64)
            start = roi[1:3][::-1] * scale
            size = roi[3:5][::-1] * scale - start
            size = size if aligned else np.maximum(size, 1.0)
            bins = size / np.array(pooled)
            grid = [sample_ratio] * 2 if sample_ratio > 0 else [math.ceil(s) for s in bins]
            for ph, pw in np.ndindex(*pooled):
                samples = [_np_bilinear(img, start[0] + ph * bins[0] + (i + 0.5) * bins[0] / grid[0],
                                        start[1] + pw * bins[1] + (j + 0.5) * bins[1] / grid[1])
                           for i in range(grid[0]) for j in range(grid[1])]
                if mode == "avg":
                    out[r, :, ph, pw] = np.sum(samples, axis=0) / max(len(samples), 1)
                else:
                    out[r, :, ph, pw] = np.max(samples, axis=0) if samples else lowest(x.dtype)
        return out.astype(x.dtype)


def _np_bilinear(img, y, x):
    h, w = img.shape[1:]
    if y < -1 or x < -1 or y > h or x > w:
        return np.zeros(img.shape[0])
    y, x = min(max(y, 0.0), h - 1), min(max(x, 0.0), w - 1)
    y0, x0 = math.floor(y), math.floor(x)
    total = np.zeros(img.shape[0])
    for xp, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
        for yp, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
            if yp < h and xp < w:
                total += wx * wy * img[:, yp, xp]
    return total


def _check(call) -> str | None:
    x, rois = call.args
    problem = operands_problem(call, (x, rois, call), FLOATS)
    if problem:
        return problem
    a = call.attrs
    if str(a.layout) != "NCHW" or str(a.mode) not in ("avg", "max"):
        return f"relax.vision.roi_align: layout {a.layout} / mode {a.mode} (supported: NCHW, avg or max)"
    xd, rd = dims(x.ty), dims(rois.ty)
    if len(xd) != 4 or len(rd) != 2 or rd[1] != 5 or 0 in xd + rd:
        return "relax.vision.roi_align: not (N, C, H, W) data and (R, 5) rois, or empty"
    if len({str(x.ty.dtype), str(rois.ty.dtype), str(call.ty.dtype)}) != 1:
        return "relax.vision.roi_align: mixed dtypes"
    return None


@register("relax.vision.roi_align", 2, _check)
def _build(fe, call, out):
    a = call.attrs
    return RoiAlign((fe.buffer(call.args[0]), fe.buffer(call.args[1])), out,
                    pooled=tuple(int(v) for v in a.pooled_size), scale=float(a.spatial_scale),
                    sample_ratio=int(a.sample_ratio), aligned=bool(a.aligned), mode=str(a.mode))
