"""Give composite functions the result types their bodies have.

``FuseOpsByPattern`` lifts a call's target shape (``broadcast_to``, ``full``,
``reshape``...) into a parameter of the composite function. Inside, the result's type
then names that parameter (``R.Tensor(param_0)``), which a function signature cannot, so
the function's declared result, and every type after its call site, is erased to
``R.Tensor(ndim=k)``: neither jitbyoc nor TVM then knows the shape of what the region
returns. The parameter's own type holds the shape (``R.Shape([1, n])``, its sizes defined
by the parameters), so the composite is re-declared with that shape and its callers are
normalized again.

A region whose result sizes no parameter defines (a reshape to sizes a ``match_cast``
made in the calling function) keeps them in its declared type, but RunCodegen erases them
from the ``call_dps_packed`` it writes, and the VM cannot allocate an output of unknown
shape: :func:`restore_call_types` gives each such call the type its call site had.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import TupleType


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


# ---- after RunCodegen: regions whose result sizes only their call site defines ----------------

@relax.expr_functor.visitor
class _CallSiteTypes(relax.PyExprVisitor):
    """The type each binding of a region call has, in binding order, by code symbol."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__()
        self.symbols = {gv: str(f.attrs["global_symbol"]) for gv, f in mod.functions.items()
                        if isinstance(f, relax.Function) and f.attrs and "Codegen" in f.attrs}
        self.found: dict[str, list] = {}

    def visit_var_binding_(self, binding):
        super().visit_var_binding_(binding)
        op = getattr(binding.value, "op", None)
        if isinstance(op, tvm.ir.GlobalVar) and op in self.symbols:
            self.found.setdefault(self.symbols[op], []).append(binding.var.ty)


@relax.expr_functor.mutator
class _Retype(relax.PyExprMutator):
    """``call_dps_packed`` of a region whose result type RunCodegen erased gets the type
    the region's call had, taken in the same binding order."""

    def __init__(self, mod, found: dict):
        super().__init__(mod)
        self.found = found
        self.dps = tvm.ir.Op.get("relax.call_dps_packed")

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(self.dps) or not isinstance(call.args[0], relax.ExternFunc):
            return call
        queue = self.found.get(str(call.args[0].global_symbol))
        if not queue:
            return call
        return relax.Call(call.op, call.args, call.attrs, [_filled(call.ty_args[0], queue.pop(0))])


def _filled(declared, site):
    """``declared`` with every tensor type that has no shape replaced by ``site``'s."""
    if isinstance(declared, TupleType) and isinstance(site, TupleType) and len(declared.fields) == len(site.fields):
        return TupleType([_filled(d, s) for d, s in zip(declared.fields, site.fields)])
    if getattr(declared, "shape", 1) is None and getattr(site, "shape", None) is not None:
        return site
    return declared


def restore_call_types(partitioned: tvm.IRModule, codegen_out: tvm.IRModule) -> tvm.IRModule:
    """``codegen_out`` (RunCodegen of ``partitioned``) with the shapes of region results
    whose sizes are defined only where the region is called (a reshape to sizes a
    ``match_cast`` made: ONNX Unsqueeze with its axes as an input). RunCodegen declares
    such a result ``R.Tensor(ndim=k)``, and the VM cannot allocate it."""
    if not any(relax.analysis.free_symbolic_vars(f) for f in partitioned.functions.values()
               if isinstance(f, relax.Function) and f.attrs and "Codegen" in f.attrs):
        return codegen_out  # every region's result type is defined by its parameters
    found = {}  # function name -> symbol -> the types of its region calls, in order
    for gv, func in partitioned.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Codegen" in func.attrs):
            sites = _CallSiteTypes(partitioned)
            sites.visit_expr(func)
            found[gv.name_hint] = sites.found
    out = {}
    for gv, func in codegen_out.functions.items():
        calls = found.get(gv.name_hint)
        out[gv] = _Retype(codegen_out, calls).visit_expr(func) if calls else func
    return tvm.IRModule(out, attrs=codegen_out.attrs)
