"""Normalizations: layer_norm, rms_norm, group_norm and instance_norm (kernels) and inference
batch_norm (elementwise).

layer_norm and rms_norm normalize over a contiguous block of axes: the tensor is viewed
as (outer, L, inner) and each of the outer*inner rows is done on its own, split across
TVM's thread pool, in the order TVM's legalization computes it:

* layer_norm: ``mean = sum(x) / L``; ``var = sum((x - mean)^2) / L`` (two passes, so no
  cancellation for data far from zero); ``out = (x - mean) * (1 / sqrt(var + eps)) *
  gamma + beta``.
* rms_norm: ``out = (1 / sqrt(sum(x^2) / L + eps)) * x * weight``.

Reductions are reassociable (LLVM sums in vector lanes, C in order). With trailing axes
(inner == 1) each finished row gets the fused epilogue while it is in cache; otherwise the
epilogue runs once over the output at the end.

batch_norm with ``training=False`` is elementwise math given the moving statistics, so it
needs no kernel: its value is ``(x - mean) / sqrt(var + eps) * gamma + beta`` (TVM's
formula, operation for operation) with the per-channel vectors viewed as (C, 1, ..., 1),
and it fuses with what surrounds it (a conv's epilogue, a following relu). The moving
mean and variance pass through, as TVM returns them.

Accuracy: for L elements the sums are within ``L * eps`` relative of exact; outputs agree
with TVM's default build to about ``1e-5`` absolute for standardized data (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import kir
from ..ir.dtypes import FLOATS
from ..ir.relax_types import dims, operands_problem
from ..ir.rules import register
from ..render.indexing import fold, folds, unravel
from ..render.loops import threaded
from ..render.portable import PortableStage
from .layout import reshaped


@dataclass(eq=False)
class RowNorm(PortableStage, kir.KernelStage):
    """layer_norm (``inputs = (x, gamma, beta)``) or rms_norm (``inputs = (x, weight)``)
    over dims ``[first, last]`` of ``x``."""
    first: int = 0
    last: int = 0
    epsilon: float = 1e-5

    def split(self):
        shape = self.out.shape
        return shape[:self.first], shape[self.first:self.last + 1], shape[self.last + 1:]

    def emit(self, e) -> None:
        outer, red, inner = self.split()
        x, dt = self.inputs[0], self.out.dtype

        def body(e, lo, hi):
            n_in, length = e.product(inner), e.product(red)
            count = e.as_float(length, dt)
            with e.loop(hi, lo, "row") as r:
                base = e.let(e.add(e.mul(e.div(r, n_in), e.mul(length, n_in)), e.rem(r, n_in)))

                def at(k):
                    return e.add(base, e.mul(k, n_in))

                self._row(e, at, length, count)
                if not inner and self.epilogue is not None:
                    e.epilogue(self, _unravel_all(e, r, outer) + [0] * len(red),
                               [1] * len(outer) + [e.dim(d) for d in red])

        e.parallel(e.mul(e.product(outer), e.product(inner)), body, threaded(x.shape, "stage"))
        if inner and self.epilogue is not None:
            e.epilogue(self, [0] * self.out.ndim, [e.dim(d) for d in self.out.shape])

    def _row(self, e, at, length, count) -> None:
        x, out, dt = self.inputs[0], self.out, self.out.dtype
        eps = e.const(self.epsilon, dt)
        one = e.const(1, dt)
        if len(self.inputs) == 2:  # rms_norm
            ss = fold(e, "sum", dt, length, lambda k: e.op("square", dt, e.load(x, at(k))))
            scale = e.op("divide", dt, one, e.op("sqrt", dt, e.op("add", dt, e.op(
                "divide", dt, ss, count), eps)))
            with e.loop(length, 0, "k") as k:
                v = e.op("multiply", dt, e.op("multiply", dt, scale, e.load(x, at(k))),
                         e.load(self.inputs[1], k))
                e.store(out, at(k), v)
            return
        mean = e.op("divide", dt, fold(e, "sum", dt, length, lambda k: e.load(x, at(k))), count)
        var = e.op("divide", dt, fold(e, "sum", dt, length, lambda k: e.op(
            "square", dt, e.op("subtract", dt, e.load(x, at(k)), mean))), count)
        rstd = e.op("divide", dt, one, e.op("sqrt", dt, e.op("add", dt, var, eps)))
        with e.loop(length, 0, "k") as k:
            v = e.op("multiply", dt, e.op("subtract", dt, e.load(x, at(k)), mean), rstd)
            v = e.op("add", dt, e.op("multiply", dt, v, e.load(self.inputs[1], k)),
                     e.load(self.inputs[2], k))
            e.store(out, at(k), v)

    @staticmethod
    def reference(x, *params, axes, epsilon=1e-5) -> np.ndarray:
        wide = x.astype(np.float64)
        axes = tuple(axes)
        if len(params) == 1:  # rms_norm
            rms = np.sqrt(np.mean(wide * wide, axis=axes, keepdims=True) + epsilon)
            return (wide / rms * params[0]).astype(x.dtype)
        mean = wide.mean(axis=axes, keepdims=True)
        var = ((wide - mean) ** 2).mean(axis=axes, keepdims=True)
        return ((wide - mean) / np.sqrt(var + epsilon) * params[0] + params[1]).astype(x.dtype)


@dataclass(eq=False)
class GroupNorm(PortableStage, kir.KernelStage):
    """group_norm: ``inputs = (x, gamma, beta)``, the channels of dim ``axis`` split into
    ``groups`` groups, each group (its channels and every dim after them: a contiguous
    row) normalized on its own, with TVM's one-pass statistics: ``mean = sum(x) / L``,
    ``var = sum(x * x) / L - mean * mean``; ``out = (x - mean) * (1 / sqrt(var + eps))
    * gamma[c] + beta[c]``."""
    groups: int = 1
    axis: int = 1
    epsilon: float = 1e-5

    def emit(self, e) -> None:
        x, gamma, beta = self.inputs
        out, dt = self.out, self.out.dtype
        outer, inner = x.shape[:self.axis], x.shape[self.axis + 1:]
        per = x.shape[self.axis] // self.groups

        def body(e, lo, hi):
            n_in = e.product(inner)
            length = e.mul(per, n_in)
            count = e.as_float(length, dt)
            with e.loop(hi, lo, "row") as r:
                base, first = e.let(e.mul(r, length)), e.let(e.mul(e.rem(r, self.groups), per))
                s, s2 = folds(e, "sum", dt, length, [lambda k: e.load(x, e.add(base, k)),
                                                     lambda k: e.op("square", dt, e.load(x, e.add(base, k)))])
                mean = e.op("divide", dt, s, count)
                var = e.op("subtract", dt, e.op("divide", dt, s2, count), e.op("multiply", dt, mean, mean))
                rstd = e.op("divide", dt, e.const(1, dt), e.op("sqrt", dt, e.op("add", dt, var, e.const(
                    self.epsilon, dt))))
                with e.loop(length, 0, "k") as k:
                    c = e.let(e.add(first, e.div(k, n_in)))
                    v = e.op("multiply", dt, e.op("subtract", dt, e.load(x, e.add(base, k)), mean), rstd)
                    e.store(out, e.add(base, k), e.op("add", dt, e.op("multiply", dt, v, e.load(gamma, c)),
                                                      e.load(beta, c)))
                if self.epilogue is not None:
                    e.epilogue(self, _unravel_all(e, e.div(r, self.groups), outer) + [first] + [0] * len(inner),
                               [1] * len(outer) + [per] + [e.dim(d) for d in inner])

        e.parallel(e.mul(e.product(outer), self.groups), body, threaded(x.shape, "stage"))

    @staticmethod
    def reference(x, gamma, beta, groups: int, axis: int = 1, epsilon=1e-5) -> np.ndarray:
        lead = x.shape[:axis]
        rows = x.astype(np.float64).reshape(lead + (groups, -1))
        mean = rows.mean(axis=-1, keepdims=True)
        var = ((rows - mean) ** 2).mean(axis=-1, keepdims=True)
        norm = ((rows - mean) / np.sqrt(var + epsilon)).reshape(x.shape)
        scale = (x.shape[axis],) + (1,) * (x.ndim - axis - 1)
        return (norm * gamma.reshape(scale) + beta.reshape(scale)).astype(x.dtype)


def _unravel_all(e, flat, ds) -> list:
    return unravel(e, flat, [e.dim(d) for d in ds])


def _block(call) -> tuple[int, int] | str:
    """The normalized axes as a contiguous (first, last) block, or a reason."""
    nd = len(dims(call.args[0].ty))
    axes = sorted({int(a) % nd for a in call.attrs.axes})
    if not axes or axes != list(range(axes[0], axes[-1] + 1)):
        return f"axes {list(axes)} are not one contiguous block"
    return axes[0], axes[-1]


def _operands_problem(call) -> str | None:
    """Every operand a float tensor of the data's dtype, or why not."""
    problem = operands_problem(call, call.args, FLOATS)
    if problem:
        return problem
    if len({str(t.ty.dtype) for t in call.args}) > 1:
        return f"{call.op.name}: operands of mixed dtypes"
    return None


def _check_rows(call) -> str | None:
    name = call.op.name
    x = call.args[0]
    problem = _operands_problem(call)
    if problem:
        return problem
    if not dims(x.ty):
        return f"{name}: rank-0 input"
    block = _block(call)
    if isinstance(block, str):
        return f"{name}: {block}"
    shape = dims(x.ty)
    size = [d for d in shape[block[0]:block[1] + 1]]
    for p in call.args[1:]:
        if [d for d in dims(p.ty) if d != 1] != [d for d in size if d != 1]:
            return f"{name}: parameter shape {dims(p.ty)} does not match the normalized dims"
    if name == "relax.nn.layer_norm" and not (call.attrs.center and call.attrs.scale):
        return ("relax.nn.layer_norm: center/scale=False is left to TVM (its own lowering "
                "ignores these flags, so jitbyoc would disagree with it)")
    return None


def _build_rows(fe, call, out):
    first, last = _block(call)
    params = tuple(fe.buffer(a) for a in call.args)
    return RowNorm(params, out, first=first, last=last, epsilon=float(call.attrs.epsilon))


register("relax.nn.layer_norm", 3, _check_rows)(_build_rows)
register("relax.nn.rms_norm", 2, _check_rows)(_build_rows)


def _groups(call) -> int:
    """group_norm's ``num_groups``; instance_norm's: one group per channel."""
    if call.op.name == "relax.nn.instance_norm":
        shape = dims(call.args[0].ty)
        channels = shape[int(call.attrs.channel_axis) % max(len(shape), 1)]
        return channels if isinstance(channels, int) else 0
    return int(call.attrs.num_groups)


def _check_group_norm(call) -> str | None:
    """group_norm, and instance_norm as a group_norm of one channel per group."""
    x, name = call.args[0], call.op.name
    problem = _operands_problem(call)
    if problem:
        return problem
    if str(x.ty.dtype) != "float32":  # TVM's topi group_norm takes float32 only: no reference
        return f"{name}: dtype {x.ty.dtype} (float32 only, as TVM's own group_norm)"
    shape = dims(x.ty)
    axis = int(call.attrs.channel_axis) % max(len(shape), 1)
    axes = sorted(int(a) % len(shape) for a in call.attrs.axes)
    if axes != list(range(axis + 1, len(shape))):
        return f"{name}: axes {axes} are not every dim after the channel axis {axis}"
    channels, groups = shape[axis], _groups(call)
    if not isinstance(channels, int) or groups <= 0 or channels % groups or 0 in shape:
        return f"{name}: {channels} channels do not split into {groups} groups, or empty"
    if any(dims(p.ty) != [channels] for p in call.args[1:]):
        return f"{name}: gamma/beta are not one value per channel"
    return None  # center/scale=False: gamma and beta still apply, as in TVM's lowering (which
    # ignores the flags; TVM's ONNX frontend passes ones and zeros with them, then scales)


@register("relax.nn.group_norm", 3, _check_group_norm)
@register("relax.nn.instance_norm", 3, _check_group_norm)
def _build_group_norm(fe, call, out):
    x = fe.buffer(call.args[0])
    return GroupNorm((x, fe.buffer(call.args[1]), fe.buffer(call.args[2])), out, groups=_groups(call),
                     axis=int(call.attrs.channel_axis) % x.ndim, epsilon=float(call.attrs.epsilon))


def _check_batch_norm(call) -> str | None:
    x = call.args[0]
    problem = _operands_problem(call)
    if problem:
        return problem
    if call.attrs.training:
        return ("relax.nn.batch_norm: training=True (statistics of the batch, with updated "
                "moving averages) is left to TVM")
    nd = len(dims(x.ty))
    if nd == 0 or any(len(dims(t.ty)) != 1 for t in call.args[1:]):
        return "relax.nn.batch_norm: expects 1-D gamma/beta/mean/var on a ranked input"
    return None


@register("relax.nn.batch_norm", 5, _check_batch_norm)
def _build_batch_norm(fe, call, out):
    x, gamma, beta, mean, var = call.args
    nd = len(dims(x.ty))
    axis = int(call.attrs.axis) % nd
    dt = str(x.ty.dtype)
    shape = (dims(x.ty)[axis],) + (1,) * (nd - axis - 1)  # broadcasts along `axis`
    m, v = (reshaped(fe, a, shape) for a in (mean, var))
    eps = kir.Const(float(call.attrs.epsilon), dt)
    y = _op("divide", dt, _op("subtract", dt, fe.value(x), m),
            _op("sqrt", dt, _op("add", dt, v, eps)))
    if call.attrs.scale:
        y = _op("multiply", dt, y, reshaped(fe, gamma, shape))
    if call.attrs.center:
        y = _op("add", dt, y, reshaped(fe, beta, shape))
    return y, fe.value(mean), fe.value(var)


def _op(name, dt, *args):
    return kir.Op(name, args, dt, dt)
