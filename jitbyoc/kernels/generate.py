"""Tensors made from attributes: ``relax.arange`` (a stage) and ``relax.full`` (a value
that broadcasts where it is used, as ``full_like``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.ir.prim import FloatImm, IntImm

from ..ir import kir
from ..ir.dtypes import ALL, INTS
from ..ir.relax_types import dims, tensor_problem
from ..ir.rules import register
from ..render.loops import threaded
from ..render.portable import PortableStage


@dataclass(eq=False)
class Arange(PortableStage, kir.KernelStage):
    """``out[i] = start + step * i`` in ``out``'s (integer) dtype, as TVM's topi.arange."""
    start: float | int = 0
    step: float | int = 1

    def emit(self, e) -> None:
        out, dt = self.out, self.out.dtype

        def body(e, lo, hi):
            with e.loop(hi, lo, "i") as i:
                k = i if dt == "int64" else e.op("astype", "int64", e.i(i), to=dt)
                e.store(out, i, e.op("add", dt, e.const(self.start, dt),
                                     e.op("multiply", dt, e.const(self.step, dt), k)))
                if self.epilogue is not None:
                    e.epilogue(self, [i], [1])

        e.parallel(e.dim(out.shape[0]), body, threaded(out.shape, "elementwise"))

    @staticmethod
    def reference(n: int, start, step, dtype: str) -> np.ndarray:
        t = np.dtype(dtype).type
        return (t(start) + t(step) * np.arange(n).astype(dtype)).astype(dtype)


def _number(v) -> float | int | None:
    if isinstance(v, IntImm):
        return int(v)
    if isinstance(v, FloatImm):
        return float(v)
    return None


def _check_arange(call) -> str | None:
    # float aranges stay with TVM: its legalization rounds start + step * i its own way
    problem = tensor_problem(call.ty, INTS)
    if problem:
        return f"relax.arange: {problem}"
    if _number(call.args[0]) is None or _number(call.args[2]) is None:
        return "relax.arange: start or step is not a constant"
    if _number(call.args[2]) <= 0:  # Relax's inferred length and topi's disagree for these
        return "relax.arange: a step <= 0 is left to TVM"
    return None


@register("relax.arange", 3, _check_arange)
def _build_arange(fe, call, out):
    return Arange((), out, start=_number(call.args[0]), step=_number(call.args[2]))


def _check_full(call) -> str | None:
    problem = tensor_problem(call.ty, ALL) or tensor_problem(call.args[1].ty, ALL)
    if problem:
        return f"relax.full: {problem}"
    if dims(call.args[1].ty):
        return "relax.full: the fill value is not a scalar tensor"
    return None


@register("relax.full", 2, _check_full)
def _build_full(fe, call, out):
    fill = fe.value(call.args[1])
    if fill.dtype == out.dtype:
        return fill
    return kir.Op("astype", (fill,), fill.dtype, out.dtype, (("to", out.dtype),))
