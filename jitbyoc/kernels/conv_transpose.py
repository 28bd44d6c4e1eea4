"""``relax.nn.conv{1,2,3}d_transpose`` (NC[D]H[W] data, IO[D]H[W] weights, groups,
strides, padding, output padding, dilation), as a gather: every output element sums the
input taps that land on it, ``o = i * stride - pad + k * dilation`` along each spatial dim.

A direct loop nest over output planes (split across the thread pool), in TVM's order of
accumulation (input channel, then the kernel's taps, outermost dim first), so results
agree with TVM's default build to rounding. Not GEMM-speed: decoders of segmentation nets
and GANs are where this op occurs, and it was left to TVM before (its regions split
around it).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, operands_problem
from ..ir.rules import register
from ..render.indexing import dot
from ..render.loops import threaded
from ..render.portable import PortableStage

LAYOUTS = {1: ("NCW", "IOW", "NCW"), 2: ("NCHW", "IOHW", "NCHW"), 3: ("NCDHW", "IODHW", "NCDHW")}


def _loops(e, stack: ExitStack, extents, name: str) -> list:
    """Nested loops over ``extents`` (outermost first), entered on ``stack``; their indices."""
    return [stack.enter_context(e.loop(n, 0, f"{name}{k}")) for k, n in enumerate(extents)]


@dataclass(eq=False)
class ConvTranspose(PortableStage, kir.KernelStage):
    """One tuple entry per spatial dim for ``stride``, ``pad`` (leading side) and ``dilation``."""
    stride: tuple = (1, 1)
    pad: tuple = (0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1

    def macs(self) -> tuple:  # every input pixel meets every tap of its group's filters
        x, w = self.inputs
        return tuple(x.shape) + (self.out.shape[1] // self.groups,) + tuple(w.shape[2:])

    def emit(self, e) -> None:
        x, w = self.inputs
        out, dt = self.out, self.out.dtype
        n_out, cin_g = out.shape[1] // self.groups, x.shape[1] // self.groups
        spatial, taps, pixels = out.shape[2:], int(np.prod(w.shape[2:])), int(np.prod(x.shape[2:]))
        strides = [int(np.prod(spatial[k + 1:])) for k in range(len(spatial))]

        def plane(e, lo, hi):
            with e.loop(hi, lo, "plane") as p:
                b, oc = e.let(e.div(p, out.shape[1])), e.let(e.rem(p, out.shape[1]))
                g, o = e.let(e.div(oc, n_out)), e.let(e.rem(oc, n_out))
                with ExitStack() as stack:
                    at = _loops(e, stack, spatial, "y")
                    acc = e.var(dt, e.const(0, dt))
                    with e.loop(cin_g, 0, "c") as c:
                        ic = e.let(e.add(e.mul(g, cin_g), c))
                        src = e.let(e.mul(e.add(e.mul(b, x.shape[1]), ic), pixels))
                        wrow = e.let(e.mul(e.add(e.mul(ic, n_out), o), taps))
                        self._taps(e, acc, at, src, wrow)
                    e.store(out, e.add(e.mul(p, int(np.prod(spatial))), dot(e, at, strides)), e.get(acc))
                if self.epilogue is not None:
                    e.epilogue(self, [b, oc] + [0] * len(spatial), [1, 1] + list(spatial))

        e.parallel(e.product(out.shape[:2]), plane, threaded(out.shape, "stage"))

    def _taps(self, e, acc, at, src, wrow) -> None:
        """Add every tap of the kernel whose input pixel lands on output ``at``."""
        x, w = self.inputs
        dt, sizes, ks = self.out.dtype, x.shape[2:], w.shape[2:]
        with ExitStack() as stack:
            tap = _loops(e, stack, ks, "k")
            ok, pos = None, []
            for axis, (o, k) in enumerate(zip(at, tap)):  # 0 <= t, t % s == 0, t / s < n
                t = e.let(e.sub(e.add(o, self.pad[axis]), e.mul(k, self.dilation[axis])))
                v = e.let(e.div(t, self.stride[axis]))
                pos.append(v)
                inside = e.select(e.lt(t, 0), e.eq(1, 0), e.select(e.eq(e.rem(t, self.stride[axis]), 0),
                                                                   e.lt(v, sizes[axis]), e.eq(1, 0)))
                ok = inside if ok is None else e.select(ok, inside, ok)
            with e.when(ok):
                xs = [int(np.prod(sizes[k + 1:])) for k in range(len(sizes))]
                wk = [int(np.prod(ks[k + 1:])) for k in range(len(ks))]
                value = e.op("multiply", dt, e.load(x, e.add(src, dot(e, pos, xs))),
                             e.load(w, e.add(wrow, dot(e, tap, wk))))
                e.set(acc, e.op("add", dt, e.get(acc), value))

    @staticmethod
    def reference(x, w, stride, pad, dilation, groups, out_spatial) -> np.ndarray:
        """Float64 scatter of every input pixel through every tap."""
        cin, n_out = x.shape[1], w.shape[1]
        out = np.zeros((x.shape[0], n_out * groups, *out_spatial), np.float64)
        for ic in range(cin):
            g = ic // (cin // groups)
            for tap in np.ndindex(*w.shape[2:]):
                for pix in np.ndindex(*x.shape[2:]):
                    o = tuple(i * s - p + k * d for i, s, p, k, d in zip(pix, stride, pad, tap, dilation))
                    if all(0 <= v < n for v, n in zip(o, out_spatial)):
                        out[(slice(None), slice(g * n_out, (g + 1) * n_out)) + o] += \
                            x[(slice(None), ic) + pix][:, None] * w[(ic, slice(None)) + tap][None, :]
        return out.astype(x.dtype)


def _check(call) -> str | None:
    name, (x, w), a = call.op.name, call.args, call.attrs
    problem = operands_problem(call, (x, w, call), FLOATS)
    if problem:
        return problem
    xd, wd, od = dims(x.ty), dims(w.ty), dims(call.ty)
    k = len(xd) - 2
    if k not in LAYOUTS or (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != LAYOUTS[k]:
        return f"{name}: layouts other than {'/'.join(LAYOUTS.get(k, LAYOUTS[2])[:2])} are left to TVM"
    if any(isinstance(d, str) for d in xd[1:] + wd + od[1:]):
        return f"{name}: a symbolic dim other than the batch"
    if len({str(x.ty.dtype), str(w.ty.dtype), str(call.ty.dtype)}) != 1:
        return f"{name}: mixed dtypes"
    if min(tuple(a.strides) + tuple(a.dilation)) < 1 or xd[1] % int(a.groups):
        return f"{name}: stride/dilation < 1 or channels not divisible by groups"
    return None


def _build(fe, call, out):
    a = call.attrs
    x, w = (fe.buffer(t) for t in call.args)
    k = x.ndim - 2
    ints = [tuple(int(v) for v in vals) for vals in (a.strides, a.padding, a.dilation)]
    return ConvTranspose((x, w), out, stride=ints[0], pad=ints[1][:k], dilation=ints[2], groups=int(a.groups))


for _k in (1, 2, 3):
    register(f"relax.nn.conv{_k}d_transpose", 2, _check)(_build)
