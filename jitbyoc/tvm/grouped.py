"""Grouped-query attention reads its shared key/value heads in place.

HuggingFace's ``repeat_kv`` gives each of the ``H * r`` query heads its own copy of the
``H`` key/value heads before attention: ``torch.export`` writes
``reshape(broadcast_to(expand_dims(kv, 2), (B, H, r, S, D)), (B, H * r, S, D))``, and
the batched products then read the copy. In a decode step ``kv`` is the whole cache, so
the copy is ``r`` times the cache, written and read again every token (Qwen2-0.5B:
``r = 7``; at a past of 2,000 tokens the copies took most of the 1.57x a token cost over a
past of 32).

:func:`shared_heads` rewrites a product ``matmul(q, f(repeat(kv)))`` (``q`` of shape
``(H * r, M, K)``; ``f`` a chain of ops that treat heads alike: a swap of the last two
axes, a product with a scalar constant, an identity ``broadcast_to``, and the reshape
that drops the leading unit batch dim) into ``matmul(reshape(q, (H, r, M, K)),
reshape(f(kv), (H, 1, K, N)))`` reshaped back to ``(H * r, M, N)``: NumPy batch
broadcasting reads each shared head for its ``r`` query heads, the same sums in the same
order, and nothing is copied.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.ir.prim import IntImm
from tvm.sym import Analyzer

from .inference import MATMUL, PERMUTE_DIMS, RESHAPE
from .linear import bound_value

EXPAND_DIMS, BROADCAST_TO, MULTIPLY = (tvm.ir.Op.get(f"relax.{n}")
                                       for n in ("expand_dims", "broadcast_to", "multiply"))
# the ops a module calls for the rewrite to find anything: prepare skips the walk (72 ms
# on the 2,678 bindings of Qwen2-0.5B's decode step) in a module without them
TRIGGERS = frozenset({"relax.expand_dims", "relax.broadcast_to", "relax.matmul"})


def _shape(expr) -> list | None:
    shape = getattr(expr.ty, "shape", None)
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _same(a, b) -> bool:
    """Two dims provably equal."""
    return Analyzer().can_prove_equal(a, b)


def repeated(expr, lookup):
    """``(kv, r)`` when ``expr`` is ``repeat_kv(kv, r)`` as the module docstring writes
    it (``kv`` of shape ``(1, H, S, D)``, ``r`` static), else None."""
    flat = bound_value(expr, lookup)
    if not (isinstance(flat, relax.Call) and flat.op.same_as(RESHAPE)):
        return None
    wide = bound_value(flat.args[0], lookup)
    if not (isinstance(wide, relax.Call) and wide.op.same_as(BROADCAST_TO)):
        return None
    one = bound_value(wide.args[0], lookup)
    if not (isinstance(one, relax.Call) and one.op.same_as(EXPAND_DIMS)) \
            or [int(a) for a in one.attrs.axis] != [2]:
        return None
    kv = one.args[0]
    src, big, out = _shape(kv), _shape(wide), _shape(flat)
    if src is None or big is None or out is None or len(src) != 4 or len(big) != 5 or len(out) != 4 \
            or not _same(src[0], 1) or not all(isinstance(d, IntImm) for d in (src[1], big[2], out[1])):
        return None
    r = int(big[2])
    if r < 2 or int(out[1]) != int(src[1]) * r or not all(_same(a, b) for a, b in zip(src[2:], out[2:])):
        return None
    return kv, r


def _per_head(call) -> bool:
    """Whether ``call`` treats the heads (axis 1 of a 4-D tensor) alike."""
    if call.op.same_as(PERMUTE_DIMS):
        axes = call.attrs.axes
        return axes is not None and [int(a) for a in axes] == [0, 1, 3, 2]
    if call.op.same_as(MULTIPLY):
        other = call.args[1]
        return isinstance(other, Constant) and len(other.ty.shape.values) == 0
    if call.op.same_as(BROADCAST_TO):
        src, out = _shape(call.args[0]), _shape(call)
        return src is not None and out is not None and len(src) == len(out) and all(map(_same, src, out))
    return False


@relax.expr_functor.mutator
class SharedHeads(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(MATMUL) or len(_shape(call.args[0]) or ()) != 3:
            return call
        found = self._chain(call.args[1])
        if found is None:
            return call
        (kv, r), chain = found
        y = kv
        for op in chain:  # from kv's end: each per-head op on the shared heads (an identity
            if not op.op.same_as(BROADCAST_TO):  # broadcast_to is no op)
                y = self.builder_.emit(relax.Call(op.op, [y, *op.args[1:]], op.attrs))
        _, heads, k, n = _shape(y)
        q = _shape(call.args[0])
        a = self.builder_.emit(relax.op.reshape(call.args[0], [heads, r, q[1], q[2]]))
        b = self.builder_.emit(relax.op.reshape(y, [heads, 1, k, n]))
        out = self.builder_.emit(relax.op.matmul(a, b, call.attrs.out_dtype))
        return relax.op.reshape(out, _shape(call))

    def _chain(self, expr):
        """``(repeat, per-head ops from the repeat on)`` behind a product's 3-D operand
        ``expr`` (``reshape(..., (H * r, K, N))`` of a 4-D tensor with a unit batch), or None."""
        flat = bound_value(expr, self.lookup_binding)
        if not (isinstance(flat, relax.Call) and flat.op.same_as(RESHAPE)):
            return None
        src, out = _shape(flat.args[0]), _shape(flat)
        if src is None or out is None or len(src) != 4 or len(out) != 3 or not _same(src[0], 1) \
                or not all(_same(a, b) for a, b in zip(src[1:], out)):
            return None
        chain, node = [], flat.args[0]
        while True:
            found = repeated(node, self.lookup_binding)
            if found is not None:
                return found, chain[::-1]
            call = bound_value(node, self.lookup_binding)
            if not (isinstance(call, relax.Call) and _per_head(call)):
                return None
            chain.append(call)
            node = call.args[0]


def shared_heads(mod, func: relax.Function) -> relax.Function:
    """``func`` with its grouped-query products reading the shared heads in place."""
    return relax.analysis.remove_all_unused(SharedHeads(mod).visit_expr(func))
