"""Model FLOPs, counted from a Relax module: 2 x the multiply-accumulates of its convolutions,
matrix products and attention calls.

One method for every model, whichever frontend made it: walk the module's Relax functions
for calls of ``relax.nn.conv1d/2d/3d``, ``relax.matmul`` and ``relax.nn.attention`` and
read the shapes off their struct info (the frontends infer every shape; batch 1 here).
Gemm and ``nn.Linear`` arrive as ``matmul`` (``permute_dims`` + ``matmul``), so they are
counted too. Everything else (elementwise ops, pooling, norms, softmax) is left out: it is
a few percent of a CNN's or transformer's arithmetic, and the usual convention. Calls with
a symbolic shape are not counted (none of the zoo models has one).
"""

from __future__ import annotations

import math

CONVS = {"relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d"}


def _shape(expr) -> tuple[int, ...] | None:
    """The static shape of a tensor expression, or None (unknown or symbolic)."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)  # TVM 0.27: struct info is .ty
    if shape is None or not hasattr(shape, "values"):
        return None
    try:
        return tuple(int(d) for d in shape.values)
    except TypeError:  # a symbolic dimension
        return None


def call_macs(call) -> int:
    """Multiply-accumulates of one Relax call (0 for an operator that is not counted).

    A convolution does ``prod(weight) / out_channels`` MACs (input channels per group x
    window) for each output element; ``matmul`` does ``K = a.shape[-1]`` per output
    element; ``attention(q, k, v)`` with q ``(B, S, H, D)``, k ``(B, Sk, H, D)``,
    v ``(B, Sk, H, Dv)`` does ``B H S Sk (D + Dv)`` (scores, then the weighted sum).
    """
    name = getattr(call.op, "name", "")
    out = _shape(call)
    if name in CONVS:
        weight = _shape(call.args[1])
        if out is None or weight is None:
            return 0
        out_channels = weight[str(call.attrs.kernel_layout).index("O")]
        return math.prod(out) * (math.prod(weight) // out_channels)
    if name == "relax.matmul":
        a = _shape(call.args[0])
        return 0 if out is None or a is None else math.prod(out) * a[-1]
    if name == "relax.nn.attention":
        q, k, v = (_shape(a) for a in call.args[:3])
        if None in (q, k, v):
            return 0
        return q[0] * q[2] * q[1] * k[1] * (q[3] + v[3])
    return 0


def _operand_dtype(call) -> str | None:
    dtype = getattr(getattr(call.args[0], "ty", None), "dtype", None) if call.args else None
    return None if dtype is None else str(dtype)


def count_flops(mod, operand_dtype: str | None = None) -> int:
    """FLOPs of one call of ``mod``'s Relax functions: 2 x :func:`call_macs` over its calls.

    Parameters
    ----------
    mod : tvm.IRModule
        A module as a frontend made it (before any build: calls not yet lowered).
    operand_dtype : str, optional
        Count only the products whose first operand has this dtype (``"bfloat16"``: the
        products ``jitbyoc.lower_precision`` rewrote).

    Returns
    -------
    int
        Floating-point operations, counting a multiply-add as two.
    """
    from tvm import relax

    macs = []

    def visit(e):
        if isinstance(e, relax.Call) and operand_dtype in (None, _operand_dtype(e)):
            macs.append(call_macs(e))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return 2 * sum(macs)
