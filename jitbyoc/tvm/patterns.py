"""TVM patterns, generated from the rule registry (:mod:`jitbyoc.ir.rules`).

Importing this module registers every pattern with TVM's pattern registry under the
``jitbyoc`` prefix (``get_patterns_with_prefix("jitbyoc")``): one per rule, then the
composites (anchor + bias + activation). A pattern's check function asks the op's rule
whether jitbyoc can take the matched call; what it refuses stays with TVM, and
:func:`reason` gives the reason for the offload report.

A call whose rule accepted it but whose lowering then failed is *rejected*: its
signature (op, operand and result types, attributes) is remembered with the error in the
build's session (:class:`~jitbyoc.toolchain.session.BuildSession`), and partitioning runs
again without it (:func:`jitbyoc.tvm.partition.partition_for_jitbyoc`), so a lowering
error never fails a build; the call stays with TVM. Rejections belong to the module being
partitioned: many depend on where the call sits (a region whose result alone shows a size
it makes, and feeds another region), so a refusal in one model must not follow the same
op into another. The patterns registered with TVM check the rules alone; partitioning
matches them with a check that also reads its session's rejections (:func:`one_pass`).
"""

from __future__ import annotations

from functools import partial, reduce

from tvm import relax
from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.dpl import CallPattern, is_op, wildcard
from tvm.relax.transform import FusionPattern

from .. import kernels  # noqa: F401 - registers every kernel's rule
from ..ir.rules import RULES, composite_ops, why_not

PREFIX = "jitbyoc"


def signature(call) -> str:
    """What a call's lowering depends on: its op, operand types and attributes (the same
    for the call in the module and its copy inside a region's composite function, whose
    result type may name a shape parameter instead)."""
    args = ", ".join(str(getattr(a, "ty", a)) for a in call.args)
    return f"{getattr(call.op, 'name', call.op)}({args}) {call.attrs}"


def reason(call, rejected: dict | None = None) -> str | None:
    """Why jitbyoc leaves ``call`` to TVM (its rule's reason, or a failed lowering among
    ``rejected``: call signature -> why), or None."""
    found = why_not(call)
    if found is None and rejected:
        failed = rejected.get(signature(call))
        return None if failed is None else f"lowering failed, left to TVM: {failed}"
    return found


def _accepts(rejected: dict | None, ctx) -> bool:
    """A match is taken when every call in it is (a single op: the matched call; a
    composite: each annotated call) and a composite's bias does not depend on its anchor."""
    calls = [ctx.matched_expr, *(e for e in ctx.annotated_expr.values() if isinstance(e, relax.Call))]
    return all(reason(e, rejected) is None for e in calls) and not _bias_depends_on_anchor(ctx)


_check = partial(_accepts, None)  # the registered patterns' check: the rules alone


def _bias_depends_on_anchor(ctx) -> bool:
    """Whether the bias add's other operand is computed from the anchor's result
    (``y = conv(x); y + (y * 2 + 1)``): the composite would then need its own output as
    an input, and the VM's code generator fails on the undefined variable
    (``FuseOpsByPattern`` catches only the shortest such cycles)."""
    add, anchor = ctx.annotated_expr.get("bias"), ctx.annotated_expr.get("anchor")
    start = ctx.value_to_bound_var.get(anchor) if add is not None else None
    if start is None:
        return False
    others = [a for a in add.args if isinstance(a, relax.Var) and not a.same_as(start)]
    add_var = ctx.value_to_bound_var.get(add)
    seen, todo = set(), [start]
    while todo and others:
        for user in ctx.var_usages.get(todo.pop(), []):
            if any(user.same_as(o) for o in others):
                return True
            if user not in seen and not (add_var is not None and user.same_as(add_var)):
                seen.add(user)
                todo.append(user)
    return False


def _op(name: str, *args):
    return is_op(name)(*args, *[wildcard() for _ in range(RULES[name].arity - len(args))])


OPS_USED: dict[str, frozenset] = {}  # pattern name -> the Relax ops it matches (all needed)


def composite_patterns() -> list[tuple]:
    """anchor (+ bias add) (+ activation): the seeds' conv2d+bias+relu, and matmul with a
    bias and an activation, for the ops whose rules take those places
    (:func:`jitbyoc.ir.rules.composite_ops`). Registered after the single ops: later wins."""
    out = []
    (bias,) = composite_ops("bias")
    for anchor in composite_ops("anchor"):
        for with_bias in (False, True):
            for act in [None, *composite_ops("activation")]:
                if not with_bias and act is None:
                    continue
                root = a = _op(anchor)
                ann = {"anchor": a}
                if with_bias:
                    root = ann["bias"] = _op(bias, root)
                if act is not None:
                    root = ann["act"] = _op(act, root)
                name = anchor.split(".")[-1] + ("_bias" if with_bias else "") + \
                    (f"_{act.split('.')[-1]}" if act else "")
                out.append((f"{PREFIX}.{name}", root, ann, _check))
                OPS_USED[f"{PREFIX}.{name}"] = frozenset([anchor] + ([bias] if with_bias else []) + ([act] if act else []))
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


SINGLE = f"{PREFIX}.op"  # the composite name of a single op matched by one_pass


def one_pass(found: list, rejected: dict | None = None) -> list:
    """``found`` (patterns in priority order) checked against the rules and the calls
    ``rejected`` (call signature -> why), with its single-op patterns folded into one
    alternation, matched last: ``FuseOpsByPattern`` walks the whole module once per
    pattern, about 9 ms a pattern on BERT-base whether or not it matches (its 21 patterns
    took 0.26 s, the folded 5 0.09 s). Single ops never overlap, so the partition is the
    same; :func:`name_single_ops` gives each composite its op's pattern name back."""
    check = partial(_accepts, rejected)
    singles = [p for p in found if len(OPS_USED.get(p.name, ())) == 1 and isinstance(p.pattern, CallPattern)
               and not p.annotation_patterns]
    if len(singles) < 2:
        return [FusionPattern(p.name, p.pattern, p.annotation_patterns, check) for p in found]
    either = reduce(lambda a, b: a | b, [p.pattern for p in singles])
    return [FusionPattern(p.name, p.pattern, p.annotation_patterns, check) for p in found if p not in singles] \
        + [FusionPattern(SINGLE, either, {}, check)]


def name_single_ops(mod):
    """Rename the composites :func:`one_pass` matched after their op, as its own pattern
    would have: ``jitbyoc.add`` rather than ``jitbyoc.op``."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and func.attrs and func.attrs.get("Composite") == SINGLE:
            call = func.body.blocks[0].bindings[0].value if func.body.blocks else func.body.body
            name = f"{PREFIX}.{call.op.name.removeprefix('relax.')}"
            mod[gv] = func.with_attr("Composite", name)
    return mod


def register() -> None:
    register_patterns(patterns())
