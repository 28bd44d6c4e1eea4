"""``partition_for_jitbyoc``: the Relax counterpart of the seeds' MergeComposite ->
AnnotateTarget -> MergeCompilerRegions -> PartitionGraph.

Every supported op is matched by a pattern from :mod:`jitbyoc.tvm.patterns`; adjacent matches
in a dataflow block (including blocks inside ``If`` branches) merge into maximal regions;
each region becomes a function with ``Codegen="jitbyoc"`` whose ``global_symbol`` is
derived from a SHA-256 of its kernel's canonical text (:func:`jitbyoc.ir.kir.canonical`) and
of the user's names, so two regions only ever share a symbol when they share the code
behind it.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix
from tvm.relax.transform import FuseOpsByPattern

from .. import lower
from ..memo import LRU
from .merge import merge_regions
from .patterns import OPS_USED, PREFIX


def regions(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, relax.Function]:
    return {gv: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == PREFIX}


# Partitions of the last few modules, by the *identity* of their functions: a rebuild of
# the same module object (functions are immutable; editing a module replaces them) skips
# partitioning. Never by a hash: TVM's 64-bit structural hash collides on ordinary shapes.
MEMO_ENTRIES = 4  # a module can hold its weights as constants: keep few
_MEMO = LRU(MEMO_ENTRIES)  # identity -> (module, partitioned module, lowered regions)


def _identity(mod: tvm.IRModule) -> tuple:
    return tuple((gv.name_hint, f.__chandle__()) for gv, f in mod.functions.items()) + \
        (mod.attrs.__chandle__() if mod.attrs is not None else 0,)


def partition_for_jitbyoc(mod: tvm.IRModule) -> tvm.IRModule:
    """Partition ``mod`` into jitbyoc regions and what stays with TVM.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module (high-level ops, before legalization).

    Returns
    -------
    tvm.IRModule
        The module with each region outlined into a function carrying
        ``Codegen="jitbyoc"``; ``relax.transform.RunCodegen()`` compiles them.
    """
    key = _identity(mod)
    hit = _MEMO.get(key)  # a rebuild of an unchanged model: partitioning is pure
    if hit is None:
        hit = (mod, *_partition(mod))  # the module is kept: its functions' handles stay theirs
        _MEMO.put(key, hit)
    out = hit[1]
    # a fresh module each time: a caller that edits it in place must not edit the memo
    return tvm.IRModule(dict(out.functions), attrs=out.attrs)


def _ops_in(mod: tvm.IRModule) -> set[str]:
    """The names of the Relax ops ``mod`` calls."""
    ops: set[str] = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, lambda e: ops.add(e.op.name) if isinstance(
                e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return ops


def lowered(func: relax.Function) -> lower.Lowered:
    """The lowering of a partitioned region: the one partitioning made (while its module
    is memoized), or made now."""
    for _, _, low in _MEMO.values():
        hit = low.get(func.__chandle__())
        if hit is not None and hit[0].same_as(func):
            return hit[1]
    return lower.lower_region(func)


def _partition(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict]:
    # only patterns whose ops all occur (matching costs per pattern and node: ResNet-18's
    # and the encoder's partitioning took 22 ms with all 92)
    ops = _ops_in(mod)
    patterns = [p for p in get_patterns_with_prefix(PREFIX) if OPS_USED.get(p.name, frozenset()) <= ops]
    mod = FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=False)(mod)
    mod = merge_regions(mod)
    codes: dict[str, str] = {}  # code symbol -> its key: distinct code never shares a name
    low_by_handle: dict[int, tuple] = {}  # region function handle -> (function, Lowered)
    for gv, func in regions(mod).items():
        low = lower.lower_region(func, gv.name_hint)
        if codes.setdefault(low.kernel.name, low.key) != low.key:
            raise RuntimeError(f"jitbyoc: two different regions share the code symbol "
                               f"'{low.kernel.name}' (a 64-bit digest prefix collision)")
        named = func.with_attr("global_symbol", lower.instance_symbol(low))
        low_by_handle[named.__chandle__()] = (named, low)
        mod[gv] = named
    return mod, low_by_handle
