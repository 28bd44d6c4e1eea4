"""TVM patterns, generated from the rule registry (:mod:`jitbyoc.ir.rules`).

Importing this module registers every pattern with TVM's pattern registry under the
``jitbyoc`` prefix (``get_patterns_with_prefix("jitbyoc")``): one per rule, then the
composites (anchor + bias + activation). A pattern's check function asks the op's rule
whether jitbyoc can take the matched call; what it refuses stays with TVM, and
:func:`jitbyoc.ir.rules.why_not` gives the reason for the offload report.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.dpl import is_op, wildcard

from .. import kernels  # noqa: F401 - registers every kernel's rule
from ..ir.rules import RULES, why_not

PREFIX = "jitbyoc"


def _check(ctx) -> bool:
    return why_not(ctx.matched_expr) is None


def _check_all(ctx) -> bool:
    """A composite is taken when every call in it is."""
    return all(why_not(e) is None for e in ctx.annotated_expr.values() if isinstance(e, relax.Call))


def _op(name: str, *args):
    return is_op(name)(*args, *[wildcard() for _ in range(RULES[name].arity - len(args))])


ACTIVATIONS = ("relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu",
               "relax.sigmoid", "relax.tanh")


OPS_USED: dict[str, frozenset] = {}  # pattern name -> the Relax ops it matches (all needed)


def composite_patterns() -> list[tuple]:
    """anchor (+ bias add) (+ activation): the seeds' conv2d+bias+relu, and matmul/linear
    with a bias and an activation. Registered after the single ops: later wins."""
    out = []
    for anchor in ("relax.nn.conv2d", "relax.matmul", "relax.linear"):
        if anchor not in RULES:
            continue
        for with_bias in (False, True):
            for act in (None,) + ACTIVATIONS:
                if not with_bias and act is None:
                    continue
                root = a = _op(anchor)
                ann = {"anchor": a}
                if with_bias:
                    root = ann["bias"] = _op("relax.add", root)
                if act is not None:
                    root = ann["act"] = _op(act, root)
                name = anchor.split(".")[-1] + ("_bias" if with_bias else "") + \
                    (f"_{act.split('.')[-1]}" if act else "")
                out.append((f"{PREFIX}.{name}", root, ann, _check_all))
                OPS_USED[f"{PREFIX}.{name}"] = frozenset(
                    [anchor] + (["relax.add"] if with_bias else []) + ([act] if act else []))
    return out


def patterns() -> list[tuple]:
    out = []
    for relax_name, rule in RULES.items():
        # arity is the least operand count: optional trailing operands (strided_slice's
        # strides) match too
        pat = is_op(relax_name)(*[wildcard() for _ in range(rule.arity)], varg_default_wildcard=True)
        out.append((f"{PREFIX}.{relax_name.removeprefix('relax.')}", pat, {}, _check))
        OPS_USED[out[-1][0]] = frozenset([relax_name])
    return out + composite_patterns()


def register() -> None:
    register_patterns(patterns())
