"""Give composite functions the result types their bodies have.

``FuseOpsByPattern`` lifts a call's target shape (``broadcast_to``, ``full``,
``reshape``...) into a parameter of the composite function. Inside, the result's type
then names that parameter (``R.Tensor(param_0)``), which a function signature cannot, so
the function's declared result, and every type after its call site, is erased to
``R.Tensor(ndim=k)``: neither jitbyoc nor TVM then knows the shape of what the region
returns. The parameter's own type holds the shape (``R.Shape([1, n])``, its sizes defined
by the parameters), so the composite is re-declared with that shape and its callers are
normalized again.
"""

from __future__ import annotations

import tvm
from tvm import relax


def _declared(func: relax.Function) -> relax.TensorType | None:
    """The result type ``func`` should declare, where its declared one was erased."""
    body_ty, shape = func.body.body.ty, getattr(func.body.body.ty, "shape", None)
    if getattr(func.ret_ty, "shape", 1) is not None or not isinstance(shape, relax.Var):
        return None
    values = getattr(shape.ty, "values", None)
    if values is None or not any(shape.same_as(p) for p in func.params):
        return None
    return relax.TensorType(relax.ShapeExpr(values), body_ty.dtype)


@relax.expr_functor.mutator
class _Recall(relax.PyExprMutator):
    """Calls of the old composites become calls of the re-declared ones (normalizing
    derives their result types, and every binding after them)."""

    def __init__(self, mod, renamed: dict):
        super().__init__(mod)
        self.renamed = renamed

    def visit_call_(self, call):
        call = super().visit_call_(call)
        for old, new in self.renamed.items():
            if call.op.same_as(old):
                return relax.Call(new, call.args, call.attrs, call.ty_args)
        return call


def retype_composites(mod: tvm.IRModule) -> tvm.IRModule:
    fixed = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs:
            ty = _declared(func)
            if ty is not None:
                fixed[gv] = relax.Function(func.params, func.body, ty, func.is_pure, func.attrs)
    if not fixed:
        return mod
    bb = relax.BlockBuilder(mod)
    renamed = {gv: bb.add_func(func, gv.name_hint) for gv, func in fixed.items()}
    mod = bb.get()
    out = {gv: f for gv, f in mod.functions.items() if not any(gv.same_as(old) for old in fixed)}
    for gv, func in list(out.items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            out[gv] = _Recall(mod, renamed).visit_expr(func)
    return tvm.IRModule(out, attrs=mod.attrs)
