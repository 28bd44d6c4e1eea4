"""``relax.image.grid_sample``: ``data`` (N, C, *in) sampled at the points of ``grid``
(N, k, *out), k = 2 (NCHW) or 3 (NCDHW); grid channel 0 is the last axis (x), as in TVM.

The arithmetic is TVM's topi (``topi/image/grid_sample.py``), operation for operation:
a grid value g becomes the source coordinate ``(g + 1) * (size - 1) / 2``
(``align_corners``) or ``-0.5 + (g + 1) * size / 2``; ``border`` clamps it to
``[0, size - 1]``, ``reflection`` reflects it about the edges (corner pixel centers with
``align_corners``, the outer pixel edges otherwise) and then clamps. ``nearest`` reads the
pixel at the coordinate rounded half to even; ``bilinear`` sums the 2^k neighbours, each
weighted by the product of its per-axis weights in TVM's order; ``bicubic`` (2-D only)
interpolates rows of four with Keys' kernel (A = -0.75), then the four row results, its
taps clamped or reflected by pixel index. Pixels outside the input count as 0. Each
output point's coordinates and weights are computed once, for all channels.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import clamped, dot, unravel
from ..render.loops import threaded
from ..render.portable import PortableStage

METHODS = {4: ("nearest", "bilinear", "bicubic"), 5: ("nearest", "bilinear")}
PADDINGS = ("zeros", "border", "reflection")
LAYOUTS = {4: "NCHW", 5: "NCDHW"}
# TVM's order of the bilinear neighbours (one bit per axis, outermost first) and of the
# weight factors (by axis) in each term: its 2-D and 3-D formulas differ.
CORNERS = {2: list(itertools.product((0, 1), repeat=2)),
           3: [(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1), (0, 1, 0), (1, 0, 1), (1, 0, 0), (0, 1, 1)]}
WEIGHT_ORDER = {2: (0, 1), 3: (2, 1, 0)}
CUBIC_A = -0.75


@dataclass(eq=False)
class GridSample(PortableStage, kir.KernelStage):
    """``inputs``: data, grid (its coordinates along dim 1)."""
    method: str = "bilinear"
    padding: str = "zeros"
    align_corners: bool = False

    def emit(self, e) -> None:
        x, grid = self.inputs
        out, k = self.out, x.ndim - 2

        def body(e, lo, hi):
            points, channels = e.product(out.shape[2:]), e.dim(x.shape[1])
            with e.loop(hi, lo, "p") as p:
                n, s = e.let(e.div(p, points)), e.let(e.rem(p, points))
                coords = [self._unnormalize(e, e.load(grid, e.add(e.mul(e.add(e.mul(n, k), k - 1 - a), points), s)),
                                            x.shape[2 + a]) for a in range(k)]
                sample = self._sampler(e, coords)
                with e.loop(channels, 0, "c") as c:
                    image = e.let(e.add(e.mul(n, channels), c))  # the (n, c) plane, in and out
                    e.store(out, e.add(e.mul(image, points), s), sample(e.let(e.mul(image, e.product(x.shape[2:])))))
                if self.epilogue is not None:
                    at = unravel(e, s, [e.dim(d) for d in out.shape[2:]])
                    e.epilogue(self, [n, 0] + at, [1, channels] + [1] * k)

        e.parallel(e.mul(e.dim(out.shape[0]), e.product(out.shape[2:])), body, threaded(out.shape, "rows"))

    # ---- coordinates ------------------------------------------------------------------
    def _unnormalize(self, e, g, size):
        dt, size = self.out.dtype, e.dim(size)
        one, two = e.const(1, dt), e.const(2, dt)
        g1 = e.op("add", dt, g, one)
        if self.align_corners:
            return e.op("divide", dt, e.op("multiply", dt, g1, e.as_float(e.sub(size, 1), dt)), two)
        scaled = e.op("divide", dt, e.op("multiply", dt, g1, e.as_float(size, dt)), two)
        return e.op("add", dt, e.const(-0.5, dt), scaled)

    def _clip(self, e, v, size):
        dt = self.out.dtype
        return e.op("minimum", dt, e.op("maximum", dt, v, e.const(0, dt)), e.as_float(e.sub(size, 1), dt))

    def _reflect(self, e, v, size):
        """TVM's ``_reflect_coordinates``: ``v`` mirrored into ``[corner, corner + span]``."""
        dt = self.out.dtype
        span = e.sub(size, 1) if self.align_corners else size
        corner = e.const(0 if self.align_corners else -0.5, dt)
        span_f = e.as_float(span, dt)
        inside = e.op("logical_and", "bool", e.op("greater_equal", dt, v, corner),
                      e.op("less_equal", dt, v, e.op("add", dt, span_f, corner)))
        dist = e.op("abs", dt, e.op("subtract", dt, corner, v))
        times = e.let(e.div(e.op("astype", dt, dist, to="int64"), span))
        extra = e.op("subtract", dt, dist, e.as_float(e.mul(times, span), dt))
        even = e.eq(e.rem(times, 2), 0)
        mirrored = e.select(even, e.op("add", dt, extra, corner),
                            e.op("add", dt, e.op("subtract", dt, span_f, extra), corner))
        return e.select(inside, v, mirrored)

    def _placed(self, e, v, size):
        """A float coordinate after the padding mode's clamp or reflection."""
        if self.padding == "reflection":
            v = self._reflect(e, v, size)
        return self._clip(e, v, size) if self.padding != "zeros" else v

    # ---- sampling ---------------------------------------------------------------------
    def _pixel(self, e, plane, idx):
        """``x[plane + idx]``, or 0 outside the input (read at a clamped index)."""
        x = self.inputs[0]
        sizes = [e.dim(d) for d in x.shape[2:]]
        ok, safe = None, []
        for i, n in zip(idx, sizes):
            inb = e.op("logical_and", "bool", e.lt(-1, i), e.lt(i, n))
            ok = inb if ok is None else e.op("logical_and", "bool", ok, inb)
            safe.append(clamped(e, i, n))
        strides = [e.product(x.shape[3 + a:]) for a in range(len(sizes))]
        value = e.load(x, e.add(plane, dot(e, safe, strides)))
        return e.select(ok, value, e.const(0, x.dtype))

    def _sampler(self, e, coords):
        """``sample(plane) -> value``, with everything that depends only on the point
        (indices, weights) computed here, outside the channel loop."""
        sizes = [e.dim(d) for d in self.inputs[0].shape[2:]]
        dt = self.out.dtype
        if self.method == "bicubic":
            return self._bicubic(e, coords, sizes)
        coords = [self._placed(e, v, n) for v, n in zip(coords, sizes)]
        if self.method == "nearest":
            idx = [e.let(e.op("astype", dt, e.op("round", dt, v), to="int64")) for v in coords]
            return lambda plane: self._pixel(e, plane, idx)
        lows = [e.let(e.op("astype", dt, e.op("floor", dt, v), to="int64")) for v in coords]
        fracs = [e.op("subtract", dt, v, e.as_float(i, dt)) for v, i in zip(coords, lows)]
        weights = [(e.op("subtract", dt, e.const(1, dt), f), f) for f in fracs]
        k = len(coords)

        def sample(plane):
            total = None
            for bits in CORNERS[k]:
                term = self._pixel(e, plane, [e.add(i, b) for i, b in zip(lows, bits)])
                for a in WEIGHT_ORDER[k]:
                    term = e.op("multiply", dt, term, weights[a][bits[a]])
                total = term if total is None else e.op("add", dt, total, term)
            return total
        return sample

    def _bicubic(self, e, coords, sizes):
        dt = self.out.dtype
        taps, weights = [], []
        for v, n in zip(coords, sizes):
            low = e.let(e.op("astype", dt, e.op("floor", dt, v), to="int64"))
            weights.append(_cubic_weights(e, dt, e.op("subtract", dt, v, e.as_float(low, dt))))
            taps.append([self._tap(e, e.add(low, j - 1), n) for j in range(4)])

        def sample(plane):
            rows = [_cubic(e, dt, [self._pixel(e, plane, [y, xx]) for xx in taps[1]], weights[1])
                    for y in taps[0]]
            return _cubic(e, dt, rows, weights[0])
        return sample

    def _tap(self, e, i, size):
        """A bicubic tap's pixel index after the padding mode (TVM: int clamp for border;
        reflection of the index as a float, clamp, truncation)."""
        if self.padding == "border":
            return clamped(e, i, size)
        if self.padding == "reflection":
            dt = self.out.dtype
            return e.let(e.op("astype", dt, self._placed(e, e.as_float(i, dt), size), to="int64"))
        return i

    @staticmethod
    def reference(x, grid, method="bilinear", padding="zeros", align_corners=False):
        """The same formulas in numpy (float64 inside): vectorized over all points."""
        k, sizes = x.ndim - 2, x.shape[2:]
        coords = [(g + 1) * (n - 1) / 2 if align_corners else -0.5 + (g + 1) * n / 2
                  for g, n in ((grid[:, k - 1 - a].astype(np.float64), sizes[a]) for a in range(k))]

        def placed(v, n):
            if padding == "reflection":
                span, corner = (n - 1, 0.0) if align_corners else (n, -0.5)
                dist = np.abs(corner - v)
                times = np.trunc(dist) // span
                extra = dist - times * span
                mirrored = np.where(times % 2 == 0, extra + corner, span - extra + corner)
                v = np.where((v >= corner) & (v <= span + corner), v, mirrored)
            return np.clip(v, 0, n - 1) if padding != "zeros" else v

        def pixel(idx):
            ok = np.all([(i >= 0) & (i < n) for i, n in zip(idx, sizes)], axis=0)[:, None]
            lead = np.ix_(range(x.shape[0]), range(x.shape[1]))
            at = tuple(np.clip(i, 0, n - 1)[:, None] for i, n in zip(idx, sizes))
            pick = x[(lead[0].reshape((-1, 1) + (1,) * k), lead[1].reshape((1, -1) + (1,) * k)) + at]
            return np.where(ok, pick, 0).astype(np.float64)

        if method == "bicubic":
            return _np_bicubic(coords, sizes, placed, pixel, padding).astype(x.dtype)
        coords = [placed(v, n) for v, n in zip(coords, sizes)]
        if method == "nearest":
            return pixel([np.rint(v).astype(np.int64) for v in coords]).astype(x.dtype)
        lows = [np.floor(v).astype(np.int64) for v in coords]
        fracs = [(v - i)[:, None] for v, i in zip(coords, lows)]
        total = 0
        for bits in itertools.product((0, 1), repeat=k):
            w = np.prod([f if b else 1 - f for f, b in zip(fracs, bits)], axis=0)
            total = total + pixel([i + b for i, b in zip(lows, bits)]) * w
        return total.astype(x.dtype)


def _cubic_weights(e, dt, f):
    """Keys' weights of the four taps at fraction ``f``, as TVM writes them."""
    a = CUBIC_A

    def near(t):  # ((A + 2) t - (A + 3)) t t + 1
        inner = e.op("subtract", dt, e.op("multiply", dt, e.const(a + 2, dt), t), e.const(a + 3, dt))
        return e.op("add", dt, e.op("multiply", dt, e.op("multiply", dt, inner, t), t), e.const(1, dt))

    def far(t):  # ((A t - 5A) t + 8A) t - 4A
        inner = e.op("subtract", dt, e.op("multiply", dt, e.const(a, dt), t), e.const(5 * a, dt))
        inner = e.op("add", dt, e.op("multiply", dt, inner, t), e.const(8 * a, dt))
        return e.op("subtract", dt, e.op("multiply", dt, inner, t), e.const(4 * a, dt))

    one, two = e.const(1, dt), e.const(2, dt)
    return [far(e.op("add", dt, f, one)), near(f), near(e.op("subtract", dt, one, f)),
            far(e.op("subtract", dt, two, f))]


def _np_bicubic(coords, sizes, placed, pixel, padding):
    def weights(f):
        a = CUBIC_A
        near = lambda t: ((a + 2) * t - (a + 3)) * t * t + 1  # noqa: E731
        far = lambda t: ((a * t - 5 * a) * t + 8 * a) * t - 4 * a  # noqa: E731
        return [far(f + 1), near(f), near(1 - f), far(2 - f)]

    taps, ws = [], []
    for v, n in zip(coords, sizes):
        low = np.floor(v).astype(np.int64)
        ws.append([w[:, None] for w in weights(v - low)])
        ts = [low + j - 1 for j in range(4)]
        if padding == "border":
            ts = [np.clip(t, 0, n - 1) for t in ts]
        elif padding == "reflection":
            ts = [np.trunc(placed(t.astype(np.float64), n)).astype(np.int64) for t in ts]
        taps.append(ts)
    rows = [sum(pixel([y, xx]) * w for xx, w in zip(taps[1], ws[1])) for y in taps[0]]
    return sum(r * w for r, w in zip(rows, ws[0]))


def _cubic(e, dt, values, weights):
    total = None
    for v, w in zip(values, weights):
        term = e.op("multiply", dt, v, w)
        total = term if total is None else e.op("add", dt, total, term)
    return total


def _check(call) -> str | None:
    x, grid = call.args
    for ty in (x.ty, grid.ty, call.ty):
        problem = tensor_problem(ty, FLOATS)
        if problem:
            return f"relax.image.grid_sample: {problem}"
    xd, gd = dims(x.ty), dims(grid.ty)
    attrs = call.attrs
    if len(xd) not in LAYOUTS or str(attrs.layout) != LAYOUTS[len(xd)]:
        return f"relax.image.grid_sample: layout {attrs.layout} of a {len(xd)}-D input (supported: NCHW, NCDHW)"
    if str(attrs.method) not in METHODS[len(xd)]:
        return f"relax.image.grid_sample: method {attrs.method} (supported here: {list(METHODS[len(xd)])})"
    if str(attrs.padding_mode) not in PADDINGS:
        return f"relax.image.grid_sample: padding_mode {attrs.padding_mode} (supported: {list(PADDINGS)})"
    if len(gd) != len(xd) or gd[1] != len(xd) - 2 or str(grid.ty.dtype) != str(x.ty.dtype):
        return "relax.image.grid_sample: the grid is not (N, k, *out) of the data's dtype"
    if 0 in xd or 0 in dims(call.ty):
        return "relax.image.grid_sample: empty input or result"
    if str(attrs.padding_mode) == "reflection" and bool(attrs.align_corners) and \
            not all(isinstance(d, int) and d > 1 for d in xd[2:]):
        return "relax.image.grid_sample: reflection with align_corners needs static spatial dims > 1"
    return None


@register("relax.image.grid_sample", 2, _check)
def _build(fe, call, out):
    a = call.attrs
    return GridSample((fe.buffer(call.args[0]), fe.buffer(call.args[1])), out, method=str(a.method),
                      padding=str(a.padding_mode), align_corners=bool(a.align_corners))
