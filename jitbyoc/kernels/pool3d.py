"""Max and average pool3d (NCDHW) with any window: the ones :mod:`.pool2d` cannot run as a
2-D pool of views (a window that is not trivial along depth nor along rows and columns).

A direct loop nest in TVM's order (planes split across the thread pool; each output sums
or maxes its window's taps in (depth, row, column) order, skipping the padding, then an
average divides once by TVM's count), so results match TVM's default build exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.rules import register
from ..render.indexing import dot
from ..render.loops import threaded
from ..render.portable import PortableStage
from .pool2d import as_2d, builder_nd, check_nd, window_taps


@dataclass(eq=False)
class Pool3d(PortableStage, kir.KernelStage):
    average: bool = False
    size: tuple = (1, 1, 1)
    stride: tuple = (1, 1, 1)
    dilation: tuple = (1, 1, 1)
    pad: tuple = (0, 0, 0, 0, 0, 0)  # front, top, left, back, bottom, right
    include_pad: bool = False

    def emit(self, e) -> None:
        out = self.out
        outs = out.shape[2:]
        in_plane, out_plane = int(np.prod(self.inputs[0].shape[2:])), int(np.prod(outs))
        start = 0 if self.average else np.finfo(np.dtype(out.dtype)).min.item()

        def body(e, lo, hi):
            with e.loop(hi, lo, "pl") as pl:
                with e.loop(outs[0], 0, "od") as od, e.loop(outs[1], 0, "oh") as oh, \
                        e.loop(outs[2], 0, "ow") as ow:
                    self._output(e, pl, (od, oh, ow), start, in_plane, out_plane)
                if self.epilogue is not None:  # this plane's outputs, once
                    n, c = e.let(e.div(pl, out.shape[1])), e.let(e.rem(pl, out.shape[1]))
                    e.epilogue(self, [n, c, 0, 0, 0], [1, 1, *[e.dim(d) for d in outs]])

        e.parallel(e.product(out.shape[:2]), body, threaded(out.shape, "stage"))

    def _output(self, e, pl, at, start, in_plane, out_plane) -> None:
        """Pool the window of output ``at`` of plane ``pl``."""
        out, dt = self.out, self.out.dtype
        outs = out.shape[2:]
        acc = e.var(dt, e.const(start, dt))
        firsts = [e.let(e.sub(e.mul(o, s), p)) for o, s, p in zip(at, self.stride, self.pad)]
        self._window(e, acc, firsts, e.let(e.mul(pl, in_plane)))
        total = e.get(acc)
        if self.average:
            count = e.max(self._count(e, at), 1)
            total = e.op("divide", dt, total, e.as_float(count, dt))
        e.store(out, e.add(e.mul(pl, out_plane), dot(e, list(at), [outs[1] * outs[2], outs[2], 1])), total)

    def _count(self, e, outs):
        """TVM's divisor: the product over the dims of :func:`.pool2d.window_taps`."""
        total = 1
        for d, o in enumerate(outs):
            taps = window_taps(e, o, self.inputs[0].shape[2 + d], self.size[d], self.stride[d], self.dilation[d],
                               self.pad[d], self.pad[d + 3], self.include_pad)
            total = e.mul(total, e.max(taps, 0))
        return total

    def _window(self, e, acc, firsts, base) -> None:
        (x,), dt = self.inputs, self.out.dtype
        sizes = x.shape[2:]
        with e.loop(self.size[0], 0, "i") as i, e.loop(self.size[1], 0, "j") as j, \
                e.loop(self.size[2], 0, "l") as l:
            pos = [e.let(e.add(f, e.mul(k, d))) for f, k, d in zip(firsts, (i, j, l), self.dilation)]
            ok = None
            for p, n in zip(pos, sizes):
                inside = e.select(e.lt(p, 0), e.eq(1, 0), e.lt(p, n))
                ok = inside if ok is None else e.select(ok, inside, ok)
            with e.when(ok):
                v = e.load(x, e.add(base, dot(e, pos, [sizes[1] * sizes[2], sizes[2], 1])))
                e.set(acc, e.op("add" if self.average else "maximum", dt, e.get(acc), v))


def _build(average: bool):
    def build(fe, call, out):
        if not isinstance(as_2d(call), str):  # trivial along some dims: a 2-D pool of views
            return builder_nd("avg" if average else "max")(fe, call, out)
        a = call.attrs
        ints = [tuple(int(v) for v in vals) for vals in (a.pool_size, a.strides, a.dilation, a.padding)]
        return Pool3d((fe.buffer(call.args[0]),), out, average=average, size=ints[0], stride=ints[1],
                      dilation=ints[2], pad=ints[3], include_pad=bool(a.count_include_pad))
    return build


def _check(call) -> str | None:
    return check_nd(call, any_window=True)


register("relax.nn.max_pool3d", 1, _check)(_build(False))
register("relax.nn.avg_pool3d", 1, _check)(_build(True))
