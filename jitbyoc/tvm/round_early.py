"""Round to bfloat16 before a max pool or a concatenation, where only the rounding reads it.

:func:`~jitbyoc.tvm.precision.lower_precision` rounds a product's operand where the product
reads it. An Inception module's input is a concatenation that three convolutions read
rounded and a max pool reads as it is, its pooled result rounded for a fourth: so the
module's region wrote the concatenation twice, in float32 for the pool and in bfloat16 for
the convolutions, and the branches before it wrote float32 for the concatenation.

Rounding to nearest even is monotone, so ``bf16(max(a, b)) == max(bf16(a), bf16(b))``, and a
concatenation only moves values, so ``bf16(concat(parts)) == concat(bf16(parts))``:

* ``astype(max_pool2d(x), "bfloat16")``, the pool's only use, is ``max_pool2d(astype(x,
  "bfloat16"))``;
* ``astype(concat(parts), "bfloat16")``, where every use of the concatenation is such a
  rounding, is ``concat([astype(p, "bfloat16") for p in parts])``.

Exact: the same bits, in TVM's build of the rewritten module and in jitbyoc's. Each value
is rounded once however many readers round it. The first rewrite runs over the whole
function, then the second, twice: a pool's rewrite leaves its input only rounded (a
concatenation, or a pool of stride 2 that the next module's pool of stride 1 read).
"""

from __future__ import annotations

import itertools

from tvm import relax
from tvm.ir import Op

from .inference import use_counts

ASTYPE, CONCAT, MAX_POOL = Op.get("relax.astype"), Op.get("relax.concat"), Op.get("relax.nn.max_pool2d")
BF16 = "bfloat16"


def round_early(func: relax.Function) -> relax.Function:
    """``func`` with its roundings moved before max pools, then before concatenations."""
    names = itertools.count()
    for rule in ("pool", "concat") * 2:
        func = relax.analysis.remove_all_unused(_RoundEarly(use_counts(func), rule, names).visit_expr(func))
    return func


def rounding_of(expr) -> relax.Var | None:
    """``x`` where ``expr`` is ``astype(x, "bfloat16")`` of a float32 var."""
    if isinstance(expr, relax.Call) and expr.op.same_as(ASTYPE) and str(expr.ty.dtype) == BF16:
        x = expr.args[0]
        return x if isinstance(x, relax.Var) and str(x.ty.dtype) == "float32" else None
    return None


@relax.expr_functor.mutator
class _RoundEarly(relax.PyExprMutator):
    def __init__(self, uses: dict, rule: str, names):
        super().__init__()
        self.uses, self.rule = uses, rule
        self.rounded: dict = {}  # var -> its rounding's var
        self.roundings: dict = {}  # var name -> how many of its uses are roundings
        self.names = names  # numbers for the names of new vars, shared by the passes

    def visit_dataflow_block_(self, block):
        self.rounded = {}  # a dataflow var lives in its block
        for binding in block.bindings:
            x = rounding_of(binding.value)
            if x is not None:
                self.roundings[x.name] = self.roundings.get(x.name, 0) + 1
        return super().visit_dataflow_block_(block)

    def round(self, x):
        """``astype(x, "bfloat16")``, one per ``x``."""
        if x not in self.rounded:
            self.rounded[x] = self._emit(relax.op.astype(x, BF16))
        return self.rounded[x]

    def _emit(self, expr):
        """``expr`` bound to a name of its own: ``prepare`` counts uses by name, and a
        name given twice would make a value look read twice (:mod:`.pool_concat`)."""
        return self.builder_.emit(expr, f"rounded_{self.rule}{next(self.names)}")

    def visit_var_binding_(self, binding):
        source = rounding_of(binding.value)
        if source is None or not isinstance(binding.var, relax.DataflowVar):
            super().visit_var_binding_(binding)
            return
        early = self._early(source)
        if early is None:
            self.set_var_remap(binding.var, self.round(self.visit_expr(source)))
            return
        self.set_var_remap(binding.var, self._emit(early))

    def _early(self, x: relax.Var):
        value = self.lookup_binding(self.visit_expr(x))
        if not isinstance(value, relax.Call):
            return None
        if self.rule == "pool" and value.op.same_as(MAX_POOL) and self.uses.get(x.name) == 1:
            return relax.Call(value.op, [self.round(value.args[0])], value.attrs)
        if self.rule == "concat" and value.op.same_as(CONCAT) and isinstance(value.args[0], relax.Tuple) \
                and self.uses.get(x.name) == self.roundings.get(x.name):
            return relax.op.concat([self.round(p) for p in value.args[0].fields], axis=value.attrs.axis)
        return None
