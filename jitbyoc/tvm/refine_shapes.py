"""Shape facts the frontends leave implicit: static shapes as constants, and shapes that
slicing clamps hide, recovered with the size bounds the frontend declared.

``shape_to_tensor(shape_of(x))`` of a static shape is a constant (ONNX's ``Shape``, which
TVM's ONNX frontend also emits for every ``Gather`` to wrap negative indices): it becomes
one, so the arithmetic on it and the ops around it join a region instead of waiting for
the shape op, which no region can take.

``torch.export`` with a ``Dim("seq", min=1, max=...)`` gives the Relax function
``tir_var_lower_bound``/``tir_var_upper_bound`` attributes, but shape inference does not
use them: a ``strided_slice`` that may run out of bounds keeps clamps such as
``T.min(1, s) + s`` and ``T.max(T.min(1, s) + s - 1, 0)`` in its shape, and an op whose
operands have two such shapes gets no shape at all (``R.Tensor(ndim=2)``), which neither
jitbyoc nor TVM's own sort/scan lowering can build (``non-symbolic shape is not supported``).

A slice whose clamped and unclamped lengths are provably equal under the bounds is in
bounds: it is re-declared ``assume_inbound=True`` (same values, the plain shape), and the
bindings after it are normalized again, so shapes lost to the clamps come back.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import Op, Range
from tvm.ir.prim import IntImm
from tvm.sym import Analyzer

BOUND_ATTRS = ("tir_var_lower_bound", "tir_var_upper_bound")
UNBOUNDED = (1 << 62) - 1  # a size with a lower bound only: sizes are non-negative int64
STRIDED_SLICE = Op.get("relax.strided_slice")
SHAPE_TO_TENSOR = Op.get("relax.shape_to_tensor")


def _analyzer(func: relax.Function) -> Analyzer | None:
    """An analyzer that knows the declared range of each bounded size, or None."""
    attrs = func.attrs or {}
    lower, upper = (attrs.get(name) for name in BOUND_ATTRS)
    if not lower and not upper:
        return None
    analyzer = Analyzer()
    for var in relax.analysis.defined_symbolic_vars(func):
        name = str(var.name)
        lo = int(lower[name]) if lower and name in lower else 0
        hi = int(upper[name]) if upper and name in upper else UNBOUNDED
        if lo <= hi:
            analyzer.bind(var, Range(lo, hi + 1))
    return analyzer


def _same_shape(a, b, analyzer: Analyzer) -> bool:
    """Whether two tensor types provably have the same shape."""
    dims_a = getattr(getattr(a, "shape", None), "values", None)
    dims_b = getattr(getattr(b, "shape", None), "values", None)
    if dims_a is None or dims_b is None or len(dims_a) != len(dims_b):
        return False
    return all(analyzer.can_prove_equal(x, y) for x, y in zip(dims_a, dims_b))


def _static_shape(expr) -> list[int] | None:
    values = getattr(expr.ty, "values", None) if isinstance(expr.ty, relax.ShapeType) else None
    return [int(v) for v in values] if values is not None and all(isinstance(v, IntImm) for v in values) else None


@relax.expr_functor.mutator
class _Refine(relax.PyExprMutator):
    def __init__(self, mod, analyzer: Analyzer | None):
        super().__init__(mod)
        self.analyzer = analyzer

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op.same_as(SHAPE_TO_TENSOR):
            shape = _static_shape(call.args[0])
            return call if shape is None else relax.const(np.array(shape, "int64"), "int64")
        if self.analyzer is None or not call.op.same_as(STRIDED_SLICE) or call.attrs.assume_inbound:
            return call
        data, axes, *rest = call.args
        ndim = data.ty.ndim
        if ndim < 0 or not all(isinstance(a, IntImm) for a in axes.fields):
            return call
        # non-negative axes: TVM's legalization of an in-bounds slice rejects axis -1
        axes = [int(a.value) % ndim for a in axes.fields]
        inbound = self.builder_.normalize(relax.op.strided_slice(data, axes, *rest, assume_inbound=True))
        return inbound if _same_shape(call.ty, inbound.ty, self.analyzer) else call


def refine_shapes(mod: tvm.IRModule, ops: frozenset | set = frozenset()) -> tvm.IRModule:
    """``mod`` (which calls ``ops``) with static shapes as constants and the in-bounds
    slices of bounded functions declared so."""
    out = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            out[gv] = func
            continue
        analyzer = _analyzer(func)
        if analyzer is None and "relax.shape_to_tensor" not in ops:
            out[gv] = func
            continue
        out[gv] = relax.analysis.remove_all_unused(_Refine(mod, analyzer).visit_expr(func))
    if all(out[gv].same_as(f) for gv, f in mod.functions.items()):
        return mod
    return tvm.IRModule(out, attrs=mod.attrs)
