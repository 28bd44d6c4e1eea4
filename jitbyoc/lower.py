"""Relax region -> kernel IR.

Elementwise ops become expression nodes and are never materialized on their own. A
kernel op (``jitbyoc/kernels/``) reads materialized buffers and writes one; region
outputs are stored by :class:`~jitbyoc.ir.kir.Elementwise` stages, one per distinct shape,
so outputs of one shape share a loop nest and compute common values once per point.
Afterwards :func:`fuse_epilogues` folds an elementwise stage that only post-processes a
kernel's result into that kernel, so ``conv2d -> add -> relu`` writes memory once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tvm import relax
from tvm.ir.expr import Constant
from tvm.ir.expr import Var as SizeVar

from . import kernels  # noqa: F401 - registers every kernel's rule
from .ir import kir
from .ir import quotients
from .ir import sizes as size_exprs
from .ir.errors import LoweringError, RegionSizeError, error_context
from .ir.hoist import hoist_broadcast_subexpressions
from .ir.narrow import narrow_rounded_results
from .ir.relax_types import SymbolicSizes, dim, dims, naming_sizes
from .ir.rules import REWRITES, RULES
from .kernels.concat_parts import place_concat_parts

PREFIX = "jitbyoc"  # code symbols are jitbyoc_<ops>_<digest>


@dataclass(frozen=True)
class Names:
    """The user's names of a region's arguments and symbolic sizes: data for error
    messages only. Generated code never contains them (buffers are ``in0``, ``out0``...,
    sizes ``sym0``...), so regions that differ only in names share their code."""
    args: tuple[str, ...]  # inputs, then "output0"...
    sizes: tuple[tuple[str, str], ...]  # (generated name, the user's name)

    @property
    def size_display(self) -> dict[str, str]:
        return dict(self.sizes)


class RegionLowering:
    def __init__(self, func: relax.Function, symbol: str):
        self.symbol = symbol
        self.func = func
        self.env: dict = {}
        self.local: dict = {}
        self.kernel = kir.Kernel(symbol, [], [])
        self.arg_names: list[str] = []
        self.sizes = SymbolicSizes()
        self.n_temps = 0  # temps are named by a counter: builders may drop theirs
        self.made_by: dict[str, relax.Call] = {}  # a symbolic size -> the first op whose result has it
        self.materialized: dict = {}  # node (hashed by identity) -> the buffer it was written to
        self.results: dict = {}  # a region output's var -> its buffer

    # ---- values ------------------------------------------------------------------------------
    def value(self, expr):
        if isinstance(expr, relax.Var):
            return self.env[expr]
        if isinstance(expr, relax.ShapeExpr):
            return expr  # a non-tensor operand (reshape's target shape): builders read the call
        if isinstance(expr, Constant) and getattr(expr.ty, "ndim", None) == 0:
            return kir.Const(expr.value.numpy().item(), str(expr.ty.dtype))
        if isinstance(expr, relax.Tuple):
            return tuple(self.value(f) for f in expr.fields)
        raise LoweringError(f"{self.symbol}: cannot lower operand {type(expr).__name__}")

    def temp(self, shape, dtype: str) -> kir.Buffer:
        buf = kir.Buffer(f"tmp{self.n_temps}", tuple(shape), dtype)
        self.n_temps += 1
        self.kernel.temps.append(buf)
        return buf

    def buffer(self, expr) -> kir.Buffer:
        """``expr`` as a materialized buffer of its own shape (kernels read these). An
        expression is materialized once, and into the region's output when it is one
        (a squeeze-and-excitation block's ``silu(conv)`` is both the output and what the
        mean reads): the conv then writes the output with its epilogue, and the mean
        reads it, where the output used to be computed a second time from the conv's raw
        result (EfficientNet's SE blocks: the SiLU twice, and two more temps)."""
        return self.node_buffer(self.value(expr), tuple(dims(expr.ty)), str(expr.ty.dtype))

    def node_buffer(self, node, shape: tuple, dtype: str) -> kir.Buffer:
        """:meth:`buffer` of the value ``node`` (of ``shape`` and ``dtype``)."""
        if isinstance(node, kir.Load) and node.buf.shape == shape:
            return node.buf
        made = self.materialized.get(node)
        if made is not None and made.shape == shape and made.dtype == dtype:
            return made
        buf = self._output_of(node, shape, dtype) or self.temp(shape, dtype)
        self.kernel.stages.append(kir.Elementwise(shape, ((buf, node),)))
        self.materialized[node] = buf
        return buf

    def table(self, expr) -> kir.Buffer:
        """``expr`` as a buffer read whole (a :class:`~.kir.Lookup` table), its stage (if
        it needs one) moved to the earliest point its reads allow: a kernel made before
        the lookup may then apply it in its epilogue (:func:`fuse_epilogues`)."""
        made = len(self.kernel.stages)
        buf = self.buffer(expr)
        if len(self.kernel.stages) == made + 1:
            stage = self.kernel.stages.pop()
            reads = {b.storage for b in kir.stage_reads(stage)}
            at = max((k + 1 for k, s in enumerate(self.kernel.stages)
                      if reads & {b.storage for b in kir.stage_writes(s)}), default=0)
            self.kernel.stages.insert(at, stage)
        return buf

    def _output_of(self, node, shape, dtype: str) -> kir.Buffer | None:
        """The region output whose value is ``node`` (of this shape and dtype), now
        bound to its buffer: the output is written where ``node`` is materialized."""
        for var, buf in self.results.items():
            if self.env.get(var) is node and buf.shape == shape and buf.dtype == dtype:
                self.env[var] = kir.Load(buf)
                return buf
        return None

    # ---- ops -----------------------------------------------------------------------------------
    def op(self, call: relax.Call, out_ty):
        """The value of ``call``: an expression (elementwise rules) or the result of the
        kernel stages its rule adds."""
        self.kernel.ops.append(call.op.name)
        rule = RULES[call.op.name]
        if rule.elementwise:
            return rule.build(self, call, out_ty)
        if isinstance(out_ty, relax.TupleType):  # split: one buffer per field
            out = tuple(self.temp(dims(t), str(t.dtype)) for t in out_ty.fields)
        else:
            out = self.temp(dims(out_ty), str(out_ty.dtype))
        built = rule.build(self, call, out)
        if _is_value(built):  # a view or an elementwise expression: no stage, no temp
            for o in (out if isinstance(out, tuple) else (out,)):
                self.kernel.temps.remove(o)
            return built
        self.kernel.stages.extend(built if isinstance(built, (list, tuple)) else [built])
        return tuple(kir.Load(o) for o in out) if isinstance(out, tuple) else kir.Load(out)

    def composite(self, inner: relax.Function, args):
        for p, a in zip(inner.params, args):
            self._bind_sizes(p.ty, a)
            self.env[p] = self.value(a)
        for block in inner.body.blocks:
            for binding in block.bindings:
                self.bind(binding)
        return self.value(inner.body.body)

    def _bind_sizes(self, param_ty, arg) -> None:
        """A composite function has its own copies of symbolic sizes: each stands for the
        size its caller passes (in a tensor's shape, or in a shape argument: a target
        shape, or the ``tir_vars`` that carry a size into the function)."""
        if isinstance(param_ty, relax.ShapeType):
            inner, outer = param_ty.values, getattr(arg, "values", None) or getattr(arg.ty, "values", None)
        else:
            inner, outer = getattr(getattr(param_ty, "shape", None), "values", None), dims(arg.ty)
        for d, size in zip(inner or (), outer or ()):
            size = size if isinstance(size, (int, str)) else dim(size)  # a shape argument's PrimExpr
            if isinstance(d, SizeVar) and size is not None:
                self.sizes.alias(d, size)

    def bind(self, b):
        v = b.value
        if isinstance(v, relax.Function):
            self.local[b.var] = v
        elif isinstance(v, relax.Call) and v.op in self.local:
            self.env[b.var] = self.composite(self.local[v.op], v.args)
        elif isinstance(v, relax.Call):
            made = len(self.kernel.stages)
            with error_context(LoweringError, self.symbol, f"op {getattr(v.op, 'name', v.op)}", v):
                self.env[b.var] = self.op(v, b.var.ty)
                for d in dims(b.var.ty) or ():
                    if isinstance(d, str):
                        self.made_by.setdefault(d, v)
            for stage in self.kernel.stages[made:]:  # renderers' errors name the binding
                if isinstance(stage, kir.KernelStage):
                    stage.origin = f"'{b.var.name} = {v.op.name}(...)'"
                    stage.sums_reordered = quotients.marks_reordered(v.span)
        elif isinstance(v, relax.Var):  # an alias, as emit_output makes: gv = lv
            self.env[b.var] = self.value(v)
        elif isinstance(v, relax.TupleGetItem):
            self.env[b.var] = self.value(v.tuple_value)[v.index]
        elif isinstance(v, relax.Tuple):
            self.env[b.var] = self.value(v)
        else:
            raise LoweringError(f"{self.symbol}: unexpected binding {b.var.name} = {type(v).__name__}")

    # ---- the region ---------------------------------------------------------------------------
    def lower(self) -> tuple[kir.Kernel, Names]:
        with naming_sizes(self.sizes):
            self._lower()
        return self.kernel, Names(tuple(self.arg_names), tuple(self.sizes.display.items()))

    def _lower(self) -> None:
        for i, p in enumerate(self.func.params):
            buf = kir.Buffer(f"in{i}", tuple(dims(p.ty)), str(p.ty.dtype))
            self.kernel.inputs.append(buf)
            self.arg_names.append(p.name)
            self.env[p] = kir.Load(buf)
        body = self.func.body.body
        results = body.fields if isinstance(body, relax.Tuple) else [body]
        for k, r in enumerate(results):
            self.kernel.outputs.append(kir.Buffer(f"out{k}", tuple(dims(r.ty)), str(r.ty.dtype)))
            self.arg_names.append(f"output{k}")
            if isinstance(r, relax.Var):
                self.results.setdefault(r, self.kernel.outputs[-1])
        for block in self.func.body.blocks:
            for b in block.bindings:
                self.bind(b)
        by_shape: dict[tuple, list] = {}
        for k, (r, buf) in enumerate(zip(results, self.kernel.outputs)):
            value = self.value(r)
            if isinstance(value, kir.Load) and value.buf is buf:
                continue  # written where it was materialized (buffer)
            # a kernel's result as it is gets a stage of its own, which fuse_epilogues
            # turns into the kernel writing the output; the rest share one loop per shape
            copy = isinstance(value, kir.Load) and value.buf.storage in self.kernel.temps
            by_shape.setdefault(("copy", k) if copy else buf.shape, []).append((buf, value))
        for stores in by_shape.values():
            self.kernel.stages.append(kir.Elementwise(stores[0][0].shape, tuple(stores)))
        hoist_broadcast_subexpressions(self.kernel, self.temp)
        fuse_epilogues(self.kernel)
        _results_in_place(self.kernel)
        _requantize_reordered_sums(self.kernel)
        narrow_rounded_results(self.kernel)
        for rewrite in REWRITES:
            rewrite(self.kernel)
        place_concat_parts(self.kernel)  # last: it fixes where buffers live
        self._derived_sizes()

    def _derived_sizes(self) -> None:
        """Record the derived sizes; each must be computable from sizes the arguments show."""
        self.kernel.sizes = read_scaled_sizes(self.kernel, dict(self.sizes.derived))
        hidden = set().union(*map(size_exprs.names_in, self.kernel.sizes.values())) - set(self.kernel.plain_sizes)
        if hidden:
            shown = sorted(self.sizes.display.get(h, h) for h in hidden)
            raise RegionSizeError(f"{self.symbol}: symbolic sizes {shown} occur only inside compound "
                                f"dims of the region's arguments, so they cannot be read at run time")
        used = {d for s in self.kernel.stages for b in kir.stage_reads(s) + kir.stage_writes(s)
                for d in b.shape if isinstance(d, str)}
        unread = used - set(self.kernel.plain_sizes) - set(self.kernel.sizes)
        if unread:  # a reshape to sizes only its result shows (ONNX Unsqueeze), not output here
            shown = sorted(self.sizes.display.get(h, h) for h in unread)
            err = RegionSizeError(f"{self.symbol}: symbolic sizes {shown} appear in no argument of the "
                                f"region, so they cannot be read at run time")
            err.subject = self.made_by.get(min(unread))
            raise err


def read_scaled_sizes(kernel: kir.Kernel, derived: dict) -> dict:
    """``derived`` where a size ``n`` the arguments show only as ``c * n`` (a constant
    ``c``: Llama's rows ``(2 * s, 64)`` at batch 2 through ``torch.export``) is read from
    the argument as ``c * n`` and ``n`` derived from it as ``(c * n) // c``, exact since
    the VM allocates every argument by its type."""
    shown = {d for b in kernel.params for d in b.shape if isinstance(d, str)}
    out = dict(derived)
    for name, tree in derived.items():
        if name not in shown or not (isinstance(tree, tuple) and tree[0] == "mul"):
            continue
        size, scale = (tree[1], tree[2]) if isinstance(tree[2], int) else (tree[2], tree[1])
        if isinstance(size, str) and isinstance(scale, int) and scale > 0 and size not in shown \
                and size not in out:
            read = ("floordiv", name, scale)
            out = {k: _replace_leaf(t, size, read) for k, t in out.items() if k != name}
            out[size] = read
    return out


def _replace_leaf(tree, leaf: str, by):
    if isinstance(tree, tuple):
        return (tree[0], _replace_leaf(tree[1], leaf, by), _replace_leaf(tree[2], leaf, by))
    return by if tree == leaf else tree


def fuse_epilogues(kernel: kir.Kernel) -> None:
    """Fold an elementwise stage that only post-processes a kernel's fresh temp into the
    kernel: the kernel then writes the stage's buffer and applies the expression to each
    block it finishes. Also lets a kernel write a region output directly (a plain copy),
    also one whose epilogue is already fused (a bias add, then a squeeze of the result),
    and through any reshape (a view: the same elements in the same order). An epilogue
    may read the temp through a reshape that only adds or drops leading unit dims (a
    batched product's ``(H, S, S)`` read as ``(1, H, S, S)``: attention scores)."""
    changed = True
    while changed:
        changed = False
        for k, stage in enumerate(kernel.stages):
            if not isinstance(stage, kir.Elementwise):
                continue
            producer = _sole_kernel_input(kernel, stage, k)
            if producer is None:
                continue
            if len(stage.stores) > 1:
                if _fuse_stores(stage, producer):
                    kernel.stages.remove(stage)
                    changed = True
                    break
                continue
            (dst, expr), = stage.stores
            tmp = producer.out
            seen = _temp_read([expr], tmp)
            if seen.shape != dst.shape or dst.shape != stage.shape:
                continue
            # a plain copy through any view (same elements, same order) or an epilogue
            plain = isinstance(expr, kir.Load) and expr.buf == seen
            found = None if plain else _in_producer_coordinates([expr], seen, tmp.shape)
            epi = kir.Acc(seen.dtype) if plain else found and found[0]
            copy = isinstance(epi, kir.Acc)
            if epi is not None and producer.epilogue is not None and not copy:
                found = _composed(producer, [epi])  # (a copy after an epilogue is free)
                epi = found and found[0]
            if epi is None:
                continue
            apart = tmp.dtype != dst.dtype  # the sums stay in the temp, the epilogue writes dst
            if apart and not producer.writes_epilogue_apart:
                continue
            if apart:
                producer.epilogue_out = kir.view(dst, tmp.shape)
            else:
                producer.out = kir.view(dst, tmp.shape)
                kernel.temps.remove(tmp.storage)
            if not copy:
                producer.epilogue = epi
            kernel.stages.remove(stage)
            changed = True
            break


def _results_in_place(kernel: kir.Kernel) -> None:
    """A plain copy of a kernel's result that its epilogue writes apart (``epilogue_out``,
    a temp nothing else reads) into a buffer of the same dtype and elements: the epilogue
    writes that buffer instead, and the copy's pass is gone (a bfloat16 pool's rounded
    result, a region's output)."""
    for stage in [s for s in kernel.stages if isinstance(s, kir.Elementwise) and len(s.stores) == 1]:
        (dst, expr), = stage.stores
        if not isinstance(expr, kir.Load) or expr.buf.dtype != dst.dtype \
                or expr.buf.storage not in kernel.temps:
            continue
        temp = expr.buf.storage
        producer = next((s for s in kernel.stages if isinstance(s, kir.KernelStage) and not s.epilogue_also
                         and s.epilogue_out is not None and s.epilogue_out.storage is temp), None)
        if producer is None or tuple(expr.buf.shape) != tuple(dst.shape) \
                or any(temp in kir.stage_reads(s) for s in kernel.stages if s is not stage):
            continue
        producer.epilogue_out = kir.view(dst, producer.out.shape)
        kernel.temps.remove(temp)
        kernel.stages.remove(stage)


def _requantize_reordered_sums(kernel: kir.Kernel) -> None:
    """Round the requantizations in the epilogue of a product whose sums stand for a
    float sum TVM takes in another order (:data:`.ir.quotients.REORDERED`) as products,
    without the exactness test: within the one output step the sums' order allows."""
    for stage in kernel.stages:
        if isinstance(stage, kir.KernelStage) and getattr(stage, "sums_reordered", False):
            stage.map_epilogue(quotients.reordered)


def _fuse_stores(stage: kir.Elementwise, producer: kir.KernelStage) -> bool:
    """Fold an elementwise stage with several stores, all of its shape and reading the
    producer's fresh temp, into the producer's blocks: the first store becomes the
    epilogue (written apart), the rest :attr:`~jitbyoc.ir.kir.KernelStage.epilogue_also`.
    A residual block's tail in the bf16 mode, ``relu(conv + x)`` kept in float32 for the
    next sum and cast to bfloat16 for the next product, was a pass of its own over the
    product's whole float32 result (ResNet-50's 56x56 ones: three times OpenVINO's time)."""
    if not producer.writes_epilogue_apart or producer.epilogue_out is not None:
        return False
    tmp = producer.out
    seen = _temp_read([e for _, e in stage.stores], tmp)
    if any(dst.shape != seen.shape or dst.shape != stage.shape for dst, _ in stage.stores):
        return False
    exprs = _in_producer_coordinates([e for _, e in stage.stores], seen, tmp.shape)
    if exprs is not None and producer.epilogue is not None:
        exprs = _composed(producer, exprs)
    if exprs is None:
        return False
    views = [kir.view(dst, tmp.shape) for dst, _ in stage.stores]
    producer.epilogue, producer.epilogue_out = exprs[0], views[0]
    producer.epilogue_also = tuple(zip(views[1:], exprs[1:]))
    return True


def _temp_read(roots: list, tmp: kir.Buffer) -> kir.Buffer:
    """The view of the producer's temp ``tmp`` that ``roots`` load (there is one:
    :func:`_sole_kernel_input`)."""
    return next(n.buf for n in kir.walk(roots) if isinstance(n, kir.Load) and n.buf.storage == tmp.storage)


def _composed(producer: kir.KernelStage, roots: list) -> list | None:
    """``roots`` (epilogues) each applied after the epilogue ``producer`` already has, as one epilogue: a
    bias add fused first, then a GELU that a reshape had kept apart (BERT's and ViT's
    ``linear + add -> reshape -> gelu``), runs on the product's blocks in cache instead
    of a pass of its own. None where the producer's result is not that epilogue's value
    as computed (it writes elsewhere, or stores it in another dtype)."""
    first = producer.epilogue
    if producer.epilogue_out is not None or first.dtype != producer.out.dtype:
        return None
    return kir.substitute_all(roots, {n: first for n in kir.walk(roots) if isinstance(n, kir.Acc)})


def _in_producer_coordinates(roots: list, seen: kir.Buffer, shape) -> list | None:
    """``roots`` (over ``seen``'s shape, reading the producer's result as ``seen``) as
    epilogues over the producer's ``shape``: ``seen`` becomes the accumulator, every other
    load is realigned. Where the two shapes differ only in leading unit dims, any load
    (broadcasts included); otherwise only loads of ``seen``'s whole shape, read as views
    of the producer's (LRN's average over channels is a pool over a ``(1, 1, C, H*W)``
    view of ``(1, C, H, W)``). None where neither holds."""
    mapping: dict = {}
    if kir.without_leading_ones(seen.shape) != kir.without_leading_ones(shape):
        for n in (n for n in kir.walk(roots) if isinstance(n, kir.Load)):
            merged = None if n.buf == seen else _merged(n.buf.shape, seen.shape, shape)
            if n.buf != seen and merged is None:
                return None
            mapping[n] = kir.Acc(seen.dtype) if n.buf == seen else kir.Load(kir.view(n.buf, merged))
        return kir.substitute_all(roots, mapping)
    for n in (n for n in kir.walk(roots) if isinstance(n, kir.Load)):
        if n.buf == seen:
            mapping[n] = kir.Acc(seen.dtype)
            continue
        extra = n.buf.ndim - len(shape)
        if extra > 0:  # its leading dims face the dropped unit dims: they are unit dims too
            if any(d != 1 for d in n.buf.shape[:extra]):
                return None
            mapping[n] = kir.Load(kir.view(n.buf, n.buf.shape[extra:]))
    return kir.substitute_all(roots, mapping)


def _merged(buf_shape, seen_shape, shape) -> tuple | None:
    """``buf_shape`` (broadcast against ``seen_shape``) as a view over ``shape``, where
    ``shape`` merges runs of ``seen_shape``'s dims (unit dims aside): each run is whole in
    the buffer or broadcast over all of it (a per-channel bias over ``(1, C, H, W)`` is
    ``(1, 1, C, 1)`` over ``(1, 1, C, H*W)``). None where the dims do not merge so."""
    buf = (1,) * (len(seen_shape) - len(buf_shape)) + tuple(buf_shape)
    if buf == tuple(seen_shape):
        return tuple(shape)
    if not all(isinstance(d, int) for d in (*seen_shape, *shape)):
        return None  # symbolic sizes: only whole views
    pairs = [(d, b) for d, b in zip(seen_shape, buf) if d != 1]
    out = []
    for t in shape:
        if t == 1:
            out.append(1)
            continue
        size, run = 1, []
        while size < t and pairs:
            d, b = pairs.pop(0)
            size, run = size * d, run + [b == d]
        if size != t or len(set(run)) != 1:
            return None
        out.append(t if run[0] else 1)
    return tuple(out) if not pairs else None


def _sole_kernel_input(kernel: kir.Kernel, stage: kir.Elementwise, index: int):
    """The kernel stage whose temp ``stage`` post-processes, if fusing is safe: the temp is
    read by nothing else (by ``stage`` as itself or through one view), and every other
    buffer ``stage`` reads exists before the kernel (or is made by stages that can run
    before it: :func:`_made_first`)."""
    reads = kir.stage_reads(stage)
    looked_up = set(kir.tables([n for _, n in stage.stores]))  # made before: checked below
    temps = {b.storage for b in reads if b.storage in kernel.temps and b not in looked_up}
    producers = [s for s in kernel.stages[:index] if isinstance(s, kir.KernelStage) and s.out.storage in temps]
    if not producers:
        return None
    # the last kernel's: the others' temps exist before it (an LRN's quotient reads the
    # convolution's result and fuses into the average over channels after it)
    producer = producers[-1]
    tmp = producer.out.storage
    if any(b.storage == tmp for s in kernel.stages if s is not stage for b in kir.stage_reads(s)):
        return None
    direct = kir.loads([n for _, n in stage.stores])
    if len({b for b in direct if b.storage == tmp}) != 1:  # the temp as one shape only
        return None
    made_after = {b for s in kernel.stages[kernel.stages.index(producer):index]
                  for b in kir.stage_writes(s)}
    late = [b for b in reads if b in made_after and b.storage != tmp]
    if late and not _made_first(kernel, producer, index, late):
        return None
    return producer


def _made_first(kernel: kir.Kernel, producer: kir.KernelStage, index: int, bufs) -> bool:
    """Move the stages between ``producer`` and stage ``index`` that make ``bufs`` (and
    what they read of that span) ahead of ``producer``, if none of them depends on it:
    a batch norm's per-channel factors, computed from constants after the convolution
    they scale, then exist before it and the normalization fuses into its epilogue.
    False (nothing moved) when one depends on the producer."""
    first = kernel.stages.index(producer)
    span = kernel.stages[first + 1:index]
    writer = {b: s for s in span for b in kir.stage_writes(s)}
    needed, todo = [], [writer[b] for b in bufs if b in writer]
    while todo:
        s = todo.pop()
        if s in needed:
            continue
        needed.append(s)
        reads = kir.stage_reads(s)
        if any(b.storage in (producer.out.storage, producer.result.storage) for b in reads):
            return False
        todo += [writer[b] for b in reads if b in writer]
    moved = [s for s in span if s in needed]
    for s in moved:
        kernel.stages.remove(s)
    kernel.stages[first:first] = moved
    return True


def _is_value(built) -> bool:
    """Whether a builder returned the op's value (a node, or a tuple of nodes) rather than
    stages: ops that only re-index (reshape as a view) or are elementwise math
    (inference batch_norm) need no stage of their own."""
    if isinstance(built, tuple) and built:
        return all(_is_value(v) for v in built)
    return isinstance(built, (kir.Load, kir.Const, kir.Op, kir.Lookup))


@dataclass(frozen=True)
class Lowered:
    """A region lowered: its kernel (named after its code), the user's names, and the
    canonical text its code is keyed by (:func:`jitbyoc.ir.kir.canonical`)."""
    kernel: kir.Kernel
    names: Names
    key: str
    digest: str  # SHA-256 of ``key``


def lower_region(func: relax.Function, where: str = "") -> Lowered:
    """Lower one region; its kernel is named ``jitbyoc_<ops>_<digest of its key>``."""
    if not where and func.attrs is not None and "global_symbol" in func.attrs:
        where = str(func.attrs["global_symbol"])
    with error_context(LoweringError, where):
        kernel, names = RegionLowering(func, where).lower()
        key = kir.canonical(kernel)
    digest = hashlib.sha256(key.encode()).hexdigest()
    ops = "_".join(dict.fromkeys(o.removeprefix("relax.").replace(".", "_") for o in kernel.ops))
    kernel.name = f"{PREFIX}_{ops[:40]}_{digest[:16]}"
    return Lowered(kernel, names, key, digest)


def instance_symbol(lowered: Lowered) -> str:
    """The symbol of one use of a region's code: its code's name plus a digest of the
    user's names (the entry that reports them), so regions with the same code and other
    names share code but not messages."""
    names = json.dumps([lowered.digest, lowered.names.args, lowered.names.sizes])
    return f"{lowered.kernel.name}_{hashlib.sha256(names.encode()).hexdigest()[:12]}"
