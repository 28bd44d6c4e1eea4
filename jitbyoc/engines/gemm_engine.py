"""The GEMM engine as a library engine (:mod:`jitbyoc.library`): one compiled product per
(dtype, batch rank, unit-stride side of A, of B), sizes and strides given at run time;
products with up to :data:`BATCH_RANK` batch dims share the rank-``BATCH_RANK`` engine.

The engine is the same driver as an inline product (:mod:`.gemm_llvm`) emitted with every
size symbolic; what must be static to pick packers and in-place reads (which stride of
each operand is 1) is its template. The region passes pointers, sizes, strides, and its
epilogue as a callback ``epi(env, batch item, m0, mc, n0, nc)`` made with
:meth:`~jitbyoc.render.llvm.Ctx.outline`.

Cost: edge tiles use the symbolic-size microkernel set (full, one row, one vector, and
masked), where an inline product had one sized to its static remainder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llvmlite import ir

from ..ir.dtypes import dtype as lookup_dtype
from ..ir.llvmtypes import I32, I64
from . import registry
from .gemm import Gemm, Output, Panels, Strided, _dims, _is_one, panel_width, static_size
from .gemm_llvm import emit
from .gemm_micro import GEMM_PIPELINE
from .gemv import emit_gemv, emit_gemv_columns

BATCH_RANK = 4  # the smallest engine batch rank (see call)


def _unit(operand: Strided | Panels) -> str:
    """Which stride of ``operand`` is statically 1: "x", "k", or "n" (neither); "p" for
    :class:`~.gemm.Panels` (x is 1 within a panel); "xp" for "x" packed all the same."""
    if isinstance(operand, Panels):
        return "p"
    unit = "x" if _is_one(operand.x) else "k" if _is_one(operand.k) else "n"
    return unit + "p" if unit == "x" and operand.packed else unit


def _strides(operand: Strided | Panels) -> tuple:
    """The two run-time strides the engine takes for ``operand``: x then k (for Panels,
    the panel height K and the width)."""
    if isinstance(operand, Panels):
        return operand.k_size, operand.width
    return operand.x, operand.k


@registry.kind
@dataclass(frozen=True)
class GemmEngine(registry.Engine):
    kind = "gemm"
    pipeline = GEMM_PIPELINE
    dtype: str
    batch: int
    a: str  # _unit of A
    b: str  # _unit of B

    def names(self) -> list[str]:
        r = range(self.batch)
        return (["a", "b", "c", "m", "n", "k"] + [f"ab{i}" for i in r] + ["ax", "ak"]
                + [f"bb{i}" for i in r] + ["bx", "bk"] + [f"cb{i}" for i in r] + ["crow"]
                + [f"d{i}" for i in r] + ["epi", "env", "stream_a"])

    def emit(self, module: ir.Module, fn: ir.Function) -> None:
        ctx, bufs = registry.open_params(self, module, fn, self.names(), "abc", self.dtype)
        r = range(self.batch)

        def operand(x: str, unit: str) -> Strided | Panels:
            batch = tuple(f"{x}b{i}" for i in r)
            if unit == "p":
                return Panels(bufs[x], batch, f"{x}x", panel_width(self.dtype))
            return Strided(bufs[x], batch, 1 if unit in ("x", "xp") else f"{x}x", 1 if unit == "k" else f"{x}k",
                           unit == "xp")

        g = Gemm("m", "n", "k", operand("a", self.a), operand("b", self.b),
                 Output(bufs["c"], tuple(f"cb{i}" for i in r), "crow"), self.dtype,
                 tuple(f"d{i}" for i in r), _callback, stream_a="stream_a")
        if self.a == "k" and self.b in ("k", "x"):  # A's row contiguous: one row is a GEMV
            b, one = ctx.b, I64(1)
            single = b.icmp_signed("==", ctx.syms["m"], one)
            for i in r:
                single = b.and_(single, b.icmp_signed("==", ctx.syms[f"d{i}"], one))
            with b.if_then(single):
                (emit_gemv if self.b == "k" else emit_gemv_columns)(ctx, bufs, self.dtype, _callback, self.batch)
                b.ret(I32(0))
        emit(g, ctx)
        ctx.b.ret(I32(0))


def _callback(ctx, bidx, m0, mc, n0, nc) -> None:
    """Call the region's epilogue (if any) on a finished block."""
    b = ctx.b
    epi = ctx.syms["epi"]
    with b.if_then(b.icmp_unsigned("!=", epi, I64(0))):
        flat = I64(0)
        for i, index in enumerate(bidx):
            flat = b.add(b.mul(flat, ctx.syms[f"d{i}"]), index)
        registry.call_back(b, epi, ctx.syms["env"], [flat, m0, mc, n0, nc])


def fits(g: Gemm) -> bool:
    """Whether ``g`` can run on the engine (dense operands, as every matmul has; panels
    packed for this machine's engine; a float product: one of units of several k reads
    its A in place only where static strides say the rows hold whole units, see
    :func:`.gemm_llvm.a_in_place`)."""
    if g.product.group > 1:  # units of several k: inline, where A's strides are known
        return False
    return isinstance(g.a, Strided) and (isinstance(g.b, Strided) or isinstance(g.b, Panels)
                                         and g.b.width == g.nr)


def _row_major(b) -> bool:
    """Whether ``b`` is a B in a buffer with contiguous rows, read in place unless packed."""
    return isinstance(b, Strided) and _is_one(b.x) and not b.packed


def _one_panel(g: Gemm) -> Gemm:
    """``g`` with a row-major B exactly one panel wide (``N = NR``, rows ``NR`` apart: the
    per-head ``K x 64`` weights of attention's projections) read as the panel it is, so
    a model's products share the panel engine instead of compiling the in-place one too.
    Only for a static stack of more than one row: one row keeps the in-place engine's GEMV."""
    b, rows, k = g.b, static_size(g.m), static_size(g.k)
    if not (_row_major(b) and static_size(b.k) == g.nr == static_size(g.n)
            and rows is not None and rows > 1 and k is not None):
        return g
    return replace(g, b=Panels(b.buf, b.batch, k, g.nr))


PACK_B_MIN_ROWS = 512  # see _wide_rows_packed
PACK_B_MIN_ROW_BYTES = 8192


def _wide_rows_packed(g: Gemm) -> Gemm:
    """``g`` with a row-major B packed rather than read in place when its rows are 8 KB or
    more apart (each k step of a micro-panel on another page) and a static stack of at
    least 512 rows reuses each panel enough to pay for packing. Measured on znver4, one
    process, exported builds alternating, GFLOP/s in place vs packed: 512x2048x2048 192
    vs 207, 2048^3 203 vs 210 and 189 vs 193; level at 1024^3 and 256x1024x3072; in
    place better at 64x2048x2048 (156 vs 142) and 500x512x1536 (201 vs 198)."""
    if not _row_major(g.b):
        return g
    rows, stride = static_size(g.m), static_size(g.b.k)
    if rows is None or stride is None or rows < PACK_B_MIN_ROWS \
            or stride * lookup_dtype(g.dtype).nbytes < PACK_B_MIN_ROW_BYTES:
        return g
    return replace(g, b=replace(g.b, packed=True))


def call(g: Gemm, ctx) -> None:
    """Emit a call of the engine for ``g`` at ``ctx``'s insertion point. Products with
    fewer than :data:`BATCH_RANK` batch dims call the rank-``BATCH_RANK`` engine with
    leading dims of size 1 (stride 0): one engine serves plain, batched and attention
    products alike, so a model pays its compile time once."""
    g = _wide_rows_packed(_one_panel(g))
    r = len(g.batch)  # an operand may list more batch strides than the product has batch dims
    pad = [I64(0)] * (max(r, BATCH_RANK) - r)
    engine = GemmEngine(g.dtype, r + len(pad), _unit(g.a), _unit(g.b))
    size = lambda s: ctx.product(_dims(s))  # noqa: E731
    if g.epilogue is None:
        epi, env = I64(0), I64(0)
    else:
        def body(c, args):
            flat, m0, mc, n0, nc = args
            g.epilogue(c, c.unravel(flat, g.batch) if g.batch else [], m0, mc, n0, nc)
        epi, env = ctx.outline("epi", 5, body)
    slots = [ctx.element(g.a.buf, I64(0)), ctx.element(g.b.buf, I64(0)), ctx.element(g.c.buf, I64(0)),
             size(g.m), size(g.n), size(g.k)]
    slots += pad + [size(s) for s in g.a.batch[:r]] + [size(g.a.x), size(g.a.k)]
    slots += pad + [size(s) for s in g.b.batch[:r]] + [size(s) for s in _strides(g.b)]
    slots += pad + [size(s) for s in g.c.batch[:r]] + [size(g.c.row)]
    slots += [I64(1)] * len(pad) + [ctx.dim(d) for d in g.batch] + [epi, env, I64(int(bool(g.stream_a)))]
    registry.call(ctx, engine, slots)
