"""The offload report: what each region holds, and why every other op stayed with TVM."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from ..toolchain import session
from ..toolchain.session import BuildSession
from . import patterns
from .partition import PREFIX, partition_for_jitbyoc, regions


def _ty(expr) -> str:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType):
        shape = getattr(ty.shape, "values", None)
        dims = "x".join(str(int(d)) if hasattr(d, "value") else str(d) for d in shape) \
            if shape is not None else "?"
        return f"{ty.dtype}[{dims}]"
    return str(ty)


@dataclass
class RegionInfo:
    symbol: str
    ops: list[str]
    inputs: list[str]
    outputs: list[str]
    cache: str = ""
    calls: int = 1  # identical regions share one function (and one compiled kernel)


@dataclass
class Fallback:
    function: str
    var: str
    op: str
    types: str
    reason: str


@dataclass
class Report:
    regions: list[RegionInfo] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # jitbyoc's share of a build, in seconds

    @property
    def offloaded_ops(self) -> int:
        return sum(len(r.ops) * r.calls for r in self.regions)

    @property
    def total_ops(self) -> int:
        return self.offloaded_ops + len(self.fallbacks)

    @property
    def offloaded_share(self) -> float:
        return self.offloaded_ops / self.total_ops if self.total_ops else 0.0

    def __str__(self) -> str:
        lines = [f"jitbyoc offload report: {self.offloaded_ops}/{self.total_ops} ops offloaded "
                 f"in {len(self.regions)} regions"]
        if self.timings:
            lines[0] += " (" + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms"
                                         for k, v in self.timings.items()) + ")"
        for r in self.regions:
            cache = f" [{r.cache}]" if r.cache else ""
            calls = f" x{r.calls}" if r.calls > 1 else ""
            lines.append(f"  region {r.symbol}{calls}{cache}")
            lines.append(f"    ops:     {', '.join(r.ops)}")
            lines.append(f"    inputs:  {', '.join(r.inputs)}")
            lines.append(f"    outputs: {', '.join(r.outputs)}")
        for f in self.fallbacks:
            lines.append(f"  left to TVM: {f.function}.{f.var} = {f.op}({f.types}): {f.reason}")
        return "\n".join(lines)


def _region_info(func: relax.Function) -> RegionInfo:
    ops: list[str] = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            ops.append(e.op.name)

    relax.analysis.post_order_visit(func.body, visit)
    ret = func.body.body
    outs = ret.fields if isinstance(ret, relax.Tuple) else [ret]
    return RegionInfo(str(func.attrs["global_symbol"]), ops,
                      [f"{p.name}: {_ty(p)}" for p in func.params], [_ty(o) for o in outs])


def _fallbacks(name: str, func: relax.Function, rejected: dict | None = None,
               why: str | None = None) -> list[Fallback]:
    found: list[Fallback] = []
    in_dataflow: set = set()

    def visit(e):
        if isinstance(e, relax.DataflowBlock):
            in_dataflow.update(id(b.value) for b in e.bindings)

    relax.analysis.post_order_visit(func.body, visit)
    for block in _blocks(func.body):
        for b in block.bindings:
            v = b.value
            if not (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)):
                continue
            reason = why or patterns.reason(v, rejected)
            if reason is None:
                reason = "outside a dataflow block" if not isinstance(block, relax.DataflowBlock) \
                    else "not matched"
            found.append(Fallback(name, b.var.name, v.op.name,
                                  ", ".join(_ty(a) for a in v.args), reason))
    return found


def _blocks(expr):
    """Binding blocks of ``expr``, descending into If branches."""
    if isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            yield block
            for b in block.bindings:
                yield from _blocks(b.value)
        yield from _blocks(expr.body)
    elif isinstance(expr, relax.If):
        yield from _blocks(expr.true_branch)
        yield from _blocks(expr.false_branch)


def _call_counts(mod: tvm.IRModule, targets) -> dict:
    counts = dict.fromkeys(targets, 0)

    def visit(e):
        if isinstance(e, relax.Call) and e.op in counts:
            counts[e.op] += 1

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and gv not in counts:
            relax.analysis.post_order_visit(func.body, visit)
    return counts


def build_report(partitioned: tvm.IRModule, rejected: dict | None = None) -> Report:
    rep = Report()
    offloaded = regions(partitioned)
    calls = _call_counts(partitioned, offloaded)
    for gv, func in partitioned.functions.items():
        if gv in offloaded:
            rep.regions.append(_region_info(func))
            rep.regions[-1].calls = max(calls[gv], 1)
        elif isinstance(func, relax.Function) and not (func.attrs and "Codegen" in func.attrs):
            rep.fallbacks.extend(_fallbacks(gv.name_hint, func, rejected))
    return rep


def report(mod: tvm.IRModule) -> Report:
    """The offload report for ``mod`` (partitioned here; nothing is compiled).

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module, before or after :func:`jitbyoc.partition_for_jitbyoc`.
    """
    if regions(mod):
        return build_report(mod)
    build = BuildSession()
    return build_report(partition_for_jitbyoc(mod, build), build.rejected)


def record(partitioned: tvm.IRModule, build: BuildSession) -> None:
    """Keep the report of a build in its session (``build``: what its codegen did), for
    :func:`last_report`."""
    rep = build_report(partitioned, build.rejected)
    status = build.status
    for r in rep.regions:
        r.cache = {"memory": "cache hit (memory)", "disk": "cache hit (disk)"}.get(status.get(r.symbol, ""),
                                                                                status.get(r.symbol, ""))
    rep.timings = dict(build.timings)
    build.report = rep
    session.reported(build)


def record_declined(mod: tvm.IRModule, why: str) -> None:
    """Keep, for :func:`last_report`, the report of a build jitbyoc left to TVM whole
    (every op with the reason ``why``)."""
    rep = Report()
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rep.fallbacks.extend(_fallbacks(gv.name_hint, func, why=why))
    declined = BuildSession(report=rep)
    session.remember(declined)
    session.reported(declined)


def last_report() -> Report | None:
    """The report of the most recent build made by this thread with jitbyoc enabled."""
    last = session.last_reported()
    return last.report if last is not None else None


__all__ = ["Report", "report", "last_report", "PREFIX"]
