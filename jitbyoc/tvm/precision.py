"""Lower precision, opt-in: :func:`lower_precision` rewrites a float32 model's products
to bfloat16 operands summed in float32, as OpenVINO's ``INFERENCE_PRECISION_HINT=bf16``
and torch's ``autocast(dtype=torch.bfloat16)`` compute them.

The rewrite is Relax, not a jitbyoc setting hidden in the build: ``matmul(x, W)`` of a
float32 ``x`` and a constant weight ``W`` becomes ``matmul(astype(x, "bfloat16"), W',
out_dtype="float32")`` with ``W'`` the weight rounded to bfloat16 once, here. The
rewritten module means the same thing to TVM's own build (its differential reference)
as to jitbyoc's, which runs the product on ``vdpbf16ps`` (:mod:`jitbyoc.engines.products`)
and reads ``W'`` from panels packed at build time. Everything else (elementwise work,
norms, softmax, attention's products of two activations, convolutions for now) stays
float32, and the default stays float32 and exact.

Error: each operand is rounded to nearest even once (relative error at most 2**-9), the
products of two bfloat16 values are exact in float32, and the sum runs in float32; so
``|y - x @ W| <= (2 * 2**-9 + 2**-18) * (|x| @ |W|) + gamma_K * (|x'| @ |W'|)``
elementwise (``gamma_K`` as in :mod:`jitbyoc.kernels.matmul`).
"""

from __future__ import annotations

import ml_dtypes
import tvm
from tvm import relax

from .constants import tensor_constant
from .inference import MATMUL
from .linear import _weight_value

PRECISIONS = ("bf16",)


@relax.expr_functor.mutator
class _ToBFloat16(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(MATMUL):
            return call
        x, weight = call.args
        value = _weight_value(weight, self.lookup_binding)
        if value is None or value.ndim != 2 or str(value.dtype) != "float32" \
                or str(x.ty.dtype) != "float32" or str(call.ty.dtype) != "float32":
            return call
        narrow = self.builder_.emit(relax.op.astype(x, "bfloat16"))
        return relax.op.matmul(narrow, tensor_constant(value.astype(ml_dtypes.bfloat16)), "float32")


def lower_precision(mod: tvm.IRModule, precision: str = "bf16") -> tvm.IRModule:
    """``mod`` with its float32 products of a constant weight (linear layers, torch's
    ``x @ W.T`` included) computed from bfloat16 operands summed in float32; build the
    result with ``tvm.compile`` as any module. ``precision``: ``"bf16"``."""
    if precision not in PRECISIONS:
        raise ValueError(f"jitbyoc.lower_precision: precision {precision!r} is not one of {PRECISIONS}")
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            func = relax.analysis.remove_all_unused(_ToBFloat16(mod).visit_expr(func))
        out[gv] = func
    return tvm.IRModule(out, attrs=mod.attrs)
