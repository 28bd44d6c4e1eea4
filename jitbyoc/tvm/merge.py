"""Merge composite calls into maximal regions, inside every dataflow block.

TVM's ``MergeCompositeFunctions`` cannot see through ``If`` (its graph partitioner has
no rule for it), so jitbyoc merges itself. Walking each dataflow block in order, composite
calls join an open region, and so do projections (``t[i]``) of a tuple the region made
(batch_norm, split), wherever they stand in the block; any other binding that does not
depend on the open region is moved ahead of it, and one that does closes the region
first. Every region therefore takes its inputs from before it and hands its outputs to
what follows: no cycles, and no tuple-typed outputs.

A region holds at most one heavy kernel (rules with ``anchor`` set, :mod:`jitbyoc.ir.rules`: matmul,
conv), except attention's second product (``softmax(...) @ V`` joins the region of the
scores' product, so the two can be fused): another one starts a new region, taking along
the open region's bindings that are independent of its kernel and feed the new one (a
weight's ``permute_dims`` feeds the next layer); other independent bindings with static
shapes (BERT's attention mask) become a region of their own. Elementwise tails still fuse into the kernel
before them, and layout ops and reductions ride along; but each layer of a network
becomes its own region, so identical layers share one compiled kernel (their content
hashes match), the compile cache works per layer, and changing one layer recompiles
only that layer.
"""

from __future__ import annotations

import json
from functools import lru_cache

import tvm
from tvm import relax
from tvm.ir import TupleType
from tvm.ir.expr import Constant
from tvm.relax.utils import copy_with_new_vars

from ..ir.rules import RULES, anchor_ops

CODEGEN = "jitbyoc"
NAMES_ATTR = "jitbyoc_names"  # a region function's parameter names and types (JSON)


SOFTMAX = "relax.nn.softmax"
# ops a layer's tail holds besides the elementwise rules; a take there is a table lookup
# (:mod:`.tables`, :mod:`.channel_tables`): an element from the same element of its index
POINTWISE = frozenset({"relax.quantize", "relax.dequantize", "relax.nn.batch_norm", "relax.take"})
# how many kernels after a region's a tail of it may stand: an Inception module imports
# its four branches' convolutions first, then their tails
TAIL_KERNELS = 6


def _exponents(comp: relax.Function) -> set:
    """The positions of ``comp``'s parameters that are a ``power``'s exponent."""
    found: set = set()

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.power" \
                and e.args[1] in comp.params:
            found.add(list(comp.params).index(e.args[1]))
    relax.analysis.post_order_visit(comp.body, visit)
    return found


def _literal_exponent(arg, k: int, exponents: set) -> bool:
    """A scalar constant passed as a ``power``'s exponent stays inside the region, as a
    literal its code is made for (:func:`jitbyoc.ir.vecmath.power_by_roots`: LRN's 0.75).
    Other constants stay parameters, so regions that differ only in them share code."""
    return k in exponents and isinstance(arg, Constant) and getattr(arg.ty, "ndim", None) == 0


def _ops_of(func: relax.Function) -> set:
    """The names of the operators ``func``'s body calls."""
    found: set = set()
    relax.analysis.post_order_visit(func.body, lambda e: found.add(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def pointwise_ops() -> frozenset:
    """Ops that compute each element from the same element of their operands: the
    elementwise rules, quantize, dequantize, an inference batch norm and a take (a layer's tail)."""
    return frozenset(name for name, rule in RULES.items() if rule.elementwise) | POINTWISE


def _static(ty) -> bool:
    """Whether a tensor type (or each field of a tuple type) has a static shape."""
    if isinstance(ty, TupleType):
        return all(_static(f) for f in ty.fields)
    values = getattr(getattr(ty, "shape", None), "values", None)
    return values is not None and all(hasattr(v, "value") for v in values)


def _nbytes(ty) -> int | None:
    """A tensor type's bytes (a tuple's: its largest field's), or None when a shape or
    dtype is not static."""
    if isinstance(ty, TupleType):
        fields = [_nbytes(f) for f in ty.fields]
        return None if not fields or None in fields else max(fields)
    values = getattr(getattr(ty, "shape", None), "values", None)
    dtype = getattr(ty, "dtype", None)
    if values is None or not dtype:
        return None
    count = 1
    for v in list(values):  # one walk of TVM's array, not two (each step calls into TVM twice)
        if not hasattr(v, "value"):
            return None
        count *= int(v.value)
    return count * _dtype_bits(str(dtype)) // 8


@lru_cache(maxsize=None)
def _dtype_bits(dtype: str) -> int:
    return tvm.runtime.DataType(dtype).bits


class _Merger:
    def __init__(self, mod: tvm.IRModule):
        self.composites = {gv: f for gv, f in mod.functions.items()
                           if isinstance(f, relax.Function) and f.attrs and "Composite" in f.attrs}
        self.bb = relax.BlockBuilder()  # types the new GlobalVars; collects the regions
        ops = {gv: _ops_of(f) for gv, f in self.composites.items()}  # one walk each, not three
        anchors, pointwise = anchor_ops(), pointwise_ops()
        self.anchors = {gv for gv, names in ops.items() if names & anchors}
        self.softmaxes = {gv for gv, names in ops.items() if SOFTMAX in names}
        self.pointwise = {gv for gv, names in ops.items() if names <= pointwise}
        self._free: dict = {}  # a binding value's handle -> its free variables
        self._exps: dict = {}  # a composite -> its power exponents' positions (exponents)
        self._bytes: dict = {}  # a type's handle -> (the type, kept alive: no handle reuse; _nbytes)
        self.params: frozenset = frozenset()  # the parameters of the function being walked

    def free_vars(self, value) -> frozenset:
        """``relax.analysis.free_vars(value)``, once per value (keyed by handle: comparing
        Relax expressions costs more): every outlining asks it of every binding after the
        region (BERT: 25,000 calls, 0.2 s of its build)."""
        key = value.__chandle__()
        found = self._free.get(key)
        if found is None:
            found = self._free[key] = frozenset(relax.analysis.free_vars(value))
        return found

    def exponents(self, op) -> set:
        """:func:`_exponents` of the composite ``op`` (none for other ops), once per
        composite: every call of it in every region asked (BERT: 614 walks for 49)."""
        if op not in self._exps:
            comp = self.composites.get(op)
            self._exps[op] = _exponents(comp) if comp is not None else set()
        return self._exps[op]

    def nbytes(self, ty) -> int | None:
        """:func:`_nbytes`, once per type (BERT's merge asked 2,400 times: a tenth of its time)."""
        key = ty.__chandle__()
        found = self._bytes.get(key)
        if found is None:
            found = self._bytes[key] = (ty, _nbytes(ty))
        return found[1]

    def widens(self, var, args) -> bool:
        """Whether ``var`` holds more bytes than the largest tensor among ``args``."""
        ins = [self.nbytes(a.ty) for a in args if isinstance(a, relax.Var)]
        out = self.nbytes(var.ty)
        return out is not None and bool(ins) and None not in ins and out > max(ins)

    def no_wider(self, var, read) -> bool:
        """Whether ``var`` holds no more bytes than the largest of ``read``."""
        out, ins = self.nbytes(var.ty), [self.nbytes(v.ty) for v in read]
        return out is not None and None not in ins and out <= max(ins)

    # ---- walking the function ------------------------------------------------------------
    def expr(self, e):
        if isinstance(e, relax.SeqExpr):
            return relax.SeqExpr([self.block(b) for b in e.blocks], self.expr(e.body))
        if isinstance(e, relax.If):
            return relax.If(e.cond, self.expr(e.true_branch), self.expr(e.false_branch))
        return e

    def block(self, block):
        if not isinstance(block, relax.DataflowBlock):
            return relax.BindingBlock([self.binding(b) for b in block.bindings])
        out, region = [], []
        bindings = self.widening_late(list(block.bindings))
        for k, b in enumerate(bindings):
            if b is None:  # a projection already moved into a region
                continue
            if region and b.value.op in self.anchors if self.is_composite_call(b.value) else False:
                if any(r.value.op in self.anchors for r in region if self.is_composite_call(r.value)) \
                        and not self.closes_attention(region, b.value):
                    moved = self.independent(region) + self.widening_into(region, b.value)
                    region = [r for r in region if r not in moved]
                    self.take_projections(region, bindings, k)
                    self.take_tails(region, bindings, k, moved)
                    out += self.outline(region, moved + [r for r in bindings[k:] if r is not None])
                    region, apart = self.feeding(moved, b.value)
                    if apart:
                        out += self.outline(apart, region + [r for r in bindings[k:] if r is not None])
            if self.is_composite_call(b.value) or self.is_projection(b.value, region):
                region.append(b)
                continue
            if region and self.uses(b.value, region):
                self.take_projections(region, bindings, k)
                out += self.outline(region, [r for r in bindings[k:] if r is not None])
                region = []
            out.append(self.binding(b))
        if region:
            out += self.outline(region, [])
        return relax.DataflowBlock(out)

    def widening_late(self, bindings: list) -> list:
        """``bindings`` with each composite call but a kernel that writes more bytes than it
        reads (a dequantize) moved down to just before its first user, so it joins the user's
        region. Where it stood, right after its operand's kernel, it joined that region,
        which then wrote the wide tensor out for a later region to read: ResNet-50's QDQ
        graph dequantizes each block's uint8 output for the next block's residual add,
        and the block wrote 3.2 MB of float32 beside its 0.8 MB of uint8."""
        order = list(bindings)
        for b in bindings:
            if not (self.is_composite_call(b.value) and b.value.op not in self.anchors
                    and self.widens(b.var, b.value.args)):
                continue
            at = order.index(b)
            user = next((j for j in range(at + 1, len(order)) if b.var in self.free_vars(order[j].value)), None)
            if user is not None and user > at + 1:
                order.insert(user - 1, order.pop(at))  # the user moved up by one
        return order

    def closes_attention(self, region, call) -> bool:
        """Whether ``call`` (a heavy kernel) is attention's second product: the region
        holds one product and a softmax, and ``call``'s first operand is made in the
        region (``softmax(Q K^T ...) @ V``). It joins the region, so the scores can stay
        in cache (:mod:`jitbyoc.kernels.attention`)."""
        calls = [r.value for r in region if self.is_composite_call(r.value)]
        return (sum(c.op in self.anchors for c in calls) == 1
                and any(c.op in self.softmaxes for c in calls)
                and self.uses_vars(call.args[0], {r.var for r in region}))

    def binding(self, b):
        if isinstance(b, relax.VarBinding) and isinstance(b.value, (relax.If, relax.SeqExpr)):
            return relax.VarBinding(b.var, self.expr(b.value))
        return b

    def is_composite_call(self, value) -> bool:
        return isinstance(value, relax.Call) and value.op in self.composites

    @staticmethod
    def is_projection(value, region) -> bool:
        return isinstance(value, relax.TupleGetItem) and any(
            value.tuple_value.same_as(b.var) for b in region)

    def take_projections(self, region, bindings, start) -> None:
        """Move later projections of the region's tuples into it (they depend on nothing
        else), so a tuple never has to leave a region."""
        for j in range(start, len(bindings)):
            if bindings[j] is not None and self.is_projection(bindings[j].value, region):
                region.append(bindings[j])
                bindings[j] = None

    def take_tails(self, region, bindings, start, moved) -> None:
        """Move later tails of the region's kernel into it, ahead of the next kernel (from
        up to :data:`TAIL_KERNELS` kernels on): pointwise bindings that use the region's values and nothing
        defined after it. A frontend may order a layer's bias add, batch norm and requantization
        after the next layer's kernel (TVM's ONNX import of a QDQ fire module or of a
        ResNet block with its shortcut: both convolutions, then both tails); left there,
        the float sums crossed into the next region, four bytes an element where the
        uint8 of the requantization is one, and the tail ran as a loop of its own. A
        tail that ends widening (a dequantize no pulled binding reads) goes back to its
        user. What the tail reads of ``moved`` (:meth:`independent`: the bias) comes
        back, and so do bindings of constants alone after it (a batch norm's factors)."""
        after = {r.var for r in bindings[start:] if r is not None}
        inside = {r.var for r in region}
        constant = {r.var: i for i, r in enumerate(bindings) if i >= start and r is not None
                    and self.is_composite_call(r.value) and not self.free_vars(r.value)}
        constants = set(constant)
        pulled, kernels = [], 0
        for j in range(start, len(bindings)):
            b = bindings[j]
            if b is None or not (self.is_composite_call(b.value) or self.is_projection(b.value, region)):
                continue
            if self.is_composite_call(b.value) and b.value.op in self.anchors:
                kernels += 1
                if kernels > TAIL_KERNELS:
                    break
                continue
            if self.is_composite_call(b.value) and b.value.op not in self.pointwise:
                continue  # layout ops stay with their users, which may read them in place
            used = self.free_vars(b.value)
            if not used & inside or (used & after) - {b.var} - constants:
                continue
            needed = set(used)
            for r in reversed(moved):  # users before operands
                if r.var in needed:
                    needed.update(self.free_vars(r.value))
            back = [r for r in moved if r.var in needed]
            moved[:] = [r for r in moved if r.var not in needed]
            for v in used & constants & after:  # constants it reads (a batch norm's)
                back.append(bindings[constant[v]])
                bindings[constant[v]] = None
                after.discard(v)
            region += back + [b]
            pulled.append((j, b))
            inside.update(r.var for r in back + [b])
            after.discard(b.var)
            bindings[j] = None
        for j, b in reversed(pulled):  # the widening ends of the tails go back
            if any(b.var in self.free_vars(r.value) for r in region if r is not b) \
                    or self.no_wider(b.var, [v for v in self.free_vars(b.value) if v in inside]):
                break
            region.remove(b)
            bindings[j] = b

    def independent(self, region) -> list:
        """Bindings of ``region`` that neither depend on its heavy kernel nor feed it or
        anything that does (``permute_dims(w)`` of the *next* linear layer, standing before
        it): they start the next region instead, next to the kernel that consumes them,
        which can then fold them (a matmul reads a permuted weight in place)."""
        free: list = []
        for b in region:
            anchor = self.is_composite_call(b.value) and b.value.op in self.anchors
            bound = {r.var for r in region if r not in free}
            if not anchor and not isinstance(b.value, relax.TupleGetItem) and not self.uses_vars(b.value, bound):
                free.append(b)
        used = set()
        for b in reversed(region):  # users before operands: what feeds a staying binding stays
            if b not in free or b.var in used:
                used.update(self.free_vars(b.value))
        return [b for b in free if b.var not in used]

    def widening_into(self, region, anchor) -> list:
        """Bindings of ``region`` that write more bytes than they read, that nothing else
        in the region reads and ``anchor`` (the next kernel) does: they go with it, into
        its region. A residual
        stored in bfloat16 (``lower_precision(activations="bf16")``) is widened for a conv
        whose composite fuses the sum; in the region before, the widened copy would be
        written out in float32 for the conv to read."""
        read_inside = set().union(*(self.free_vars(r.value) for r in region))
        return [r for r in region if self.is_composite_call(r.value) and r.value.op not in self.anchors
                and self.widens(r.var, r.value.args) and r.var not in read_inside
                and r.var in self.free_vars(anchor) and isinstance(r.var, relax.DataflowVar)]

    def feeding(self, moved, anchor) -> tuple[list, list]:
        """``moved`` (:meth:`independent`) split into what feeds ``anchor``'s operands (a
        weight's ``permute_dims``: it starts the anchor's region, which folds it) and the
        rest, a region of its own when its shapes are static: BERT's attention mask, built
        once before the first layer, made that layer's attention region differ from the
        eleven others (one more 160 ms compile)."""
        needed = set(self.free_vars(anchor))
        feeds = []
        for r in reversed(moved):
            if r.var in needed:
                feeds.append(r)
                needed.update(self.free_vars(r.value))
        feeds.reverse()
        apart = [r for r in moved if r not in feeds]
        if not all(_static(r.var.ty) for r in apart):  # its sizes may come from the next region's inputs
            return moved, []
        return feeds, apart

    def uses_vars(self, value, defined) -> bool:
        return any(v in defined for v in self.free_vars(value))

    def uses(self, value, region) -> bool:
        return self.uses_vars(value, {b.var for b in region})

    # ---- outlining one region --------------------------------------------------------------
    def outline(self, region, rest) -> list:
        defined = {b.var for b in region}
        inputs: list = []
        for b in region:
            exponents = self.exponents(getattr(b.value, "op", None))
            for k, a in enumerate(getattr(b.value, "args", ())):
                # operands become parameters, but a shape (a reshape's
                # symbolic target) stays inline, defined by the parameters' shapes
                if a not in defined and a not in inputs and \
                        not isinstance(a, relax.ShapeExpr) and not _literal_exponent(a, k, exponents):
                    inputs.append(a)
        later = set()
        for b in rest:
            later.update(self.free_vars(b.value))
        outputs = [b.var for b in region
                   if not isinstance(b.var, relax.DataflowVar) or b.var in later]
        region, outputs, rebuilt = self.flatten_tuples(region, outputs)
        gv = self.bb.add_func(self.region_function(region, inputs, outputs), f"{CODEGEN}_region")
        call = relax.Call(gv, inputs)
        if len(outputs) == 1:
            return [relax.VarBinding(outputs[0], call)] + rebuilt
        tup = relax.DataflowVar("region_out", TupleType([o.ty for o in outputs]))
        return [relax.VarBinding(tup, call)] + [
            relax.VarBinding(o, relax.TupleGetItem(tup, k)) for k, o in enumerate(outputs)] + rebuilt

    @staticmethod
    def flatten_tuples(region, outputs):
        """A tuple a region must hand out leaves as its fields and is rebuilt after the
        call: a region's outputs are tensors."""
        region, flat, rebuilt = list(region), [], []
        for o in outputs:
            if not isinstance(o.ty, TupleType):
                flat.append(o)
                continue
            fields = [relax.DataflowVar(f"{o.name}_{k}", t) for k, t in enumerate(o.ty.fields)]
            region += [relax.VarBinding(f, relax.TupleGetItem(o, k)) for k, f in enumerate(fields)]
            flat += fields
            rebuilt.append(relax.VarBinding(o, relax.Tuple(fields)))
        return region, flat, rebuilt

    def region_function(self, region, inputs, outputs) -> relax.Function:
        params = [relax.Var(getattr(a, "name", None) or f"const{k}", a.ty) for k, a in enumerate(inputs)]
        remap = dict(zip(inputs, params))
        bindings = []
        for b in region:
            if isinstance(b.value, relax.TupleGetItem):
                var = relax.Var(b.var.name, b.var.ty)
                bindings.append(relax.VarBinding(var, relax.TupleGetItem(
                    remap[b.value.tuple_value], b.value.index)))
                remap[b.var] = var
                continue
            comp = self.composites[b.value.op]
            fvar = relax.Var(b.value.op.name_hint, comp.ty)
            bindings.append(relax.VarBinding(fvar, copy_with_new_vars(comp)))
            var = relax.Var(b.var.name, b.var.ty)
            bindings.append(relax.VarBinding(var, relax.Call(fvar, [remap.get(a, a) for a in b.value.args])))
            remap[b.var] = var
        ret = [remap[o] for o in outputs]
        body = relax.SeqExpr([relax.BindingBlock(bindings)], ret[0] if len(ret) == 1 else relax.Tuple(ret))
        ret_ty = ret[0].ty if len(ret) == 1 else TupleType([r.ty for r in ret])
        # the names of the user's inputs among its arguments (and their size names, in
        # the types) as an attribute: BlockBuilder's add_func merges structurally equal
        # functions, names aside, and one region function called by two functions
        # reported the first one's names in errors. An intermediate value's name is left
        # out: the VM made it, a call cannot get it wrong, and BERT's 12 layers keep
        # sharing their regions
        names = json.dumps([[p.name, str(p.ty)] if a in self.params else "" for a, p in zip(inputs, params)])
        return relax.Function(params, body, ret_ty, True,
                              tvm.ir.make_node("ir.DictAttrs", **{"Codegen": CODEGEN, NAMES_ATTR: names}))


def merge_regions(mod: tvm.IRModule) -> tvm.IRModule:
    """Outline maximal runs of ``Composite`` calls into ``Codegen="jitbyoc"`` functions."""
    m = _Merger(mod)
    funcs = {}
    for gv, f in mod.functions.items():
        if gv in m.composites:
            continue
        if isinstance(f, relax.Function) and not (f.attrs and "Codegen" in f.attrs):
            m.params = frozenset(f.params)
            f = relax.Function(f.params, m.expr(f.body), f.ret_ty, f.is_pure, f.attrs)
        funcs[gv] = f
    funcs.update(m.bb.get().functions)
    return relax.transform.Normalize()(tvm.IRModule(funcs, attrs=mod.attrs))
