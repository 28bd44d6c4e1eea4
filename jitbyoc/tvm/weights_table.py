"""Large region weights handed to TVM's constant loader, not to its VM constant pool.

TVM's VM code generator puts every ``relax.Constant`` into the executable's constant
pool, deduplicated by structural hash: it hashes each tensor's bytes twice (a lookup,
then an insert), about 1 s a GB on Zen 4. A model's weights are nearly all arguments
of jitbyoc's regions (VGG-19: 0.9 GB once Winograd-transformed, 0.93 s of a 2 s build).

TVM has a second home for constants that it does not hash: the module attribute
``const_name_to_constant``, which ``relax.build`` passes to ``VMLink``. It puts them
in a ``ConstLoaderModule`` imported by the executable, which serializes them with
``export_library`` and restores them on load (so RPC and exported libraries keep them),
and which answers ``get_const_var_tensor`` with the name -> tensor map. A function
calling regions with such weights gets a prologue, outside its dataflow blocks, that
fetches that map (``R.call_pure_packed("get_const_var_tensor")``) and each weight from
it (``ffi.MapGetItem``, a builtin of TVM's runtime) on every call: about a microsecond a
weight. Smaller constants stay in the pool (:data:`MIN_BYTES`).

A later ``RunCodegen`` of another codegen with constants of its own would replace the
attribute (TVM's default pipeline runs none after jitbyoc's); the function would then
fail at its first call naming the missing weight.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

# Smaller weights stay in TVM's constant pool. Hashing costs ~1 ns a byte, once; the
# loader's map costs ~1 us an entry, every call (it is built whole for each fetch of it:
# RegNetY's 25 weights of 256 KiB or more took 53 us a call under jitbyoc.profile). From
# 1 MiB a weight's own layer reads it in >= 30 us, so the fetch is a few % at worst
# (RegNetY: 4 such weights, MobileNetV2 3, ResNet-50 32, BERT-base 74).
MIN_BYTES = 1 << 20
ATTR = "const_name_to_constant"
TABLE = "get_const_var_tensor"  # ConstLoaderModule's function: every constant by name
GET = "ffi.MapGetItem"


def _tensor(expr):
    """The tensor of a constant expression (None for anything else)."""
    value = getattr(expr, "value", None) if isinstance(expr, tvm.ir.expr.Constant) else None
    return value if isinstance(value, tvm.runtime.Tensor) else None


def _nbytes(tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tvm.runtime.DataType(str(tensor.dtype)).itemsize


@relax.expr_functor.mutator
class _Rewrite(relax.PyExprMutator):
    """Replaces large constant arguments of calls to ``symbols`` by variables bound in
    the function's prologue (:meth:`prologue`)."""

    def __init__(self, mod, symbols, names: dict, taken):
        super().__init__(mod)
        self.symbols, self.names = symbols, names  # names: shared by the module's functions
        self.taken = taken  # names the loader already holds (another codegen's)
        self.fetched: dict = {}  # name -> variable of this function

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (call.args and isinstance(call.args[0], relax.ExternFunc)
                and str(call.args[0].global_symbol) in self.symbols
                and isinstance(call.args[1], relax.Tuple)):
            return call
        args = [self._fetched(a) for a in call.args[1].fields]
        return relax.Call(call.op, [call.args[0], relax.Tuple(args), *call.args[2:]], call.attrs,
                          call.ty_args, call.span)

    def _fetched(self, arg):
        tensor = _tensor(arg)
        if tensor is None or _nbytes(tensor) < MIN_BYTES:
            return arg
        if arg not in self.names:
            number = len(self.names)
            while f"jitbyoc_weight_{number}" in self.taken:
                number += 1
            self.names[arg] = (f"jitbyoc_weight_{number}", tensor)
        name = self.names[arg][0]
        if name not in self.fetched:
            self.fetched[name] = relax.Var(name, arg.ty)
        return self.fetched[name]

    def prologue(self) -> relax.BindingBlock:
        table = relax.Var("jitbyoc_weights", relax.ObjectType())
        bindings = [relax.VarBinding(table, relax.op.call_pure_packed(TABLE, ty_args=relax.ObjectType()))]
        for name, var in self.fetched.items():
            bindings.append(relax.VarBinding(var, relax.op.call_pure_packed(
                GET, table, tvm.ir.StringImm(name), ty_args=var.ty)))
        return relax.BindingBlock(bindings)


def hand_over(mod: tvm.IRModule, symbols) -> tvm.IRModule:
    """``mod`` with the large constant arguments of its calls to the regions ``symbols``
    fetched from TVM's constant loader (their tensors in ``mod``'s ``const_name_to_constant``)."""
    table = dict(mod.attrs[ATTR]) if mod.attrs and ATTR in mod.attrs else {}
    symbols, names = frozenset(symbols), {}
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or func.attrs and "Codegen" in func.attrs:
            continue
        rewrite = _Rewrite(mod, symbols, names, table.keys())
        body = rewrite.visit_expr(func.body)
        if not rewrite.fetched:
            continue
        blocks, result = (body.blocks, body.body) if isinstance(body, relax.SeqExpr) else ([], body)
        body = relax.SeqExpr([rewrite.prologue(), *blocks], result)
        updates[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod[gv] = func
    table.update({name: data for name, data in names.values()})
    return mod.with_attr(ATTR, table)
