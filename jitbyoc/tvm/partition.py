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

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix
from tvm.relax.transform import FuseOpsByPattern

from .. import lower
from ..ir.errors import LoweringError, RegionSizeError
from ..memo import LRU
from ..render import isa
from ..toolchain.session import BuildSession
from . import constants, patterns
from .composite_types import retype_composites
from .merge import merge_regions
from .patterns import OPS_USED, PREFIX
from .prepare import prepare
from .turn import TVM_TURN

log = logging.getLogger("jitbyoc")


def regions(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, relax.Function]:
    return {gv: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == PREFIX}


# Partitions of the last few modules, by the *identity* of their functions: a rebuild of
# the same module object (functions are immutable; editing a module replaces them) skips
# partitioning. Never by a hash: TVM's 64-bit structural hash collides on ordinary shapes.
# A bounded, locked cache: what a build takes from it goes into its session.
MEMO_ENTRIES = 4  # a module can hold its weights as constants: keep few
_MEMO = LRU(MEMO_ENTRIES)  # identity -> (module, partitioned module, lowered regions, rejections)


def _identity(mod: tvm.IRModule, machine: isa.Machine) -> tuple:
    """The module's identity and the machine it is partitioned for (kernel plans follow
    the machine's registers: :mod:`jitbyoc.render.isa`)."""
    return tuple((gv.name_hint, f.__chandle__()) for gv, f in mod.functions.items()) + \
        (mod.attrs.__chandle__() if mod.attrs is not None else 0, machine)


def partition_for_jitbyoc(mod: tvm.IRModule, build: BuildSession | None = None) -> tvm.IRModule:
    """Partition ``mod`` into jitbyoc regions and what stays with TVM.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module (high-level ops, before legalization).
    build : BuildSession, optional
        The build this partition is for: it receives each region's lowering and the
        calls whose lowering failed (with the reason). A session of its own by default.

    Returns
    -------
    tvm.IRModule
        The module with each region outlined into a function carrying
        ``Codegen="jitbyoc"``; ``relax.transform.RunCodegen()`` compiles them.
    """
    build = build if build is not None else BuildSession()
    key = _identity(mod, build.machine)
    hit = _MEMO.get(key)  # a rebuild of an unchanged model: partitioning is pure
    if hit is None:
        fresh = BuildSession(build.machine, writes_overlap=build.writes_overlap)  # this module's own
        with isa.compiling_for(build.machine):
            part = _partition(mod, fresh)
        hit = (mod, part, fresh.lowered, fresh.rejected)  # the module is kept: its functions' handles stay theirs
        _MEMO.put(key, hit)
    build.lowered.update(hit[2])
    build.rejected.update(hit[3])  # the report gives their reasons
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


CHECK_MISS = "jitbyoc_check_miss"  # set on the log record of a region its op checks passed but that failed to lower


def _partition(mod: tvm.IRModule, build: BuildSession) -> tvm.IRModule:
    """Partition and lower every region into ``build`` (:func:`_form_regions`)."""
    try:  # prepared weights are written in the background meanwhile (constants.py)
        return _partition_prepared(mod, build)
    finally:
        if not build.writes_overlap:
            constants.finish_writes()


def _partition_prepared(mod: tvm.IRModule, build: BuildSession) -> tvm.IRModule:
    ops = _ops_in(mod)
    with TVM_TURN:
        prepared = prepare(mod, ops)
    if prepared is not mod:  # folding may have removed ops (shape_of, pad)
        mod, ops = prepared, _ops_in(prepared)
    return _form_regions(mod, ops, build)


def _form_regions(mod: tvm.IRModule, ops: set[str], build: BuildSession) -> tvm.IRModule:
    """Regions are formed from the calls whose rules accept them, then lowered to kernel
    IR (no rendering): lowering is the check of what only a whole region shows.

    * A :class:`RegionSizeError` (the region's boundary leaves a symbolic size undefined:
      dynamic batches, ``torch.export``'s scaled lengths) rejects the call that makes the
      size, or the region, and the regions are formed again without it.
    * Any other lowering failure means an op's rule accepted a call its builder cannot
      build: a jitbyoc bug. It is logged as an error (the tests fail on it), and the call
      stays with TVM, so the build still succeeds.

    Each pass rejects at least one more call, or partitioning stops, so it ends."""
    composites = True
    while True:
        seen = len(build.rejected)
        try:
            return _partition_once(mod, ops, build, composites)
        except RegionSizeError as err:
            log.info("%s; regions formed again without it", err)
        except LoweringError as err:
            log.error("jitbyoc: an op's rule accepted a call its builder failed on (a jitbyoc bug): "
                      "%s; that op stays with TVM", err, extra={CHECK_MISS: True})
        except tvm.error.InternalError as err:  # TVM's own passes on what the patterns matched
            why = str(err).strip().splitlines()[-1]
            if not composites:
                log.warning("jitbyoc: partitioning failed in TVM (%s); all of it stays with TVM", why)
                break
            # a composite (matmul + add) whose other operand depends on its anchor through
            # an op left to TVM (add(a, sort(a))) makes a cycle FuseOpsByPattern refuses;
            # single ops, merged by jitbyoc's own region merging, do not
            log.info("jitbyoc: partitioning failed in TVM (%s); again with single ops", why)
            composites = False
            continue
        if len(build.rejected) == seen:
            log.warning("jitbyoc: a region failed again without rejecting a new call; all of it stays with TVM")
            break
    build.lowered.clear()
    return mod


def _calls(func: relax.Function) -> list:
    found: list = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _sizes_its_inputs_define(func: relax.Function, name: str, feeds_region: bool) -> None:
    """Raise a :class:`LoweringError` naming the call that makes a size the region's
    arguments do not define: a region whose input is ``(2 * n, 64)`` and whose reshape
    outputs ``(2, n, 128)`` (Llama through ``torch.export`` at batch 2 with a dynamic
    length) cannot be declared, and TVM's ``RunCodegen`` fails on it. That call then
    stays with TVM, which knows ``n`` where it calls the region. With no such call, a
    region that ``feeds_region`` another is refused whole (RunCodegen fails on it too)."""
    free = {str(f) for f in relax.analysis.free_symbolic_vars(func)}
    # by name: the calls' types may hold other objects of them. Only sizes inside its
    # arguments' compound dims: a reshape to sizes the caller made (match_cast) is fine
    in_args = {str(v) for p in func.params for d in _shape_values(p.ty)
               for v in tirx.analysis.undefined_vars(d)}
    names = free & in_args
    # sizes no argument shows (a broadcast_to (1, 64) -> (n, 1, 64) alone): the region's
    # own result shows them, which RunCodegen fails on when another region reads it
    unseen = free - in_args if feeds_region else set()
    if not names | unseen:
        return
    for call in _calls(func):  # the first whose result has such a size as a dim of its own
        made = {str(d) for d in _result_dims(call) if isinstance(d, tirx.Var)} & (names | unseen)
        if made:
            how = "no argument of the region shows" if made & unseen else \
                "its inputs show only inside compound dims"
            err = RegionSizeError(f"region {name}: {call.op.name} makes size(s) "
                                f"{', '.join(sorted(made))} {how}")
            err.subject = call
            raise err
    # no call makes it: the region shows it only inside compound dims, inputs and outputs
    # alike ((4 * n, 48) -> (4 * n, 48)); RunCodegen fails when another region reads that
    if feeds_region:
        raise RegionSizeError(f"region {name}: size(s) {', '.join(sorted(names))} appear only inside "
                            "compound dims of its arguments and results")


def _result_dims(call: relax.Call) -> list:
    """The dims of ``call``'s result: its type's, or where that names a shape parameter
    instead (a broadcast_to in a region's composite function), that shape's."""
    return _shape_values(call.ty) or [d for a in call.args
                                      for d in getattr(getattr(a, "ty", None), "values", None) or []]


def _shape_values(ty) -> list:
    """The dims of a tensor type's shape, [] when it has none to read."""
    return list(getattr(getattr(ty, "shape", None), "values", None) or [])


def _feeding_regions(mod: tvm.IRModule) -> set:
    """The regions whose results another region's call reads (by global name), directly
    or through an element of a region's tuple result (MobileViT with a dynamic batch)."""
    found: set = set()
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or func.attrs and "Codegen" in func.attrs:
            continue
        made_by: dict = {}
        for block in getattr(func.body, "blocks", []):
            for b in block.bindings:
                value = b.value
                if isinstance(value, relax.TupleGetItem) and value.tuple_value in made_by:
                    made_by[b.var] = made_by[value.tuple_value]
                elif isinstance(value, relax.Var) and value in made_by:
                    made_by[b.var] = made_by[value]
                elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
                    found.update(made_by[a] for a in value.args if isinstance(a, relax.Var) and a in made_by)
                    made_by[b.var] = value.op.name_hint
    return found


def _lower(gv: tvm.ir.GlobalVar, func: relax.Function, feeds_region: bool, rejected: dict) -> lower.Lowered:
    try:
        _sizes_its_inputs_define(func, gv.name_hint, feeds_region)
        return lower.lower_region(func, gv.name_hint)
    except LoweringError as err:
        subject = err.subject
        for call in [subject] if isinstance(subject, relax.Call) else _calls(func):
            rejected[patterns.signature(call)] = str(err)
        raise


def _partition_once(mod: tvm.IRModule, ops: set[str], build: BuildSession, composites: bool = True) -> tvm.IRModule:
    # only patterns whose ops all occur (``ops``; matching costs per pattern and node:
    # ResNet-18's and the encoder's partitioning took 22 ms with all 92); without
    # ``composites``, single ops only (merge_regions still gathers them into regions)
    found = [p for p in get_patterns_with_prefix(PREFIX) if OPS_USED.get(p.name, frozenset()) <= ops
             and (composites or len(OPS_USED.get(p.name, ())) == 1)]
    fuse = FuseOpsByPattern(patterns.one_pass(found, build.rejected), bind_constants=False, annotate_codegen=False)
    with TVM_TURN:  # TVM's passes; lowering the regions below is jitbyoc's own work
        mod = fuse(mod)
        retyped = retype_composites(mod)
        if retyped is not mod:  # ops after a re-declared composite see their operands' shapes now
            mod = fuse(retyped)
        mod = patterns.name_single_ops(mod)
        mod = merge_regions(mod)
    codes: dict[str, str] = {}  # code symbol -> its key: distinct code never shares a name
    build.lowered.clear()  # region function handle -> (function, Lowered)
    feeding = _feeding_regions(mod)
    for gv, func in regions(mod).items():
        low = _lower(gv, func, gv.name_hint in feeding, build.rejected)
        if codes.setdefault(low.kernel.name, low.key) != low.key:
            raise RuntimeError(f"jitbyoc: two different regions share the code symbol "
                               f"'{low.kernel.name}' (a 64-bit digest prefix collision)")
        named = func.with_attr("global_symbol", lower.instance_symbol(low))
        build.lowered[named.__chandle__()] = (named, low)
        mod[gv] = named
    return mod
