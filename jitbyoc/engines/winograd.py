"""The transforms of Winograd's minimal filtering F(m x m, 3x3) as library engines, sizes
at run time (:mod:`jitbyoc.kernels.winograd` is the convolution: which ones, the weight's
transform, accuracy): one compiled input transform and one output transform per (m,
tiles per vector) serve every layer. Specialized to each layer, VGG-19's eight shapes
took 2 s more to build than the direct convolution.

* :class:`WinogradInput` (``V[n, xi, c, tile]``, ``xi`` one of the (m + 2)^2 points): per
  (image, channel) plane and row of tiles, the m + 2 input rows combined by ``B^T`` down
  the columns, a vector along the row at a time, into a stack scratch; then across, a
  vector of ``nl`` tiles at a time (each row's every m-th element, by shuffles).
* :class:`WinogradOutput`: per (image, output channel) plane, ``A^T M A`` for a vector of
  tiles at a time, interleaved back into rows; then the region's epilogue callback on the
  finished plane, ``epi(env, n, k)``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from llvmlite import ir

from ..ir.llvmtypes import F32, I32, I64
from ..render.loops import for_range
from ..render.vectors import SplatConstant, concatenated, lane_mask, multiply_add, splat, vload, vstore
from . import registry

DTYPE = "float32"


@dataclass(frozen=True)
class Transform:
    """F(m x m, 3x3): ``tile`` (m) outputs a side from ``points`` = m + 2 inputs a side."""
    tile: int
    bt: np.ndarray = field(repr=False)
    g: np.ndarray = field(repr=False)
    at: np.ndarray = field(repr=False)

    @property
    def points(self) -> int:
        return self.tile + 2


F43 = Transform(4, np.array([[4, 0, -5, 0, 1, 0],
                             [0, -4, -4, 1, 1, 0],
                             [0, 4, -4, -1, 1, 0],
                             [0, -2, -1, 2, 1, 0],
                             [0, 2, -1, -2, 1, 0],
                             [0, 4, 0, -5, 0, 1]], dtype=np.float64),
                np.array([[1 / 4, 0, 0],
                          [-1 / 6, -1 / 6, -1 / 6],
                          [-1 / 6, 1 / 6, -1 / 6],
                          [1 / 24, 1 / 12, 1 / 6],
                          [1 / 24, -1 / 12, 1 / 6],
                          [0, 0, 1]], dtype=np.float64),
                np.array([[1, 1, 1, 1, 1, 0],
                          [0, 1, -1, 2, -2, 0],
                          [0, 1, 1, 4, 4, 0],
                          [0, 1, -1, 8, -8, 1]], dtype=np.float64))
F23 = Transform(2, np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64),
                np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64),
                np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64))
TRANSFORMS = {tf.tile: tf for tf in (F43, F23)}

INPUT_NAMES = ("x", "v", "n", "c", "h", "w", "pt", "pl", "ty", "tx", "t", "width")
OUTPUT_NAMES = ("m", "out", "n", "k", "oh", "ow", "ty", "tx", "t", "epi", "env")


def _combined(b, coefficients, vectors):
    """``sum_i coefficients[i] * vectors[i]`` (small constants: zeros skipped, +-1 an add)."""
    total = None
    for coef, v in zip(coefficients, vectors):
        if coef == 0:
            continue
        scaled = SplatConstant(F32(float(coef)), v.type.count)
        if total is None:
            total = v if coef == 1 else b.fmul(v, scaled)
        elif abs(coef) == 1:
            total = b.fadd(total, v) if coef == 1 else b.fsub(total, v)
        else:
            total = multiply_add(b, v, scaled, total)
    return total


def _picked(b, v, picks):
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(picks)), list(picks)))


def _lanes_between(b, first, lo, hi, n: int):
    """The ``n`` lanes ``l`` with ``lo <= first + l < hi`` (i64 values) as an i1 vector
    (:func:`lane_mask` where only the upper bound can cut)."""
    at = b.add(splat(b, first, n), ir.Constant(ir.VectorType(I64, n), list(range(n))))
    return b.and_(b.icmp_signed(">=", at, splat(b, lo, n)), b.icmp_signed("<", at, splat(b, hi, n)))


def _scratch_at(b, scratch, offset, n: int):
    """A pointer to ``n`` floats at ``offset`` (i64) of a stack scratch (allocas are typed pointers)."""
    return b.bitcast(b.gep(scratch, [offset], source_etype=F32), ir.PointerType(ir.VectorType(F32, n)))


def _flat(b, *terms):
    """``((t0 * t1 + t2) * t3 + t4) ...``: a row-major offset from (index, size) pairs."""
    total = terms[0]
    for size, index in zip(terms[1::2], terms[2::2]):
        total = b.add(b.mul(total, size), index)
    return total


class _Engine(registry.Engine):
    """An engine of one transform (``tile``) on vectors of ``nl`` tiles: its parameters
    ``names`` (the first two pointers), its planes ``n x names[planes]``, each task's
    planes written by ``self._planes(ctx, buffers, lo, hi)``."""
    names: ClassVar[tuple] = ()
    planes: ClassVar[str] = ""
    # lean passes (explicit vectors, nothing for LLVM's loop passes to add): 30 ms to
    # compile an engine instead of 59 (level 1), at the same speed (best of 7 x 30 calls,
    # four alternating processes: 256@14 495-574 us against 510-673, 64@56 376-441 against
    # 381-872)
    pipeline: ClassVar[registry.Pipeline] = registry.Pipeline(speed_level=0, vectorize=False, lsr=False)

    @property
    def tf(self) -> Transform:
        return TRANSFORMS[self.tile]

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        ctx, bufs = registry.open_params(self, module, fn, self.names, self.names[:2], DTYPE)
        s = ctx.syms
        ctx.parallel_for(ctx.b.mul(s["n"], s[self.planes]), lambda c, lo, hi, _: self._planes(c, bufs, lo, hi))
        ctx.b.ret(I32(0))


@contextmanager
def _tile_blocks(b, s, ty, nl: int):
    """A loop over the vectors of ``nl`` tiles of row ``ty`` of tiles: yields the first
    tile's column, the lanes that are tiles, and the first tile's index."""
    with for_range(b, b.sdiv(b.add(s["tx"], I64(nl - 1)), I64(nl)), "block") as block:
        first = b.mul(block, I64(nl))
        yield first, lane_mask(b, b.sub(s["tx"], first), nl), b.add(b.mul(ty, s["tx"]), first)


@registry.kind
@dataclass(frozen=True)
class WinogradInput(_Engine):
    kind = "winoin"
    names = INPUT_NAMES
    planes = "c"
    tile: int
    nl: int
    lanes: int

    def _planes(self, c, bufs, lo, hi) -> None:
        b, s = c.b, c.syms
        with b.goto_block(b.function.entry_basic_block):
            scratch = b.alloca(F32, b.mul(s["width"], I64(self.tf.points)))
        with for_range(b, hi, "plane", start=lo) as plane, for_range(b, s["ty"], "ty") as ty:
            self._rows(c, bufs["x"], plane, ty, scratch)
            self._tiles(c, bufs["v"], plane, ty, scratch)

    def _rows(self, c, x, plane, ty, scratch) -> None:
        """Scratch row ``a`` = ``sum_i bt[a, i] * input row (m ty - pt + i)``, columns from
        ``-pl``, a vector at a time (masked outside the input)."""
        b, s, tf, n = c.b, c.syms, self.tf, self.lanes
        zero = I64(0)
        rows = []
        for i in range(tf.points):
            r = b.add(b.mul(ty, I64(tf.tile)), b.sub(I64(i), s["pt"]))
            inside = b.and_(b.icmp_signed(">=", r, zero), b.icmp_signed("<", r, s["h"]))
            rows.append((_flat(b, plane, s["h"], r, s["w"], b.sub(zero, s["pl"])), splat(b, inside, n)))
        with for_range(b, b.sdiv(s["width"], I64(n)), "cv") as cv:
            col0 = b.mul(cv, I64(n))
            cols = _lanes_between(b, b.sub(col0, s["pl"]), zero, s["w"], n)
            # not inbounds: at the map's left edge a vector starts before the row (those lanes are masked)
            values = [vload(b, b.gep(c.ptrs[x.storage], [b.add(start, col0)], source_etype=F32), DTYPE,
                            b.and_(cols, inside), n) for start, inside in rows]
            for a in range(tf.points):
                at = b.add(col0, b.mul(I64(a), s["width"]))
                vstore(b, _combined(b, tf.bt[a], values), _scratch_at(b, scratch, at, n), DTYPE)

    def _tiles(self, c, v, plane, ty, scratch) -> None:
        """``V[n, a * points + b, c, ty * Tx + tx] = sum_j bt[b, j] * row_a[m tx + j]``, a
        vector of tiles at a time (each row's every m-th element, by shuffles)."""
        b, s, tf, nl = c.b, c.syms, self.tf, self.nl
        m, points = tf.tile, tf.points
        n, ch = b.sdiv(plane, s["c"]), b.srem(plane, s["c"])
        with _tile_blocks(b, s, ty, nl) as (first, mask, tile0):
            for a in range(points):
                at = b.add(b.mul(first, I64(m)), b.mul(I64(a), s["width"]))
                here = vload(b, _scratch_at(b, scratch, at, m * nl), DTYPE, None, m * nl)
                after = vload(b, _scratch_at(b, scratch, b.add(at, I64(m)), m * nl), DTYPE, None, m * nl)
                phases = [_picked(b, here, [m * l + j for l in range(nl)]) for j in range(m)]
                phases += [_picked(b, after, [m * l + j for l in range(nl)]) for j in range(points - m)]
                for col in range(points):
                    row = _flat(b, n, I64(points * points), I64(a * points + col), s["c"], ch, s["t"], tile0)
                    vstore(b, _combined(b, tf.bt[col], phases), c.element(v, row), DTYPE, mask)


@registry.kind
@dataclass(frozen=True)
class WinogradOutput(_Engine):
    kind = "winoout"
    names = OUTPUT_NAMES
    planes = "k"
    tile: int
    nl: int

    def _planes(self, c, bufs, lo, hi) -> None:
        b, s = c.b, c.syms
        with for_range(b, hi, "plane", start=lo) as plane:
            with for_range(b, s["ty"], "ty") as ty:
                self._tiles(c, bufs, plane, ty)
            registry.call_back(b, s["epi"], s["env"], [b.sdiv(plane, s["k"]), b.srem(plane, s["k"])])

    def _tiles(self, c, bufs, plane, ty) -> None:
        """Output rows ``m ty .. m ty + m - 1`` of plane ``(n, k)``: ``A^T M A`` a vector of
        tiles at a time, interleaved back into rows."""
        b, s, tf, nl = c.b, c.syms, self.tf, self.nl
        m, points = tf.tile, tf.points
        n, k = b.sdiv(plane, s["k"]), b.srem(plane, s["k"])
        with _tile_blocks(b, s, ty, nl) as (first, mask, tile0):
            sums = [vload(b, c.element(bufs["m"], _flat(b, n, I64(points * points), I64(xi), s["k"], k,
                                                             s["t"], tile0)), DTYPE, mask, nl)
                    for xi in range(points * points)]
            across = [[_combined(b, tf.at[q], sums[a * points:(a + 1) * points]) for q in range(m)]
                      for a in range(points)]
            ow0 = b.mul(first, I64(m))
            cols = lane_mask(b, b.sub(s["ow"], ow0), m * nl)
            for p in range(m):
                y = [_combined(b, tf.at[p], [across[a][q] for a in range(points)]) for q in range(m)]
                row = _picked(b, concatenated(b, y), [q * nl + l for l in range(nl) for q in range(m)])
                oy = b.add(b.mul(ty, I64(m)), I64(p))
                keep = b.and_(cols, splat(b, b.icmp_signed("<", oy, s["oh"]), m * nl))
                vstore(b, row, c.element(bufs["out"], _flat(b, plane, s["oh"], oy, s["ow"], ow0)), DTYPE, keep)
