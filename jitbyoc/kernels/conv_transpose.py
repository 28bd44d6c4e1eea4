"""``relax.nn.conv2d_transpose`` (NCHW data, IOHW weights, groups, strides, padding,
output padding, dilation), as a gather: every output element sums the input taps that
land on it, ``oh = ih * stride - pad + kh * dilation`` (and likewise for columns).

A direct loop nest over output planes (split across the thread pool), in TVM's order of
accumulation (input channel, then kernel row, then column), so results agree with TVM's
default build to rounding. Not GEMM-speed: decoders of segmentation nets and GANs are
where this op occurs, and it was left to TVM before (its regions split around it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.loops import threaded
from ..render.portable import PortableStage


@dataclass(eq=False)
class Conv2dTranspose(PortableStage, kir.KernelStage):
    stride: tuple = (1, 1)
    pad: tuple = (0, 0)  # top, left
    dilation: tuple = (1, 1)
    groups: int = 1

    def macs(self) -> tuple:  # every input pixel meets every tap of its group's filters
        x, w = self.inputs
        return tuple(x.shape) + (self.out.shape[1] // self.groups,) + tuple(w.shape[2:])

    def emit(self, e) -> None:
        x, w = self.inputs
        out, dt = self.out, self.out.dtype
        n_out, cin_g = out.shape[1] // self.groups, x.shape[1] // self.groups
        kh, kw = w.shape[2], w.shape[3]
        oh, ow, ih, iw = out.shape[2], out.shape[3], x.shape[2], x.shape[3]

        def plane(e, lo, hi):
            with e.loop(hi, lo, "plane") as p:
                b, oc = e.let(e.div(p, out.shape[1])), e.let(e.rem(p, out.shape[1]))
                g, o = e.let(e.div(oc, n_out)), e.let(e.rem(oc, n_out))
                with e.loop(oh, 0, "y") as y, e.loop(ow, 0, "x") as xo:
                    acc = e.var(dt, e.const(0, dt))
                    with e.loop(cin_g, 0, "c") as c:
                        ic = e.let(e.add(e.mul(g, cin_g), c))
                        src = e.let(e.mul(e.add(e.mul(b, x.shape[1]), ic), ih * iw))
                        wrow = e.let(e.mul(e.add(e.mul(ic, n_out), o), kh * kw))
                        self._taps(e, acc, (y, xo), src, wrow)
                    e.store(out, e.add(e.mul(p, oh * ow), e.add(e.mul(y, ow), xo)), e.get(acc))
                if self.epilogue is not None:
                    e.epilogue(self, [b, oc, 0, 0], [1, 1, oh, ow])

        e.parallel(e.product(out.shape[:2]), plane, threaded(out.shape, "stage"))

    def _taps(self, e, acc, at, src, wrow) -> None:
        """Add every tap ``(i, j)`` of the kernel whose input pixel lands on output ``at``."""
        x, w = self.inputs
        dt, sizes = self.out.dtype, (x.shape[2], x.shape[3])
        kh, kw = w.shape[2], w.shape[3]
        with e.loop(kh, 0, "i") as i, e.loop(kw, 0, "j") as j:
            pos = []
            for axis, (o, k) in enumerate(zip(at, (i, j))):
                t = e.let(e.sub(e.add(o, self.pad[axis]), e.mul(k, self.dilation[axis])))
                pos.append((t, e.let(e.div(t, self.stride[axis]))))
            ok = None
            for (t, v), n, s in zip(pos, sizes, self.stride):  # 0 <= t, t % s == 0, t / s < n
                inside = e.select(e.lt(t, 0), e.eq(1, 0), e.select(e.eq(e.rem(t, s), 0), e.lt(v, n), e.eq(1, 0)))
                ok = inside if ok is None else e.select(ok, inside, ok)
            (_, yy), (_, xx) = pos
            with e.when(ok):
                value = e.op("multiply", dt, e.load(x, e.add(src, e.add(e.mul(yy, sizes[1]), xx))),
                             e.load(w, e.add(wrow, e.add(e.mul(i, kw), j))))
                e.set(acc, e.op("add", dt, e.get(acc), value))

    @staticmethod
    def reference(x, w, stride, pad, dilation, groups, out_hw) -> np.ndarray:
        n, cin, ih, iw = x.shape
        n_out = w.shape[1]
        out = np.zeros((n, n_out * groups, *out_hw), np.float64)
        for g in range(groups):
            for c in range(cin // groups):
                ic = g * (cin // groups) + c
                for i in range(w.shape[2]):
                    for j in range(w.shape[3]):
                        for y in range(ih):
                            oy = y * stride[0] - pad[0] + i * dilation[0]
                            if 0 <= oy < out_hw[0]:
                                ox = np.arange(iw) * stride[1] - pad[1] + j * dilation[1]
                                keep = (ox >= 0) & (ox < out_hw[1])
                                out[:, g * n_out:(g + 1) * n_out, oy, ox[keep]] += \
                                    x[:, ic, y, keep][:, None, :] * w[ic, :, i, j][None, :, None]
        return out.astype(x.dtype)


def _check(call) -> str | None:
    x, w = call.args
    a = call.attrs
    for t in (x, w, call):
        problem = tensor_problem(t.ty, FLOATS)
        if problem:
            return f"relax.nn.conv2d_transpose: {problem}"
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "IOHW", "NCHW"):
        return "relax.nn.conv2d_transpose: layouts other than NCHW/IOHW are left to TVM"
    xd, wd, od = dims(x.ty), dims(w.ty), dims(call.ty)
    if len(xd) != 4 or any(isinstance(d, str) for d in xd[1:] + wd + od[1:]):
        return "relax.nn.conv2d_transpose: not 2-D, or a symbolic dim other than the batch"
    if len({str(x.ty.dtype), str(w.ty.dtype), str(call.ty.dtype)}) != 1:
        return "relax.nn.conv2d_transpose: mixed dtypes"
    if min(tuple(a.strides) + tuple(a.dilation)) < 1 or xd[1] % int(a.groups):
        return "relax.nn.conv2d_transpose: stride/dilation < 1 or channels not divisible by groups"
    return None


@register("relax.nn.conv2d_transpose", 2, _check)
def _build(fe, call, out):
    a = call.attrs
    x, w = (fe.buffer(t) for t in call.args)
    ints = [tuple(int(v) for v in vals) for vals in (a.strides, a.padding, a.dilation)]
    return Conv2dTranspose((x, w), out, stride=ints[0], pad=ints[1][:2], dilation=ints[2], groups=int(a.groups))
