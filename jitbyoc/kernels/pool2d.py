"""relax.nn.max_pool2d, relax.nn.avg_pool2d and relax.nn.adaptive_avg_pool2d (NCHW); max
and avg pool1d (NCW) and pool3d (NCDHW, windows trivial along depth or along rows and
columns, as ONNX's LRN gives) as 2-D pools of views.

Threads take (image, channel) planes, or (plane, row band) tasks where there are fewer
than 8 planes (ONNX's LRN: one plane of C rows; :func:`.pool_planes.row_bands`), written
once against the portable facade
(:mod:`.pool_planes`): LLVM and C render the same algorithm. Float pools with a column
stride of at most 4 combine each window in a register, per vector of output columns (in
C, per output column), taps outside the input masked to the identity: a loop over the
interior vectors, the edge vectors unrolled. Stride-1 max pools over maps at most half a
vector wide (a quantized graph's uint8 13x13 on 64 lanes) take each plane as one flat run
instead, several rows a vector, one load per vector and tap under a constant mask
(:func:`.pool_planes.runs_flat`). Other windowed pools run per output row:
the row is set to the identity, then for each kernel row inside the input and each
kernel column it is combined with one strided input row over the *static* range of
output columns whose tap lies inside the input. That loop has no branches, so LLVM
vectorizes it (strided loads become interleaved loads); edges need no special case.
Averages are divided by the window count afterwards. Adaptive pooling sums each bin in
order (scalar).

Semantics follow TVM's topi: max pools start from the lowest finite value (TVM pads
with it), averages divide by ``max(count, 1)`` where ``count`` counts the window clipped
to the input (``count_include_pad=False``) or to the padded input (True), never the
extra ``ceil_mode`` cells.

A bfloat16 pool (max, average, adaptive) runs as TVM's build computes one: each value
widened to float32 (exact), the window pooled in float32 into a temp, the result rounded
to bfloat16 once by the epilogue, plane by plane (:func:`_builder`; a max rounds exactly).

Accuracy: max pooling is exact. Every average adds its window in TVM's order (kernel
row, then column; padding skipped, which only changes the sign of a zero sum) and
divides once, so results match TVM's default build exactly in both renderings; against
the float64 numpy reference the error is at most ``count * eps`` relative to the sum of
magnitudes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import BF16, FLOATS, NUMERIC
from ..ir.relax_types import dims, operands_problem
from ..ir.rules import register
from ..render.portable import PortableStage
from .pool_planes import emit_pool, lowest


@dataclass(frozen=True)
class PoolKind:
    adaptive: bool  # adaptive bins (else windows of ``size``, ``stride``, ``dilation``)
    average: bool  # the sum divided by the count (else the max, from the lowest finite value)


POOL_KINDS = {"max": PoolKind(False, False), "avg": PoolKind(False, True),
              "adaptive": PoolKind(True, True)}


def window_taps(ops, o, size: int, k: int, stride: int, dilation: int, before: int, after: int,
                include_pad: bool):
    """TVM's divisor factor along one dim for output index ``o``: the window's taps inside
    the input, or (``count_include_pad``) inside the padded input but not the extra cells
    of ``ceil_mode``. ``ops``: an integer facade (:class:`jitbyoc.render.indexing.Ints`)."""
    start = ops.sub(ops.mul(o, stride), before)
    last = ops.add(start, (k - 1) * dilation)
    if include_pad:
        return ops.add(ops.div(ops.sub(ops.min(last, size + after - 1), start), dilation), 1)
    skip = ops.max(ops.div(ops.sub(dilation - 1, start), dilation), 0)
    return ops.add(ops.div(ops.sub(ops.min(last, size - 1), ops.add(start, ops.mul(skip, dilation))), dilation), 1)


@dataclass(eq=False)
class Pool2d(PortableStage, kir.KernelStage):
    kind: str = "max"  # a key of POOL_KINDS
    size: tuple = (1, 1)
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    pad: tuple = (0, 0, 0, 0)  # top, left, bottom, right
    include_pad: bool = False
    # every path applies the epilogue to finished (plane, row band)s: pool_planes._plane_epilogue
    writes_epilogue_apart = True

    @property
    def row(self) -> PoolKind:
        return POOL_KINDS[self.kind]

    @property
    def planes(self):
        return self.out.shape[:2]

    def counts(self, d: int, o, ops):
        """Window size along dim ``d`` for output index ``o`` (TVM's divisor factor)."""
        return window_taps(ops, o, self.inputs[0].shape[2 + d], self.size[d], self.stride[d], self.dilation[d],
                           self.pad[d], self.pad[d + 2], self.include_pad)

    def col_range(self, kw: int) -> tuple[int, int]:
        """Output columns [lo, hi) whose tap ``kw`` lies inside the input."""
        w, ow = self.inputs[0].shape[3], self.out.shape[3]
        shift = kw * self.dilation[1] - self.pad[1]
        lo = max(0, -(shift // self.stride[1])) if shift < 0 else 0
        hi = min(ow, (w - 1 - shift) // self.stride[1] + 1) if w - 1 - shift >= 0 else 0
        return lo, max(lo, hi)

    def emit(self, e) -> None:
        emit_pool(self, e)

    @staticmethod
    def reference(x: np.ndarray, kind: str, out_hw, size=(1, 1), stride=(1, 1), dilation=(1, 1),
                  pad=(0, 0, 0, 0), include_pad=False) -> np.ndarray:
        """TVM's pooling semantics in float64, integers in their own dtype (``out_hw``
        fixes ceil_mode's extra cells)."""
        h, w = x.shape[2:]
        wide = x.dtype if x.dtype.kind in "iu" else np.float64
        out = np.zeros(x.shape[:2] + tuple(out_hw), wide)
        for oh in range(out_hw[0]):
            rows, ch = _ref_window(oh, 0, h, kind, out_hw, size, stride, dilation, pad, include_pad)
            for ow in range(out_hw[1]):
                cols, cw = _ref_window(ow, 1, w, kind, out_hw, size, stride, dilation, pad, include_pad)
                win = x[:, :, rows][:, :, :, cols].astype(wide)
                if not POOL_KINDS[kind].average:
                    low = lowest(x.dtype)
                    out[:, :, oh, ow] = np.maximum(win.max(axis=(2, 3)), low) if win.size else low
                else:
                    out[:, :, oh, ow] = win.sum(axis=(2, 3)) / max(ch * cw, 1)
        return out.astype(x.dtype)


def _ref_window(o, d, size, kind, out_hw, k, s, dl, pad, include_pad):
    """Input indices of output ``o`` along dim ``d`` and the window's divisor factor."""
    if POOL_KINDS[kind].adaptive:
        lo, hi = o * size // out_hw[d], -(-(o + 1) * size // out_hw[d])
        return list(range(lo, hi)), hi - lo
    start = o * s[d] - pad[d]
    valid = [i for i in range(start, start + (k[d] - 1) * dl[d] + 1, dl[d]) if 0 <= i < size]
    if include_pad:
        return valid, (min(start + (k[d] - 1) * dl[d], size + pad[d + 2] - 1) - start) // dl[d] + 1
    return valid, len(valid)


def _check(call) -> str | None:
    name = call.op.name
    x = call.args[0]
    # a max of integers is exact; averages stay floats; bfloat16 pools in float32 (_builder)
    problem = operands_problem(call, (x, call), (NUMERIC if name == "relax.nn.max_pool2d" else FLOATS) | BF16)
    if problem:
        return problem
    xd, od = dims(x.ty), dims(call.ty)
    if len(xd) != 4:
        return f"{name}: input is not rank 4"
    a = call.attrs
    layout = (str(a.layout), str(a.out_layout) if a.out_layout is not None else str(a.layout))
    if layout != ("NCHW", "NCHW"):
        return f"{name}: layout {layout[0]}->{layout[1]} not supported (only NCHW)"
    if str(x.ty.dtype) != str(call.ty.dtype):
        return f"{name}: output dtype {call.ty.dtype} differs from input {x.ty.dtype}"
    if any(isinstance(d, str) for d in xd[1:] + od[1:]) or od[:2] != xd[:2]:
        return f"{name}: only the batch dim may be symbolic"
    if name == "relax.nn.adaptive_avg_pool2d":
        return None
    if min(tuple(a.strides) + tuple(a.dilation) + tuple(a.pool_size)) < 1 or min(a.padding) < 0:
        return f"{name}: pool size/stride/dilation < 1 or negative padding"
    return None


def _builder(kind: str):
    def build(fe, call, out):
        x = fe.buffer(call.args[0])
        a = call.attrs
        ints = lambda v: tuple(int(i) for i in v)  # noqa: E731
        window = {} if POOL_KINDS[kind].adaptive else dict(
            size=ints(a.pool_size), stride=ints(a.strides), dilation=ints(a.dilation), pad=ints(a.padding),
            include_pad=bool(a.count_include_pad))
        if out.dtype != "bfloat16":
            return Pool2d((x,), out, kind=kind, **window)
        # a bfloat16 pool as TVM's build computes it: each value widened (exactly), the
        # window pooled in float32, the result rounded once (a max: exactly); the float32
        # result is a temp the epilogue rounds plane by plane, in cache
        rounded = kir.Op("astype", (kir.Acc("float32"),), "float32", "bfloat16", (("to", "bfloat16"),))
        wide = fe.temp(out.shape, "float32")
        return Pool2d((x,), wide, kind=kind, epilogue=rounded, epilogue_out=out, **window)
    return build


def as_2d(call):
    """A 1-D pool, or a 3-D pool whose window is trivial along depth or along rows and
    columns, as a 2-D pool of views: ``(x shape, out shape, size, stride, dilation, pad)``
    in 2-D terms, or why not. (ONNX's LRN reaches TVM as an avg_pool3d over channels.)"""
    a, x = call.attrs, call.args[0]
    xd, od = dims(x.ty), dims(call.ty)
    k, st, dl, pad = (tuple(int(i) for i in v) for v in (a.pool_size, a.strides, a.dilation, a.padding))
    if len(xd) not in (3, 5) or any(isinstance(d, str) for d in xd[1:]):
        return "input is not rank 3 or 5 with static dims after the batch"
    if len(xd) == 3:
        return ((*xd[:2], 1, xd[2]), (*od[:2], 1, od[2]), (1, *k), (1, *st), (1, *dl), (0, pad[0], 0, pad[1]))
    if k[1:] == (1, 1) and st[1:] == (1, 1) and pad[1:3] + pad[4:] == (0, 0, 0, 0):
        return ((*xd[:3], xd[3] * xd[4]), (*od[:3], od[3] * od[4]), (k[0], 1), (st[0], 1), (dl[0], 1),
                (pad[0], 0, pad[3], 0))
    if k[0] == 1 and st[0] == 1 and pad[0] == pad[3] == 0:
        return ((xd[0], xd[1] * xd[2], *xd[3:]), (od[0], od[1] * od[2], *od[3:]), k[1:], st[1:], dl[1:],
                (pad[1], pad[2], pad[4], pad[5]))
    return "a 3-D window that is not trivial along depth nor along rows and columns"


def check_nd(call, any_window: bool = False) -> str | None:
    """Why a 1-D or 3-D pool cannot be taken (``any_window``: as :mod:`.pool3d` runs the
    3-D windows a 2-D pool cannot), or None."""
    name, a = call.op.name, call.attrs
    problem = operands_problem(call, (call.args[0], call), FLOATS)
    if problem:
        return problem
    layout = (str(a.layout), str(a.out_layout) if a.out_layout is not None else str(a.layout))
    if layout not in (("NCW", "NCW"), ("NCDHW", "NCDHW")):
        return f"{name}: layout {layout[0]}->{layout[1]} not supported (only NCW, NCDHW)"
    if min(tuple(a.strides) + tuple(a.dilation) + tuple(a.pool_size)) < 1 or min(a.padding) < 0:
        return f"{name}: pool size/stride/dilation < 1 or negative padding"
    xd = dims(call.args[0].ty)
    if any_window and len(xd) == 5 and not any(isinstance(d, str) for d in xd[1:]):
        return None  # every such window: .pool3d
    plan = as_2d(call)
    return f"{name}: {plan}" if isinstance(plan, str) else None


def builder_nd(kind: str):
    def build(fe, call, out):
        xshape, oshape, size, stride, dilation, pad = as_2d(call)
        x = kir.view(fe.buffer(call.args[0]), xshape)
        return Pool2d((x,), kir.view(out, oshape), kind=kind, size=size, stride=stride, dilation=dilation,
                      pad=pad, include_pad=bool(call.attrs.count_include_pad))
    return build


register("relax.nn.max_pool1d", 1, check_nd)(builder_nd("max"))  # pool3d: in .pool3d
register("relax.nn.avg_pool1d", 1, check_nd)(builder_nd("avg"))
register("relax.nn.max_pool2d", 1, _check)(_builder("max"))
register("relax.nn.avg_pool2d", 1, _check)(_builder("avg"))
register("relax.nn.adaptive_avg_pool2d", 1, _check)(_builder("adaptive"))
