"""A rewrite within a kernel: slices of a permute's result, and permutes of those, read
the permute's input through a window (:class:`~.layout.Permute`'s ``begin``), so each
result is one copy of its own elements.

A fused ``q, k, v`` projection as timm's ViT and GPT-2 write it, ``reshape(qkv, (B, S, 3,
H, D))``, ``permute_dims(.., (2, 0, 3, 1, 4))``, three ``[i]`` slices and a transposed
``k``, copied the whole product three times more (the permute, the slices, on one thread,
and ``k``'s transpose); now the three results are three windowed permutes of the
product, ``k``'s transpose included. Registered with :func:`jitbyoc.ir.rules.rewrite`.
"""

from __future__ import annotations

from ..ir import kir
from ..ir.rules import rewrite
from .fold_permutes import drop_if_unread, permute_making
from .layout import Permute
from .slicing import Slice


@rewrite
def fold_slices(kernel: kir.Kernel) -> None:
    """Until nothing changes: a unit-step slice of a permute's fresh temp becomes a
    windowed permute of the permute's input, and a permute of a (windowed) permute's
    fresh temp, read as it is or without leading unit dims, one permute of the first's
    input. A permute left unread is dropped."""
    while _fold_one(kernel):
        pass


def _fold_one(kernel: kir.Kernel) -> bool:
    for k, stage in enumerate(kernel.stages):
        if not isinstance(stage, (Slice, Permute)) or stage.epilogue is not None:
            continue
        producer = permute_making(kernel, stage.inputs[0].storage, windowed=True)
        folded = None if producer is None else _composed(producer, stage)
        if folded is None:
            continue
        kernel.stages[k] = folded
        drop_if_unread(kernel, producer)
        return True
    return False


@rewrite
def cast_while_permuting(kernel: kir.Kernel) -> None:
    """A float32 permute's fresh temp that only a cast to bfloat16 reads (the bf16 mode's
    Q and K^T for attention, attention's heads merged for the next product): the permute
    writes the cast's output, converting as it copies, and the cast's pass is gone."""
    for stage in [s for s in kernel.stages if isinstance(s, kir.Elementwise) and len(s.stores) == 1]:
        (dst, expr), = stage.stores
        if not (isinstance(expr, kir.Op) and expr.op == "astype" and isinstance(expr.args[0], kir.Load)
                and (expr.in_dtype, dst.dtype) == ("float32", "bfloat16")):
            continue
        seen = expr.args[0].buf
        producer = permute_making(kernel, seen.storage, windowed=True)
        if producer is None or tuple(seen.shape) != tuple(dst.shape) \
                or any(seen.storage in kir.stage_reads(s) for s in kernel.stages if s is not stage):
            continue
        producer.out = kir.view(dst, producer.out.shape)
        kernel.temps.remove(seen.storage)
        kernel.stages.remove(stage)


def _composed(producer: Permute, stage) -> Permute | None:
    """``stage`` (a slice or a permute) of ``producer``'s result as one permute of
    ``producer``'s input, or None."""
    src, begin = producer.inputs[0], list(producer.begin or [0] * producer.inputs[0].ndim)
    buf, axes = stage.inputs[0], producer.axes
    if isinstance(stage, Slice):
        if buf != producer.out or any(s != 1 for s in stage.step):
            return None
        for j, b in enumerate(stage.begin):
            begin[axes[j]] += b
        folded = Permute((src,), stage.out, axes=tuple(axes), begin=tuple(begin))
    else:
        u = producer.out.ndim - buf.ndim  # leading unit dims the reading view drops
        if any(stage.begin) or u < 0 or tuple(buf.shape) != tuple(producer.out.shape[u:]) \
                or any(d != 1 for d in producer.out.shape[:u]):
            return None
        out = stage.out if u == 0 else kir.view(stage.out, (1,) * u + tuple(stage.out.shape))
        composed = tuple(axes[:u]) + tuple(axes[u + a] for a in stage.axes)
        folded = Permute((src,), out, axes=composed, begin=tuple(begin))
    return folded if _reads_rows_whole(folded) else None


def _reads_rows_whole(permute: Permute) -> bool:
    """Whether the window spans the input's innermost dim of more than one element whole
    (the permute's row copies and tile transposes read that dim contiguously)."""
    shape, ext = permute.inputs[0].shape, permute.extents()
    inner = next((a for a in reversed(range(len(shape))) if shape[a] != 1), None)
    return inner is None or ext[inner] == shape[inner]
