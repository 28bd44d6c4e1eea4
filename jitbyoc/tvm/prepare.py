"""Facts the frontends leave implicit, made explicit before partitioning.

* **Tensor expressions a frontend emitted are Relax ops again** (:mod:`.lift_te`): TVM's
  ONNX frontend writes ``Clip`` as ``call_tir`` of TOPI's ``maximum`` and ``minimum``,
  which no region can take; a ``call_tir`` whose PrimFunc is the very one TVM legalizes
  an op to becomes that op, and its PrimFunc leaves the module.
* **Static shapes are constants.** ``shape_to_tensor(shape_of(x))`` of a static shape
  (ONNX's ``Shape``, which TVM's ONNX frontend also emits for every ``Gather`` to wrap
  negative indices) becomes a constant, so the arithmetic on it and the ops around it
  join a region instead of waiting for the shape op, which no region can take.
* **Slices proven in bounds.** ``torch.export`` with ``Dim("seq", min=1, max=...)`` gives
  the function ``tir_var_lower_bound``/``tir_var_upper_bound`` attributes, but shape
  inference does not use them: a ``strided_slice`` that may run out of bounds keeps
  clamps such as ``T.min(1, s) + s`` in its shape, and an op whose operands have two such
  shapes gets no shape at all (``R.Tensor(ndim=2)``), which neither jitbyoc nor TVM's
  sort/scan lowering can build. A slice whose clamped and unclamped lengths are provably
  equal under the bounds is re-declared ``assume_inbound=True`` (same values, the plain
  shape), and the bindings after it are normalized again.
* **Zero padding belongs to the convolution.** ``conv2d(pad(x))`` with a zero constant
  pad of rows and columns only (``torch.export`` of MobileNet-style nets) becomes one
  ``conv2d(x)`` with the pad added to its own padding: no padded copy, one region.
* **Inference rewrites on constant weights** (:mod:`jitbyoc.tvm.inference`): batch norm
  folded into the convolution before it (else ``x * s + t``), ONNX's N-ary ``Sum`` as
  adds, identity ``broadcast_to`` and reshapes of constants dropped, weights computed
  from constants (broadcast fills) made constants, a multi-row linear layer's transposed
  weight made once.
* **Quantized products run on int8** (:mod:`.quantized`): a float ``matmul`` or
  ``conv2d`` of dequantized operands (QDQ graphs) becomes a uint8 x int8 product in
  int32, its zero-point correction and scale applied after; a requantization of pooled,
  reshaped or concatenated dequantized tensors with the same parameters moves the
  integers themselves, and a lookup in a dequantized table reads the quantized one.
* **Grouped-query attention reads its shared heads in place** (:mod:`.grouped`): the
  products read each key/value head for its query heads by batch broadcasting, where
  ``repeat_kv`` copied the cache once per query head.
* **A pool of a channel concatenation pools its parts** (:mod:`.pool_concat`): an
  Inception module's branches are pooled where their convolutions left them.
* **Constant convolution weights are packed for the engine** (:mod:`.conv_weights`), in
  blocks of the output channels its register block computes together; after the rest,
  so that batch norm has folded into them.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax
from tvm.ir import Op, Range
from tvm.ir.prim import IntImm
from tvm.sym import Analyzer

from . import (constants, conv_weights, grouped, inference, lift_te, linear, pool_concat, quantized,
               quantized_pairs, tables, weights, widen)

log = logging.getLogger("jitbyoc")

BOUND_ATTRS = ("tir_var_lower_bound", "tir_var_upper_bound")
UNBOUNDED = (1 << 62) - 1  # a size with a lower bound only: sizes are non-negative int64
STRIDED_SLICE = Op.get("relax.strided_slice")
SHAPE_TO_TENSOR = Op.get("relax.shape_to_tensor")
CONV2D, PAD = Op.get("relax.nn.conv2d"), Op.get("relax.nn.pad")
# ops worth a pass without bounds
TRIGGERS = frozenset({"relax.shape_to_tensor", "relax.nn.pad", "relax.nn.conv2d", "relax.nn.conv1d"}) \
    | lift_te.TRIGGERS | inference.TRIGGERS | quantized.TRIGGERS | pool_concat.TRIGGERS | weights.TRIGGERS


def _analyzer(func: relax.Function) -> Analyzer | None:
    """An analyzer that knows the declared range of each bounded size, or None."""
    attrs = func.attrs or {}
    lower, upper = (attrs.get(name) for name in BOUND_ATTRS)
    if not lower and not upper:
        return None
    analyzer = Analyzer()
    for var in relax.analysis.defined_symbolic_vars(func):
        name = str(var.name)
        lo = int(lower[name]) if lower and name in lower else 0
        hi = int(upper[name]) if upper and name in upper else UNBOUNDED
        if lo <= hi:
            analyzer.bind(var, Range(lo, hi + 1))
    return analyzer


def _same_shape(a, b, analyzer: Analyzer) -> bool:
    """Whether two tensor types provably have the same shape."""
    dims_a = getattr(getattr(a, "shape", None), "values", None)
    dims_b = getattr(getattr(b, "shape", None), "values", None)
    if dims_a is None or dims_b is None or len(dims_a) != len(dims_b):
        return False
    return all(analyzer.can_prove_equal(x, y) for x, y in zip(dims_a, dims_b))


def _static_shape(expr) -> list[int] | None:
    values = getattr(expr.ty, "values", None) if isinstance(expr.ty, relax.ShapeType) else None
    return [int(v) for v in values] if values is not None and all(isinstance(v, IntImm) for v in values) else None


def _spatial_zero_pad(call) -> list[int] | None:
    """The (top, left, bottom, right) widths of an NCHW zero pad of rows and columns only."""
    if not (isinstance(call, relax.Call) and call.op.same_as(PAD)) or str(call.attrs.pad_mode) != "constant":
        return None
    widths = [int(w) for w in call.attrs.pad_width]
    if len(widths) != 8 or any(widths[:4]) or min(widths) < 0 or float(call.attrs.pad_value) != 0.0:
        return None
    return [widths[4], widths[6], widths[5], widths[7]]


@relax.expr_functor.mutator
class _Prepare(relax.PyExprMutator):
    def __init__(self, mod, analyzer: Analyzer | None, uses: dict, sliced: set):
        super().__init__(mod)
        self.mod = mod
        self.analyzer = analyzer
        self.uses = uses  # variable name -> uses before rewriting (names: vars may be remade)
        self.sliced = sliced  # names of variables only strided_slice reads (linear.sliced_only)

    def visit_tuple_getitem_(self, op):
        op = super().visit_tuple_getitem_(op)
        bn = self.lookup_binding(op.tuple_value) if isinstance(op.tuple_value, relax.Var) else None
        if op.index != 0 or not (isinstance(bn, relax.Call) and bn.op.same_as(inference.BATCH_NORM)):
            return op
        rewritten = inference.folded_batch_norm(bn, self.lookup_binding, self.uses) \
            or inference.affine_batch_norm(bn)
        if rewritten is None:
            return op
        scaled, shift = rewritten
        return relax.op.add(self.builder_.emit(scaled), shift)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op.same_as(lift_te.CALL_TIR):
            op = lift_te.lifted_call(call, self.mod, self.lookup_binding)
            return call if op is None else op
        if call.op.same_as(SHAPE_TO_TENSOR):
            shape = _static_shape(call.args[0])
            return call if shape is None else relax.const(np.array(shape, "int64"), "int64")
        if call.op.same_as(CONV2D):
            call = self._constant_weight(call)
            folded = self._fold_pad(call)  # a new call, not normalized yet: as it is
            int8 = None if not folded.same_as(call) else \
                quantized.quantized_conv2d(call, self.lookup_binding, self.builder_.emit)
            return folded if int8 is None else int8
        if call.op.same_as(quantized.TAKE):
            rows = quantized.gathered_dequantize(call, self.lookup_binding, self.builder_.emit)
            if rows is None:
                rows = weights.nibble_arithmetic(call, self.lookup_binding)
            return call if rows is None else rows
        if call.op.same_as(quantized.QUANTIZE):
            const = inference.quantized_constant(call, self.lookup_binding)
            if const is not None:
                return const
            moved = quantized.requantized(call, self.lookup_binding, self._requantize)
            if moved is None:
                moved = tables.table_lookup(call, self.lookup_binding, self.builder_.emit)
            return call if moved is None else moved
        if call.op.same_as(inference.RESHAPE):
            const = inference.constant_reshape(call)
            return call if const is None else const
        if call.op.same_as(inference.MATMUL):
            return self._product(call)
        if call.op.same_as(inference.PERMUTE_DIMS):
            split = linear.head_split(call, self.lookup_binding, self.uses, self.builder_.emit)
            return call if split is None else split
        if call.op.same_as(inference.BROADCAST_TO):
            same = inference.unbroadcast(call)
            if same is None:
                same = inference.folded_constant(call, self.lookup_binding, inference.SMALL_FOLD)
            return call if same is None else same
        if call.op.same_as(inference.SUM):
            items = inference.summed_stack(call, self._bound)
            return call if items is None else self._adds(items)
        if any(call.op.same_as(p) for p in pool_concat.POOLS):
            parts = pool_concat.pooled_parts(call, self.lookup_binding, self.uses, self.builder_.emit)
            return call if parts is None else parts
        if call.op.same_as(STRIDED_SLICE):
            piece = linear.sliced_product(call, self.lookup_binding, self.sliced, self.builder_.emit)
            if piece is not None:
                return piece
            if self.analyzer is not None and not call.attrs.assume_inbound:
                return self._inbound_slice(call)
        return call

    def _product(self, call):
        """``call`` (a matmul) on int8 where its operands are quantized, else with its
        constant weight packed."""
        call = self._constant_weight(call)
        for rewrite in (quantized.quantized_matmul, quantized.integer_matmul):
            int8 = rewrite(call, self.lookup_binding, self.builder_.emit, self._packed)
            if int8 is not None:
                return int8
        int8 = quantized_pairs.activation_product(call, self.lookup_binding, self.builder_.emit, self._packed)
        if int8 is not None:
            return int8
        folded = linear.prepacked_weight(call, self.lookup_binding, self.builder_.emit)
        return call if folded is None else folded

    def _constant_weight(self, call):
        """``call`` (a convolution or a product) with its weight a constant where
        constants compute it (:func:`.inference.constant_chain`); a product's ``W.T``
        stays a ``permute_dims`` of the constant, the form :mod:`.linear` packs."""
        weight = call.args[1]
        bound = self._bound(weight)
        if isinstance(bound, relax.Call) and bound.op.same_as(inference.PERMUTE_DIMS) \
                and call.op.same_as(inference.MATMUL):
            const = inference.folded_constant(bound.args[0], self.lookup_binding)
            weight = None if const is None else \
                self.builder_.emit(relax.op.permute_dims(const, bound.attrs.axes))
        else:
            weight = inference.folded_constant(weight, self.lookup_binding)
        if weight is None:
            return call
        args = [call.args[0], weight, *call.args[2:]]
        return self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))

    def _requantize(self, call):
        """``call`` (a quantize) as a table lookup where it is a function of one byte
        (:mod:`.tables`), emitted; the rewrites a quantize gets but moving integers."""
        table = tables.table_lookup(call, self.lookup_binding, self.builder_.emit)
        return self.builder_.emit(call if table is None else table)

    def _bound(self, value):
        return self.lookup_binding(value) if isinstance(value, relax.Var) else None

    def _packed(self, product: relax.Call) -> relax.Call:
        """``product`` (a matmul) with its constant weight packed for the engine, if it packs."""
        folded = linear.prepacked_weight(product, self.lookup_binding, self.builder_.emit)
        return product if folded is None else folded

    def _adds(self, items: list):
        """``((items[0] + items[1]) + ...)``, the order TVM's reduction adds them in."""
        total = items[0]
        for item in items[1:-1]:
            total = self.builder_.emit(relax.op.add(total, item))
        return relax.op.add(total, items[-1]) if len(items) > 1 else total

    def _fold_pad(self, call):
        data, weight = call.args
        a = call.attrs
        source = self.lookup_binding(data) if isinstance(data, relax.Var) else None
        widths = _spatial_zero_pad(source)
        if widths is None or str(a.data_layout) != "NCHW":
            return call
        padding = [int(p) + w for p, w in zip(a.padding, widths)]
        return inference.conv2d_like(call, source.args[0], weight, padding=padding)

    def _inbound_slice(self, call):
        data, axes, *rest = call.args
        ndim = data.ty.ndim
        if ndim < 0 or not all(isinstance(x, IntImm) for x in axes.fields):
            return call
        # non-negative axes: TVM's legalization of an in-bounds slice rejects axis -1
        axes = [int(x.value) % ndim for x in axes.fields]
        inbound = self.builder_.normalize(relax.op.strided_slice(data, axes, *rest, assume_inbound=True))
        return inbound if _same_shape(call.ty, inbound.ty, self.analyzer) else call


def prepare(mod: tvm.IRModule, ops: frozenset | set = frozenset()) -> tvm.IRModule:
    """``mod`` (which calls ``ops``) with the facts above made explicit."""
    out = {}
    for gv, func in mod.functions.items():
        relax_function = isinstance(func, relax.Function)
        analyzer = _analyzer(func) if relax_function else None
        narrow = relax_function and widen.has_narrow(func)
        if not relax_function or (analyzer is None and not TRIGGERS & set(ops) and not narrow):
            out[gv] = func
            continue
        out[gv] = _prepared(mod, gv, func, analyzer, narrow, grouped.TRIGGERS <= set(ops))
    if all(out[gv].same_as(f) for gv, f in mod.functions.items()):
        return mod
    if lift_te.TRIGGERS & set(ops):  # only a lift leaves a PrimFunc unused (each check walks every function)
        out = lift_te.without_lifted(mod, out)
    # a dropped broadcast_to leaves ``y = x``: such a binding is no op, so it would end a region
    return relax.transform.CanonicalizeBindings()(tvm.IRModule(out, attrs=mod.attrs))


def _prepared(mod, gv, func: relax.Function, analyzer, narrow: bool, repeats: bool) -> relax.Function:
    """``func`` rewritten; as it is if a rewrite fails (they are optimizations: a model
    jitbyoc could not prepare still builds, as TVM would build it). ``narrow``: it has
    float16 or bfloat16 tensors (:mod:`.widen`); ``repeats``: its module calls the ops of
    a grouped-query repeat (:mod:`.grouped`)."""
    try:
        with constants.deferred() as pending:  # packed weights: written once, if still used
            func = widen.widened(mod, func, first=True) if narrow else func
            func = grouped.shared_heads(mod, func) if repeats else func
            uses = inference.use_counts(func)
            prepare = _Prepare(mod, analyzer, uses, linear.sliced_only(func, uses))
            out = relax.analysis.remove_all_unused(prepare.visit_expr(func))
            # widened again: what _Prepare made of the ops left narrow (adds of a Sum, a
            # convolution with its batch norm folded, a batch norm as a multiply-add)
            out = _conv_weights_packed(mod, gv, widen.widened(mod, out) if narrow else out)
            constants.write_deferred(pending, out)
        return out
    except Exception as err:  # noqa: BLE001 - any failure leaves the function as it was
        _warn(gv, "preparing", err)
        return func


def _conv_weights_packed(mod, gv, func: relax.Function) -> relax.Function:
    """``func`` with its convolutions' constant weights packed (:mod:`.conv_weights`); as
    it is if that fails, the other rewrites kept."""
    try:
        return relax.analysis.remove_all_unused(conv_weights.PackConvWeights(mod).visit_expr(func))
    except Exception as err:  # noqa: BLE001 - an optimization: the function stays right without it
        _warn(gv, "packing the convolution weights of", err)
        return func


def _warn(gv, what: str, err: Exception) -> None:
    last = (str(err).strip().splitlines() or [""])[-1][:200]
    log.warning("jitbyoc: %s %s failed (%s: %s); it is partitioned as it is",
                what, gv.name_hint, type(err).__name__, last)
