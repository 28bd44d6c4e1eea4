"""Cheaper rows where a result is rounded to bfloat16 anyway: an op whose every use casts
its float32 result to bfloat16 computes through its row's ``bf16_row`` (gelu's: a rational
erf, 18 operations a vector, where gelu's exp and series, exact to float32, take 44).
bfloat16 keeps 8 bits; the ``bf16_row`` errs by a fraction of the input far below what
rounding the input itself moves the result by (see each row's expansion)."""

from __future__ import annotations

from . import kir
from .ops import OPS


def _casts_to_bf16(node) -> bool:
    return isinstance(node, kir.Op) and node.op == "astype" \
        and (node.in_dtype, node.dtype) == ("float32", "bfloat16")


def narrowed(roots: list) -> list:
    """``roots`` with every float32 op that has a ``bf16_row`` and is read only by casts to
    bfloat16 computed through that row (a root is stored as it is: never narrowed)."""
    users: dict[int, list] = {}
    nodes = kir.walk(roots)
    for node in nodes:
        for arg in kir.operands(node):
            users.setdefault(id(arg), []).append(node)
    stored = {id(r) for r in roots}
    mapping = {n: kir.Op(OPS[n.op].bf16_row, n.args, n.in_dtype, n.dtype, n.attrs) for n in nodes
               if isinstance(n, kir.Op) and OPS[n.op].bf16_row and n.dtype == "float32"
               and id(n) not in stored
               and all(map(_casts_to_bf16, users.get(id(n), [])))}
    return kir.substitute_all(roots, mapping) if mapping else list(roots)


def narrow_rounded_results(kernel: kir.Kernel) -> None:
    """:func:`narrowed` on every elementwise stage's stores and every kernel's epilogue."""
    for k, stage in enumerate(kernel.stages):
        if isinstance(stage, kir.Elementwise):
            bufs, exprs = zip(*stage.stores)
            kernel.stages[k] = kir.Elementwise(stage.shape, tuple(zip(bufs, narrowed(list(exprs)))))
        elif isinstance(stage, kir.KernelStage):
            stage.map_epilogue(narrowed)
