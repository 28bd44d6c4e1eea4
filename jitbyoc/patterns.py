"""Patterns and check functions, generated from the op table.

Importing this module registers every pattern with TVM's pattern registry under the
``jitbyoc`` prefix (``get_patterns_with_prefix("jitbyoc")``). A check function decides
at partition time whether jitbyoc can take a matched op; what it refuses stays with TVM,
and :func:`why_not` gives the reason for the offload report.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from tvm import relax
from tvm.ir.expr import Var as SizeVar
from tvm.ir.prim import FloatImm, IntImm
from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.dpl import is_op, wildcard

from .dtypes import DTYPES
from .ops import OPS, RELAX_OPS

PREFIX = "jitbyoc"


def dims(ty) -> list | None:
    """Static ints and symbolic names of a tensor type, or None if the shape is unknown
    or has a compound symbolic dim (``n * 2``)."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    out = []
    for d in shape.values:
        if isinstance(d, IntImm):
            out.append(int(d))
        elif isinstance(d, SizeVar):
            out.append("sym_" + d.name)
        else:
            return None
    return out


def tensor_problem(ty, allowed) -> str | None:
    """Why a tensor type cannot be lowered, or None."""
    if not isinstance(ty, relax.TensorType):
        return f"operand of type {ty} is not a tensor"
    if str(ty.dtype) not in DTYPES or str(ty.dtype) not in allowed:
        return f"dtype {ty.dtype} not supported (supported: {sorted(set(allowed) & set(DTYPES))})"
    if dims(ty) is None:
        return f"shape {getattr(ty, 'shape', '?')} is unknown or has a compound symbolic dim"
    return None


def broadcast_problem(in_dims: list, out_dims: list) -> str | None:
    if len(in_dims) > len(out_dims):
        return f"operand rank {len(in_dims)} exceeds result rank {len(out_dims)}"
    for a, o in zip(reversed(in_dims), reversed(out_dims)):
        if a != 1 and a != o:
            return f"cannot prove broadcast of dim {a} to {o}"
    return None


def _attrs(call) -> dict:
    """The attributes a table row needs, taken from the Relax call."""
    name = RELAX_OPS[call.op.name]
    if name == "astype":
        return {"to": str(call.attrs.dtype)}
    if name == "clip":
        return {"lo": float(call.args[1].value), "hi": float(call.args[2].value)}
    return {}


def elementwise_problem(call) -> str | None:
    name = RELAX_OPS[call.op.name]
    row = OPS[name]
    out = call.ty
    if name == "clip":
        if not all(isinstance(a, (FloatImm, IntImm)) for a in call.args[1:]):
            return "clip bounds are not constants"
        operands = call.args[:1]
    else:
        operands = call.args
    for k, arg in enumerate(operands):
        allowed = DTYPES if (name == "where" and k == 0) else row.dtypes
        if name == "where" and k == 0 and str(getattr(arg.ty, "dtype", "")) != "bool":
            return "where condition is not bool"
        problem = tensor_problem(arg.ty, allowed)
        if problem:
            return f"{call.op.name}: {problem}"
    mixed = {str(a.ty.dtype) for k, a in enumerate(operands) if not (name == "where" and k == 0)}
    if len(mixed) > 1:  # Relax lets comparisons mix dtypes; the rules take one
        return f"{call.op.name}: operands have different dtypes {sorted(mixed)}"
    problem = tensor_problem(out, DTYPES)
    if problem:
        return f"{call.op.name} result: {problem}"
    for arg in operands:
        problem = broadcast_problem(dims(arg.ty), dims(out))
        if problem:
            return f"{call.op.name}: {problem}"
    return None


@lru_cache(maxsize=None)
def checks() -> dict[str, tuple[int, Callable]]:
    """Relax op name -> (pattern arity, problem function): the op table's rows, then the
    kernels registered in ``jitbyoc/kernels/``."""
    from .kernels import load_all

    table = {relax_name: (3 if name == "clip" else OPS[name].arity, elementwise_problem)
             for relax_name, name in RELAX_OPS.items()}
    table.update({name: (spec.arity, spec.check) for name, spec in load_all().items()})
    return table


def why_not(call) -> str | None:
    """Why jitbyoc leaves a Relax call to TVM, or None if it takes it."""
    op = getattr(call.op, "name", None)
    if op not in checks():
        return f"no jitbyoc rule for {op or type(call.op).__name__}"
    try:
        return checks()[op][1](call)
    except Exception as err:  # a malformed call is TVM's to handle, never a crash here
        return f"{op}: not analysable ({type(err).__name__}: {err})"


def _check(ctx) -> bool:
    return why_not(ctx.matched_expr) is None


def _check_all(ctx) -> bool:
    """A composite is taken when every call in it is."""
    return all(why_not(e) is None for e in ctx.annotated_expr.values() if isinstance(e, relax.Call))


def _op(name: str, *args):
    return is_op(name)(*args, *[wildcard() for _ in range(checks()[name][0] - len(args))])


ACTIVATIONS = ("relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu",
               "relax.sigmoid", "relax.tanh")


OPS_USED: dict[str, frozenset] = {}  # pattern name -> the Relax ops it matches (all needed)


def composite_patterns() -> list[tuple]:
    """anchor (+ bias add) (+ activation): the seeds' conv2d+bias+relu, and matmul/linear
    with a bias and an activation. Registered after the single ops: later wins."""
    out = []
    for anchor in ("relax.nn.conv2d", "relax.matmul", "relax.linear"):
        if anchor not in checks():
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
    for relax_name, (arity, _) in checks().items():
        # arity is the least operand count: optional trailing operands (strided_slice's
        # strides) match too
        pat = is_op(relax_name)(*[wildcard() for _ in range(arity)], varg_default_wildcard=True)
        out.append((f"{PREFIX}.{relax_name.removeprefix('relax.')}", pat, {}, _check))
        OPS_USED[out[-1][0]] = frozenset([relax_name])
    return out + composite_patterns()


def register() -> None:
    register_patterns(patterns())
