"""Hoisting broadcast subexpressions out of elementwise stages.

An elementwise stage evaluates its expression at every point of its shape. A part of the
expression that reads only broadcast operands (a squeeze-and-excitation block's
``x * sigmoid(fc(mean(x)) + b)``: the sigmoid's operand is ``(1, C, 1, 1)``, the stage
``(1, C, H, W)``) has the same value along the broadcast dims, yet was computed at every
point: EfficientNet-B0's SE blocks ran a sigmoid per element of their feature maps, not
per channel. :func:`hoist_broadcast_subexpressions` gives such a part that holds an
expensive op (a vecmath expansion, a divide, a square root) a stage of its own, over its
own smaller shape, writing a temp the stage then reads. That stage usually post-processes
a kernel's result, so :func:`jitbyoc.lower.fuse_epilogues` then folds it into the
kernel (the sigmoid becomes the SE block's 1x1 conv's epilogue).

Values are unchanged bit for bit: the same ops on the same operands, stored and reloaded
in their own dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from . import kir
from .ops import OPS

CHEAP_EXPANSIONS = frozenset({"clip"})  # a minimum and a maximum


def _expensive(op: str) -> bool:
    return (OPS[op].expand is not None and op not in CHEAP_EXPANSIONS) or op in ("divide", "sqrt")


def _varying(shape: tuple, stage_shape: tuple) -> tuple[bool, ...]:
    """Per dim of the stage: whether a buffer of ``shape`` (right-aligned) varies along it."""
    pad = len(stage_shape) - len(shape)
    return tuple(d >= pad and shape[d - pad] != 1 for d in range(len(stage_shape)))


def _node_facts(expr, stage_shape: tuple) -> dict:
    """``{id(node): (varying dims, holds an expensive op)}`` for every node of ``expr``."""
    info: dict[int, tuple] = {}
    none = tuple(False for _ in stage_shape)
    for node in kir.walk([expr]):
        if isinstance(node, kir.Load):
            info[id(node)] = (_varying(node.buf.shape, stage_shape), False)
        elif isinstance(node, (kir.Op, kir.Lookup)):  # a lookup varies as its operands
            args = [info[id(a)] for a in kir.operands(node)]
            vary = tuple(any(a[0][d] for a in args) for d in range(len(stage_shape)))
            info[id(node)] = (vary, isinstance(node, kir.Op) and _expensive(node.op) or any(a[1] for a in args))
        else:
            info[id(node)] = (none, False)
    return info


def _hoistable(node, info: dict, stage_shape: tuple) -> bool:
    vary, costly = info[id(node)]
    smaller = any(not v and d != 1 for v, d in zip(vary, stage_shape))
    return isinstance(node, kir.Op) and costly and smaller and node.dtype != "bool"


def _maximal(expr, info: dict, stage_shape: tuple) -> list:
    """The hoistable nodes of ``expr`` no hoistable node contains, each once."""
    found, seen, stack = [], set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if _hoistable(node, info, stage_shape):
            found.append(node)
        else:
            stack.extend(kir.operands(node))
    return found


def hoist_broadcast_subexpressions(kernel: kir.Kernel, make_temp: Callable) -> None:
    """Give each maximal broadcast subexpression with an expensive op of every elementwise
    stage a stage of its own before it (``make_temp(shape, dtype)`` makes its buffer)."""
    stages = []
    for stage in kernel.stages:
        if isinstance(stage, kir.Elementwise):
            stage = _hoist(stage, make_temp, stages)
        stages.append(stage)
    kernel.stages[:] = stages


def _hoist(stage: kir.Elementwise, make_temp: Callable, before: list) -> kir.Elementwise:
    mapping: dict = {}
    for _, expr in stage.stores:
        info = _node_facts(expr, stage.shape)
        for node in _maximal(expr, info, stage.shape):
            if node in mapping:
                continue
            shape = tuple(d if v else 1 for v, d in zip(info[id(node)][0], stage.shape))
            tmp = make_temp(shape, node.dtype)
            before.append(kir.Elementwise(shape, ((tmp, node),)))
            mapping[node] = kir.Load(tmp)
    if not mapping:
        return stage
    return kir.Elementwise(stage.shape, tuple((dst, kir.substitute(e, mapping)) for dst, e in stage.stores))
