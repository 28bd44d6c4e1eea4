"""Models that are float16 or bfloat16 already compute on jitbyoc's float32 kernels.

An ONNX float16 model (``onnxruntime.transformers.float16``, ``onnxconverter-common``) or a
bfloat16 one reaches jitbyoc with every tensor narrow. The CPU computes neither (Zen 4 has
no AVX512-FP16 arithmetic; bfloat16 has only its dot product), so each op that jitbyoc
takes in float32 but not narrow is rewritten, before partitioning, to

    astype(op(astype(x, "float32"), ...), narrow)

the semantics TVM's own build gives a narrow op (LLVM promotes each half operation to
float and rounds its result; TVM's bfloat16 legalization computes in float32 and rounds
each op's result). The casts are elementwise, so they fuse into the loops and epilogues
around them: a chain rounds in registers, as before, with no float32 tensor between ops.
Constant operands are widened here, once.

Products are where it differs from TVM, on purpose (the issue's "fp32 accumulation"):

* **bfloat16** ``matmul``/``conv2d`` become the bfloat16 product summed in float32
  (``out_dtype="float32"``: ``vdpbf16ps``, :mod:`jitbyoc.engines.products`), its result
  rounded once; constant weights stay bfloat16 (half the bytes) and are packed at build
  time as :func:`jitbyoc.lower_precision`'s are.
* **float16** products run in float32 on float16 operands made float32 exactly (constant
  weights once, here): every product of two halves is exact in float32 and the sum runs
  in float32, where TVM's build sums in float16.

An op jitbyoc takes narrow already (moves, compares, max/min) is left as it is, and so is
one it would not take in float32 either: TVM computes it as before.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir.rules import why_not
from . import inference, pool_concat
from .constants import constant, tensor_constant
from .linear import bound_value

NARROW = ("float16", "bfloat16")
WIDE = "float32"
ASTYPE = tvm.ir.Op.get("relax.astype")
MATMUL = tvm.ir.Op.get("relax.matmul")
CONV2D = tvm.ir.Op.get("relax.nn.conv2d")


def _dtype(expr) -> str:
    return str(getattr(getattr(expr, "ty", None), "dtype", ""))


def _narrow_of(call: relax.Call) -> str | None:
    """The narrow float dtype ``call`` reads or makes, or None."""
    for expr in (call, *call.args):
        if _dtype(expr) in NARROW:
            return _dtype(expr)
    return None


def has_narrow(func: relax.Function) -> bool:
    """Whether ``func`` has a float16 or bfloat16 tensor anywhere."""
    found = []

    def visit(expr):
        if not found and isinstance(expr, relax.Call) and _narrow_of(expr):
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


@relax.expr_functor.mutator
class Widen(relax.PyExprMutator):
    def __init__(self, mod, folding=(), prefix="widened", uses=None):
        super().__init__(mod)
        self.widened = {}  # narrow variable -> its float32 copy (one cast, however many readers)
        self.folding = folding  # convolutions a batch norm folds into (left narrow: see _prepared)
        self.emitted, self.prefix = 0, prefix
        self.uses = uses  # a var's name -> its uses, before prepare's rewrites (else None)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        narrow = _narrow_of(call)
        if narrow is None or call.op.same_as(ASTYPE) or why_not(call) is None or self._prepared(call):
            return call
        if _dtype(call) != narrow:  # a compare, or a product already into float32
            return call
        wide = self._product(call, narrow)
        wide = self._wide(call) if wide is None else wide
        if wide is None:
            return call
        return relax.op.astype(self._emit(wide), narrow)

    def _emit(self, expr):
        """``expr`` bound to a variable of a name of its own: prepare counts uses by name,
        and the builder's default names would add to the frontend's (a batch norm did not
        fold into a convolution named ``lv``)."""
        self.emitted += 1
        return self.builder_.emit(expr, name_hint=f"{self.prefix}{self.emitted}")

    def _prepared(self, call) -> bool:
        """Whether ``prepare`` rewrites ``call`` into other ops: ONNX's N-ary ``Sum`` into
        adds, a convolution with the batch norm after it folded into its weights. Left
        narrow here, the rewrite widened after (widening first hid the stack and the
        convolution from the rewrites: ResNet-50's residual sums ran as reductions, its
        batch norms as multiply-adds)."""
        if any(call.same_as(conv) for conv in self.folding):
            return True
        if self.uses is not None and pool_concat.splits(call, self.lookup_binding, self.uses):
            return True
        return call.op.same_as(inference.SUM) and \
            inference.summed_stack(call, lambda v: bound_value(v, self.lookup_binding)) is not None

    def _product(self, call, narrow: str):
        """A bfloat16 product summed in float32, if jitbyoc takes it."""
        if narrow != "bfloat16" or not (call.op.same_as(MATMUL) or call.op.same_as(CONV2D)):
            return None
        return self._taken(_with_out_dtype(call, call.args))

    def _wide(self, call):
        """``call`` on float32 operands into float32, if jitbyoc takes it so."""
        args = [self._widened(arg) for arg in call.args]
        if call.op.same_as(MATMUL) or call.op.same_as(CONV2D):
            return self._taken(_with_out_dtype(call, args))
        if len(call.ty_args):  # an op that declares its result type: not remade blind
            return None
        return self._taken(relax.Call(call.op, args, call.attrs))

    def _taken(self, wide):
        wide = self.builder_.normalize(wide)
        return wide if _dtype(wide) == WIDE and why_not(wide) is None else None

    def _widened(self, arg):
        if _dtype(arg) not in NARROW:
            return arg
        value = constant(arg)
        if value is not None:
            return tensor_constant(np.asarray(value, dtype=np.float32))
        if not isinstance(arg, relax.Var):
            return self._emit(relax.op.astype(arg, WIDE))
        if arg not in self.widened:
            self.widened[arg] = self._emit(relax.op.astype(arg, WIDE))
        return self.widened[arg]


def _with_out_dtype(call, args):
    """``call`` (matmul or conv2d) of ``args`` summed into float32."""
    if call.op.same_as(MATMUL):
        return relax.op.matmul(*args, out_dtype=WIDE)
    return inference.conv2d_like(call, *args, out_dtype=WIDE)


def _folding_convolutions(func: relax.Function) -> list:
    """The convolutions whose only reader is a batch norm (which ``prepare`` may fold)."""
    uses = inference.use_counts(func)
    bound = {str(b.var.name): b.value for block in getattr(func.body, "blocks", [])
             for b in block.bindings if isinstance(b, relax.VarBinding)}
    convs = []
    for value in bound.values():
        data = value.args[0] if isinstance(value, relax.Call) and value.op.same_as(inference.BATCH_NORM) else None
        source = bound.get(str(data.name)) if isinstance(data, relax.Var) and uses.get(str(data.name)) == 1 else None
        if isinstance(source, relax.Call) and source.op.same_as(CONV2D):
            convs.append(source)
    return convs


def widened(mod, func: relax.Function, first: bool = False) -> relax.Function:
    """``func`` with its narrow float ops computed in float32 (see the module's text);
    ``first``: before ``prepare``'s rewrites (the ops they rewrite are left to after).
    ``prepare`` calls it where :func:`has_narrow`."""
    folding = _folding_convolutions(func) if first else ()
    uses = inference.use_counts(func) if first else None
    widen = Widen(mod, folding, "widened" if first else "rewidened", uses)
    return relax.analysis.remove_all_unused(widen.visit_expr(func))
