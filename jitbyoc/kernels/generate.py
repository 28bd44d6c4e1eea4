"""Tensors made from attributes: ``relax.arange`` (a stage), ``relax.full`` and
``relax.zeros`` (values that broadcast where they are used, as ``full_like``), the
triangles ``tril``/``triu`` (``x`` where column - row is at most / at least ``k`` in the
last two dims, else 0), ``eye_like`` (1 where column - row is ``k``) and ``size`` (the
element count of a tensor, as an int64 scalar)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.ir.prim import FloatImm, IntImm

from ..ir import kir
from ..ir.dtypes import ALL, INTS
from ..ir.relax_types import dims, operands_problem, tensor_problem
from ..ir.rules import register
from ..render.indexing import each_row
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


@dataclass(eq=False)
class Triangle(PortableStage, kir.KernelStage):
    lower: bool = True
    k: int = 0

    def emit(self, e) -> None:
        (x,), out, dt = self.inputs, self.out, self.out.dtype
        zero = e.const(0, dt)

        def row(e, r, pos):  # sized in its own function (a threaded body's: see ArgReduce.sizes)
            width = e.dim(out.shape[-1])
            first = e.let(e.add(pos[-1], self.k))  # row + k: the last (tril) / first (triu) column kept
            with e.loop(width, 0, "j") as j:
                at = e.let(e.add(e.mul(r, width), j))
                keep = e.lt(j, e.add(first, 1)) if self.lower else e.lt(e.sub(first, 1), j)
                e.store(out, at, e.select(keep, e.load(x, at), zero))
            if self.epilogue is not None:
                e.epilogue(self, pos + [0], [1] * len(pos) + [width])

        each_row(e, out.shape, row, threaded(out.shape, "elementwise"))

    @staticmethod
    def reference(x: np.ndarray, lower: bool, k: int) -> np.ndarray:
        return np.tril(x, k) if lower else np.triu(x, k)


def _check_triangle(call) -> str | None:
    name = call.op.name
    problem = tensor_problem(call.args[0].ty, ALL)
    if problem:
        return f"{name}: {problem}"
    if len(dims(call.args[0].ty)) < 2 or 0 in dims(call.args[0].ty):
        return f"{name}: fewer than two dims, or empty"
    if _number(call.args[1]) is None:
        return f"{name}: the diagonal offset is not a constant"
    return None


def _build_triangle(fe, call, out):
    return Triangle((fe.buffer(call.args[0]),), out, lower=call.op.name == "relax.tril",
                    k=int(_number(call.args[1])))


register("relax.tril", 2, _check_triangle)(_build_triangle)
register("relax.triu", 2, _check_triangle)(_build_triangle)


@dataclass(eq=False)
class Eye(PortableStage, kir.KernelStage):
    """``out[i, j] = 1 if j - i == k else 0`` (TVM's topi.eye)."""
    k: int = 0

    def emit(self, e) -> None:
        out, dt = self.out, self.out.dtype
        one, zero = e.const(1, dt), e.const(0, dt)

        def row(e, r, pos):
            width = e.dim(out.shape[-1])
            diagonal = e.let(e.add(pos[-1], self.k))
            with e.loop(width, 0, "j") as j:
                e.store(out, e.add(e.mul(r, width), j), e.select(e.eq(j, diagonal), one, zero))
            if self.epilogue is not None:
                e.epilogue(self, pos + [0], [1] * len(pos) + [width])

        each_row(e, out.shape, row, threaded(out.shape, "elementwise"))

    @staticmethod
    def reference(n: int, m: int, k: int, dtype: str) -> np.ndarray:
        return np.eye(n, m, k, dtype=dtype)


def _check_eye_like(call) -> str | None:
    x = call.args[0]
    problem = operands_problem(call, (x, call), ALL)
    if problem:
        return problem
    if len(dims(call.ty)) != 2 or 0 in dims(call.ty):
        return "relax.eye_like: not a non-empty matrix"
    if str(call.ty.dtype) != str(x.ty.dtype):  # TVM's legalization makes the input's dtype
        return "relax.eye_like: a dtype other than the input's (TVM's build ignores it)"
    if not isinstance(_eye_offset(call), int):
        return "relax.eye_like: the diagonal offset is not a constant"
    return None


def _eye_offset(call):
    """eye_like's diagonal offset k (an int), or None when it is not a constant int."""
    if len(call.args) < 2:
        return 0
    return _number(call.args[1])


@register("relax.eye_like", 1, _check_eye_like)
def _build_eye_like(fe, call, out):
    return Eye((), out, k=_eye_offset(call))


def _check_zeros(call) -> str | None:
    problem = tensor_problem(call.ty, ALL)
    return f"relax.zeros: {problem}" if problem else None


@register("relax.zeros", 1, _check_zeros)
def _build_zeros(fe, call, out):
    return kir.Const(0, out.dtype)


@dataclass(eq=False)
class Size(PortableStage, kir.KernelStage):
    """``out[()]``: the element count of ``inputs[0]`` (its dims' product, read at run time
    where symbolic)."""

    def emit(self, e) -> None:
        e.store(self.out, 0, e.i(e.product(self.inputs[0].shape)))
        if self.epilogue is not None:
            e.epilogue(self, [], [])

    @staticmethod
    def reference(x: np.ndarray) -> np.ndarray:
        return np.array(x.size, "int64")


def _check_size(call) -> str | None:
    problem = tensor_problem(call.args[0].ty, ALL) or tensor_problem(call.ty, {"int64"})
    return f"relax.size: {problem}" if problem else None


@register("relax.size", 1, _check_size)
def _build_size(fe, call, out):
    return Size((fe.buffer(call.args[0]),), out)
