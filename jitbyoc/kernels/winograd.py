"""3x3 stride-1 float32 convolutions by Winograd's minimal filtering, F(4x4, 3x3) by
default, F(2x2, 3x3) on request (Lavin and Gray, *Fast Algorithms for Convolutional
Neural Networks*, 2016; F(4x4)'s points 0, 1, -1, 2, -2 and infinity, as oneDNN's CPU
Winograd kernels use them).

The output is cut into m x m tiles, each computed from an (m + 2) x (m + 2) tile of the
(zero-padded) input: ``Y = A^T [ sum_c (G g_kc G^T) * (B^T d_c B) ] A``. The weight's
transform ``U = G g G^T`` ((m + 2)^2 numbers per output and input channel) is computed
once at build time (:func:`transformed_weight`, on a writer thread while partitioning
goes on), so per tile the ``9 C`` multiply-adds
of each output become ``(m + 2)^2 C / m^2``: a quarter of them for F(4x4), 1/2.25 for
F(2x2). Three passes, each on the thread pool, each a library engine shared by every
layer (:mod:`jitbyoc.engines.winograd`, :mod:`jitbyoc.engines.gemm_engine`):

1. the input transform, ``V[n, xi, c, tile]``, ``xi`` one of the (m + 2)^2 points;
2. one matrix product per point, ``M[n, xi] (K x T) = U[xi] (K x C) @ V[n, xi] (C x T)``,
   ``T`` the tiles;
3. the output transform, per (image, output channel) plane, then the region's epilogue
   on the plane while it is in cache (a callback).

The weight reaches the kernel as one constant ``P`` of shape ``(p + 9, K, C)``, ``p =
(m + 2)^2``: ``U`` in its first ``p`` rows, the OIHW weight itself in the last 9 (the
Relax graph reads it as ``reshape(strided_slice(P, p .. p + 9), (K, C, 3, 3))``, so a
build that leaves the convolution to TVM computes the same thing, and the C rendering
runs the direct loop nest on it; :func:`jitbyoc.tvm.conv_weights.winograd_conv` and
:func:`jitbyoc.kernels.fold_permutes.fold_winograd_weights`).

Accuracy. Every result is within :func:`error_bound` of the exact convolution:
``gamma_n * A_abs^T [ sum_c |U_c| * (B_abs^T |d_c| B_abs) ] A_abs`` elementwise, with
``|U_c| = G_abs |g| G_abs^T`` (``_abs``: the matrices' absolute values), ``n = C +
ROUNDINGS`` roundings on any path from an operand to a result (the transforms' sums,
the weight's rounding to float32, the product's ``C`` steps) and ``gamma_n = n u / (1 -
n u)``, ``u = 2**-24`` (Higham, *Accuracy and Stability*, 3.1 and 3.5). F(4x4)'s
coefficients (up to 8 and 5) make it larger than the direct convolution's ``9 C u sum
|x w|``. Measured on ResNet-50's three 3x3 shapes (random inputs, weights scaled to unit
output variance; ``JITBYOC_WINOGRAD=0/2/4``): F(4x4)'s largest error is 6-7x the
direct engine's and its rms error 3.5-4x; F(2x2)'s is half the direct engine's (its sums
over channels are ``C`` long, not ``9 C``).
"""

from __future__ import annotations

import math

import numpy as np

from ..context import env_number, log
from ..engines import registry, winograd as engines
from ..engines.winograd import DTYPE, F23, F43, Transform
from ..ir import kir
from ..ir.llvmtypes import I64
from ..render.vectors import lanes
from .matmul import MatMul

ROUNDINGS = 24  # roundings outside the product's C steps on any path (see the module text)
# DTYPE is float32 only: the engines' other products (bf16 pairs, int8 quads) sum exactly
# or in their own units, and a transform would change their rounding


BY_ROWS = {tf.points ** 2 + 9: tf for tf in (F43, F23)}  # the transform a packed weight's rows say


def setting() -> int | None:
    """``JITBYOC_WINOGRAD``: unset (the default) F(4x4, 3x3), or F(2x2, 3x3) on small maps
    (:func:`chosen`); 4 F(4x4) on every map; 2 F(2x2, 3x3), a twelfth of F(4x4)'s error
    (half the direct convolution's) and 2.25x fewer multiplications than direct
    convolution instead of 4x; 0 off (every such convolution runs direct). Anything else
    is the default, with a warning."""
    value = env_number("JITBYOC_WINOGRAD", None)
    if value not in (None, 0, 2, 4):
        log.warning("jitbyoc: JITBYOC_WINOGRAD=%r is not 0, 2 or 4; using the default", value)
        return None
    return value


def fits(geo, dt: str) -> bool:
    """Whether a convolution runs here: float32, 3x3, unit stride and dilation, one group,
    padding of at most 2 a side (what a tile's 3x3 windows reach), and a map and channel
    counts where the transforms pay (see :data:`MIN_CHANNELS`)."""
    return (dt == DTYPE and (geo.kh, geo.kw) == (3, 3) and geo.stride == (1, 1) and geo.dilation == (1, 1)
            and geo.groups == 1 and max(geo.pad) <= 2 and min(geo.oh, geo.ow) >= MIN_MAP
            and min(geo.c, geo.k) >= MIN_CHANNELS)


MIN_MAP = 8  # output rows and columns: a 7x7 map is 2x2 tiles of which 64 % is used
MIN_CHANNELS = 16  # input and output channels: the products run on the GEMM engine
# F(4x4) tiles an image needs for F(4x4) to be the default; fewer (maps up to 16x16) run
# F(2x2). Each point's product multiplies a K x C slice of U by the image's tiles: with one
# vector of 16 tiles each weight does one multiply-add per load, and U (four times the
# weight) comes from memory inside a model. F(2x2) has 2.25x the tiles (49 on 14x14) and
# 16 rows of U for 36. Measured on Zen 5 (whole models, both builds in one process, 10-14
# rounds in turns): Inception v2 0.90-0.91x the time, ZFNet-512 0.88x, Inception v1 0.94x,
# DenseNet-121 0.95x, ResNet-50 0.975x, VGG-19 0.99x; also F(2x2) on 28x28 (Inception v2
# 0.92x: worse than on 14x14 alone) and on 7x7 maps (0.96x, worse) were tried.
SMALL_MAP_TILES = 16


def chosen(geo) -> Transform | None:
    """The transform :func:`setting` asks for on ``geo``'s map, None when off; by default
    F(2x2) where F(4x4) would cut the map into at most :data:`SMALL_MAP_TILES` tiles."""
    value = setting()
    if value is None:
        return F23 if math.prod(tiles(geo, F43)) <= SMALL_MAP_TILES else F43
    return {4: F43, 2: F23}.get(value)


def tiles(geo, tf: Transform) -> tuple[int, int]:
    """Rows and columns of output tiles."""
    return -(-geo.oh // tf.tile), -(-geo.ow // tf.tile)


def transformed_weight(w: np.ndarray, tf: Transform, out: np.ndarray | None = None) -> np.ndarray:
    """``U[a * points + b, k, c] = (G w[k, c] G^T)[a, b]`` in float64, rounded once to
    float32 (into ``out`` when given): ``kron(G, G) @ w`` with the 9 taps as the
    reduction, a block of :data:`PAIRS_BLOCK` (k, c) pairs at a time (an einsum over (k, c) took
    seconds for VGG-19's 20 M weights; one product with float64 temporaries of the whole
    weight, 0.2 s for one 512 x 512 layer, most of it faulting the temporaries in)."""
    k, c = w.shape[:2]
    pairs, p = k * c, tf.points ** 2
    taps = np.asarray(w, np.float32).reshape(pairs, 9)
    out = np.empty((p, k, c), np.float32) if out is None else out
    flat = out.reshape(p, pairs)
    kron = np.kron(tf.g, tf.g)
    block = np.empty((p, min(pairs, PAIRS_BLOCK)))
    for lo in range(0, pairs, PAIRS_BLOCK):
        n = min(PAIRS_BLOCK, pairs - lo)
        np.matmul(kron, taps[lo:lo + n].T.astype(np.float64), out=block[:, :n])
        flat[:, lo:lo + n] = block[:, :n]
    return out


# (k, c) pairs transformed at a time: small enough that numpy's OpenBLAS keeps each product
# on the calling thread (it threads a dgemm above M*N*K = 4 * 65536; 36 * 9 * 512 is 165,888).
# A threaded product left OpenBLAS's threads spinning for ~0.1 s after the build (103 ms of CPU
# while the process slept, against 0.1): they took a core from the model's first calls (a
# 64@56 layer ran at its one-thread speed, 750-860 us against 375-440, for its first 40-80
# calls, with ~6 involuntary context switches a call) and from the build's compile workers
# (VGG-19 built in 2.23-2.53 s, now 1.98-2.03). A 512 x 512 layer: 14 ms on one thread,
# 11.4 on two.
PAIRS_BLOCK = 512


def packed_weight(w: np.ndarray, tf: Transform, out: np.ndarray | None = None) -> np.ndarray:
    """``P`` (points^2 + 9, K, C): :func:`transformed_weight` then ``w`` itself, as it lies
    (into ``out`` when given: the build writes it on a writer thread,
    :func:`jitbyoc.tvm.constants.filled_constant`)."""
    k, c = w.shape[:2]
    p = tf.points ** 2
    packed = np.empty((p + 9, k, c), np.float32) if out is None else out
    transformed_weight(w, tf, packed[:p])
    packed[p:] = np.asarray(w, np.float32).reshape(9, k, c)
    return packed


def reference(x: np.ndarray, w: np.ndarray, padding=(1, 1, 1, 1), tf: Transform = F43) -> np.ndarray:
    """The algorithm in float64 (NCHW, OIHW, stride 1): tiles, transforms, sums over channels."""
    return _tiled(x.astype(np.float64), w.astype(np.float64), padding, tf, abs_=False)


def error_bound(x: np.ndarray, w: np.ndarray, padding=(1, 1, 1, 1), tf: Transform = F43) -> np.ndarray:
    """The bound of the module text for ``conv2d(x, w)`` (NCHW, OIHW, stride 1), per output."""
    magnitude = _tiled(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64), padding, tf, abs_=True)
    steps, u = x.shape[1] + ROUNDINGS, 2.0 ** -24
    return steps * u / (1 - steps * u) * magnitude


def _tiled(x, w, padding, tf: Transform, abs_: bool) -> np.ndarray:
    """``at [sum_c (g w g^T) * (bt d bt^T)] at^T`` over the tiles ``d`` of ``x`` padded (the
    matrices' absolute values with ``abs_``)."""
    bt, g, at = (np.abs(m) if abs_ else m for m in (tf.bt, tf.g, tf.at))
    m, pts = tf.tile, tf.points
    pt, pl, pb, pr = padding
    n, c, h, wd = x.shape
    oh, ow = h + pt + pb - 2, wd + pl + pr - 2
    ty, tx = -(-oh // m), -(-ow // m)
    xp = np.zeros((n, c, max(m * ty + 2, h + pt), max(m * tx + 2, wd + pl)))
    xp[:, :, pt:pt + h, pl:pl + wd] = x
    rows = np.arange(ty)[:, None] * m + np.arange(pts)
    cols = np.arange(tx)[:, None] * m + np.arange(pts)
    d = xp[:, :, rows[:, :, None, None], cols[None, None]]  # n, c, ty, points, tx, points
    v = np.einsum("ai,ncyixj,bj->ncyxab", bt, d, bt)
    u = np.einsum("ai,kcij,bj->kcab", g, w, g)
    y = np.einsum("pa,nkyxab,qb->nkypxq", at, np.einsum("kcab,ncyxab->nkyxab", u, v), at)
    return y.reshape(n, w.shape[0], m * ty, m * tx)[:, :, :oh, :ow]


# ---- LLVM -------------------------------------------------------------------------------------

def tile_lanes(geo, tf: Transform) -> int:
    """Tiles per vector: one vector of float32, fewer for a narrow map (a power of two)."""
    tx, n = tiles(geo, tf)[1], lanes(DTYPE)
    while n // 2 >= tx and n > 2:
        n //= 2
    return n


def emit(stage, ctx) -> None:
    """The input transform (an engine), one product per point on the GEMM engine, and the
    output transform (an engine) calling back the region's epilogue per plane, at
    ``ctx``'s insertion point (``stage.work``: ``V``, ``stage.sums``: ``M``)."""
    g, (x, packed) = stage.geo, stage.inputs
    tf = BY_ROWS[packed.shape[0]]
    (ty, tx), nl, n = tiles(g, tf), tile_lanes(g, tf), lanes(DTYPE)
    width = -(-(tf.tile * ((-(-tx // nl)) * nl + 1)) // n) * n  # a scratch row: what the shuffles read
    pointer = lambda buf: ctx.element(buf, I64(0))  # noqa: E731
    registry.call(ctx, engines.WinogradInput(tf.tile, nl, n), [pointer(x), pointer(stage.work), ctx.dim(g.n), g.c, g.h,
                                                                g.w, g.pad[0], g.pad[1], ty, tx, ty * tx, width])
    lead, xi = (() if g.n == 1 else (g.n,)), tf.points ** 2
    product = MatMul((kir.view(packed, (xi, g.k, g.c)), kir.view(stage.work, lead + (xi, g.c, ty * tx))),
                     kir.view(stage.sums, lead + (xi, g.k, ty * tx)), stream_a=True)  # A: the weight
    product.emit_llvm(ctx)

    def epilogue(c, args):
        c.epilogue(stage, [args[0], args[1]] + [I64(0)] * (stage.out.ndim - 2), [1, 1] + list(stage.out.shape[2:]))

    epi, env = ctx.outline("epi", 2, epilogue)  # empty without an epilogue: the engine calls it
    registry.call(ctx, engines.WinogradOutput(tf.tile, nl), [pointer(stage.sums), pointer(stage.out), ctx.dim(g.n),
                                                              g.k, g.oh, g.ow, ty, tx, ty * tx, epi, env])


def workspaces(geo, tf: Transform) -> tuple[tuple, tuple]:
    """Shapes of ``V`` and ``M``."""
    ty, tx = tiles(geo, tf)
    xi = tf.points ** 2
    return (geo.n, xi, geo.c, ty * tx), (geo.n, xi, geo.k, ty * tx)
