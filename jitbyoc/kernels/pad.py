"""``relax.nn.pad``: constant, reflect, replicate and circular padding of any dims (TVM's
``topi.nn.pad`` and its ``reflect_pad``/``replicate_pad``/``circular_pad``; numpy's
``constant``, ``reflect``, ``edge`` and ``wrap``).

Constant padding copies each output row's middle from its input row and fills the rest
(rows outside the input are filled whole); the other modes map every output coordinate
back into the input (mirrored, clamped or wrapped) and copy. A zero padding of the rows
and columns before a convolution never gets here: :mod:`jitbyoc.tvm.prepare` folds
it into the convolution's own padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import ALL
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.indexing import clamped, dot, each_row, wrapped
from ..render.loops import threaded
from ..render.portable import PortableStage

MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


@dataclass(eq=False)
class Pad(PortableStage, kir.KernelStage):
    before: tuple = ()
    mode: str = "constant"  # a key of MODES
    value: float | int = 0

    def emit(self, e) -> None:
        (x,), out = self.inputs, self.out
        strides = [e.product(x.shape[k + 1:]) for k in range(x.ndim)]
        width = e.dim(out.shape[-1])
        fill_row = self._constant_row if self.mode == "constant" else self._mapped_row

        def row(e, r, pos):
            fill_row(e, r, pos, strides, width)
            if self.epilogue is not None:  # an elementwise op after the pad, on this row
                e.epilogue(self, pos + [0], [1] * len(pos) + [width])

        each_row(e, out.shape, row, threaded(out.shape, "copy"))

    def _constant_row(self, e, r, pos, strides, width) -> None:
        (x,), out, dt = self.inputs, self.out, self.out.dtype
        fill, dst = e.const(self.value, dt), e.let(e.mul(r, width))
        inside, coords = None, []
        for k, p in enumerate(pos):
            c = e.let(e.sub(p, self.before[k]))
            ok = e.select(e.lt(c, 0), e.eq(1, 0), e.lt(c, e.dim(x.shape[k])))  # 0 <= c < n
            inside = ok if inside is None else e.select(inside, ok, inside)
            coords.append(c)
        n, lead = e.dim(x.shape[-1]), self.before[-1]

        def middle():
            src = e.let(dot(e, coords, strides[:-1]))
            with e.loop(lead, 0, "j") as j:
                e.store(out, e.add(dst, j), fill)
            with e.loop(n, 0, "j") as j:
                e.copy(out, e.add(dst, e.add(lead, j)), x, e.add(src, j))
            with e.loop(width, e.add(lead, n), "j") as j:
                e.store(out, e.add(dst, j), fill)

        if inside is None:
            middle()
            return
        with e.if_else(inside) as (then, otherwise):
            with then:
                middle()
            with otherwise:
                with e.loop(width, 0, "j") as j:
                    e.store(out, e.add(dst, j), fill)

    def _source(self, e, o, k):
        """Output coordinate ``o`` of dim ``k`` mapped into the input."""
        n = e.dim(self.inputs[0].shape[k])
        c = e.let(e.sub(o, self.before[k]))
        if self.mode == "replicate":
            return clamped(e, c, n)
        if self.mode == "circular":
            return wrapped(e, c, n)
        c = e.let(e.select(e.lt(c, 0), e.sub(0, c), c))  # reflect: mirror without the edge
        return e.let(e.select(e.lt(c, n), c, e.sub(e.mul(2, e.sub(n, 1)), c)))

    def _mapped_row(self, e, r, pos, strides, width) -> None:
        (x,), out = self.inputs, self.out
        base = e.let(dot(e, [self._source(e, p, k) for k, p in enumerate(pos)], strides[:-1]))
        dst = e.let(e.mul(r, width))
        with e.loop(width, 0, "j") as j:
            e.copy(out, e.add(dst, j), x, e.add(base, self._source(e, j, x.ndim - 1)))

    @staticmethod
    def reference(x: np.ndarray, before, after, mode: str = "constant", value=0) -> np.ndarray:
        widths = list(zip(before, after))
        if mode == "constant":
            return np.pad(x, widths, mode="constant", constant_values=value)
        return np.pad(x, widths, mode=MODES[mode])


def _widths(call) -> tuple[tuple, tuple]:
    w = [int(v) for v in call.attrs.pad_width]
    return tuple(w[0::2]), tuple(w[1::2])


def _check(call) -> str | None:
    x = call.args[0]
    problem = tensor_problem(x.ty, ALL) or tensor_problem(call.ty, ALL)
    if problem:
        return f"relax.nn.pad: {problem}"
    mode, shape = str(call.attrs.pad_mode), dims(x.ty)
    if mode not in MODES:
        return f"relax.nn.pad: mode {mode!r} is left to TVM"
    if not shape or 0 in shape or len(call.attrs.pad_width) != 2 * len(shape):
        return "relax.nn.pad: rank-0 or empty input, or pad widths of another rank"
    before, after = _widths(call)
    if min(before + after) < 0:
        return "relax.nn.pad: negative padding (a crop) is left to TVM"
    padded = [k for k, (b, a) in enumerate(zip(before, after)) if b or a]
    if any(not isinstance(shape[k], int) for k in padded):
        return "relax.nn.pad: a padded dim is symbolic"
    if mode == "reflect" and any(max(before[k], after[k]) >= shape[k] for k in padded):
        return "relax.nn.pad: reflect padding as wide as the dim is left to TVM"
    return None


@register("relax.nn.pad", 1, _check)
def _build(fe, call, out):
    value = call.attrs.pad_value
    value = float(value) if str(out.dtype).startswith("float") else int(value)
    return Pad((fe.buffer(call.args[0]),), out, before=_widths(call)[0], mode=str(call.attrs.pad_mode),
               value=value)
