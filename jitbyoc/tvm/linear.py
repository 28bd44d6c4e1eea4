"""Build-time rewrites of linear layers whose weight is a constant (frontends hand weights
over as constants; onnxruntime prepacks them the same way, once):

* **The weight is packed into the GEMM engine's column panels** (:func:`prepacked_weight`):
  ``N/w`` blocks of ``K x w``, ``w`` the engine's register-tile width
  (:func:`jitbyoc.engines.gemm.panel_width`), each streamed as one contiguous run where a
  row-major weight puts every row of a panel ``N`` elements from the last.
* **A projection split into heads is one batched product** (:func:`head_split`):
  ``permute_dims(reshape(x @ W + b, (B, M, G..., D)), axes)`` with ``D`` and then ``M``
  kept last (attention's Q, K and V: BERT's ``(1, 12, 128, 64)``, ViT's fused QKV as
  ``(3, 1, 12, 197, 64)``) is ``x @ W' + b'`` with ``W'``, ``b'`` rearranged here into one
  ``K x D`` block per head: the product writes each head's rows where the permute would
  have copied them, and the copy (10 % of the projection) is gone.

In Relax a packed weight ``P`` reads ``reshape(permute_dims(P, ...), shape)``, so a build
that leaves the product to TVM still computes the same thing; jitbyoc's matmul reads ``P``
in place (:func:`jitbyoc.kernels.fold_permutes.fold_panels`).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir import Op
from tvm.ir.expr import Constant

from ..engines.gemm import panel_width
from ..engines.products import WEIGHTS
from .constants import constant as _constant
from .constants import tensor_constant
from .inference import ADD, MATMUL, PERMUTE_DIMS, RESHAPE, _static_dims, bound_value, single_use_call

STRIDED_SLICE = Op.get("relax.strided_slice")


def _permuted(expr, lookup):
    """``(source, axes)`` when ``expr`` is (a variable bound to) ``permute_dims`` (axes
    None: reversed)."""
    call = bound_value(expr, lookup)
    if not (isinstance(call, relax.Call) and call.op.same_as(PERMUTE_DIMS)):
        return None
    axes = call.attrs.axes
    ndim = len(_static_dims(call.args[0]) or ())
    return call.args[0], [int(a) for a in axes] if axes is not None else list(range(ndim))[::-1]


def weight_value(weight, lookup) -> np.ndarray | None:
    """The ``(..., K, N)`` value of a product's B: a constant, torch's ``W.T`` of a
    constant, or a weight :func:`panel_weight` packed."""
    bound = bound_value(weight, lookup)
    value = _constant(bound)
    if value is not None:
        return value
    if isinstance(bound, relax.Call) and bound.op.same_as(RESHAPE):  # panels (..., N/w, K, w)
        packed = _permuted(bound.args[0], lookup)
        value = None if packed is None else _constant(bound_value(packed[0], lookup))
        if value is None:
            return None
        r = value.ndim - 3
        if r >= 0 and packed[1] == [*range(r), r + 1, r, r + 2]:
            return value.swapaxes(r, r + 1).reshape(*value.shape[:r], value.shape[r + 1], -1)
        r -= 1  # in units of g k (bfloat16 pairs): (..., N/w, K/g, w, g)
        if r >= 0 and packed[1] == [*range(r), r + 1, r + 3, r, r + 2]:
            units = value.transpose(*range(r), r + 1, r + 3, r, r + 2)
            return units.reshape(*value.shape[:r], value.shape[r + 1] * value.shape[r + 3], -1)
        return None
    transposed = _permuted(bound, lookup)
    value = None if transposed is None else _constant(bound_value(transposed[0], lookup))
    return value.T if value is not None and value.ndim == 2 and transposed[1] == [1, 0] else None


def constant_weight(matmul: relax.Call, lookup) -> np.ndarray | None:
    """The constant (K, N) weight of ``matmul(x, B)`` (see :func:`weight_value`) when
    ``x`` is a static stack of more than one row its product multiplies by the weight
    (:data:`~jitbyoc.engines.products.WEIGHTS`), else None. One float32 row
    (or a symbolic count that may be one: decoders) keeps ``W.T``, which the GEMV path
    reads fastest as dot products of ``W``'s rows; a product in units of several k has
    no GEMV and packs an unpacked weight on every call, so one static row packs too (a
    classifier's last layer)."""
    x, weight = matmul.args
    rows = _static_dims(x)
    if rows is None or len(rows) < 2:
        return None
    value = weight_value(weight, lookup)
    product = WEIGHTS.get(str(value.dtype)) if value is not None else None
    if value is None or value.ndim != 2 or product is None or product.a != str(x.ty.dtype):
        return None
    return value if int(np.prod(rows[:-1])) > 1 or product.group > 1 else None


def _panels_of(value: np.ndarray) -> int:
    """The panel width ``value`` (``(..., K, D)``) packs in: the engine's ``w`` when a
    product of its dtype exists, the product's units divide K, and ``w`` divides ``D`` or
    the product is in units of several k (bfloat16 pairs, int8 quads: the last panel then
    padded with zero columns, which the product reads and drops); else 0 (no panels). A
    float32 weight that does not fit is read in place, row-major; a weight in units would
    be packed on every call: ResNet-50's 2048 x 1000 classifier, bf16, took 0.36 ms."""
    product = WEIGHTS.get(str(value.dtype))
    width = panel_width(product.a) if product is not None else 0
    fits = width and (value.shape[-1] % width == 0 or product.group > 1) and value.shape[-2] % product.group == 0
    return width if fits else 0


def panel_weight(value: np.ndarray, emit):
    """A Relax expression equal to ``value`` (``(..., K, D)``): when it packs in panels
    (:func:`_panels_of`), ``reshape(permute_dims(P, ...), value.shape)`` of ``P`` (``...,
    D/w, K, w``; in units of ``g`` k, ``..., D/w, K/g, w, g``), the engine's panels; else
    the constant itself."""
    width = _panels_of(value)
    if not width:
        return tensor_constant(value)
    (k, n), lead = value.shape[-2:], value.shape[:-2]
    d = -(-n // width) * width  # columns padded to whole panels (zeros), cut off below
    value = np.concatenate([value, np.zeros((*lead, k, d - n), value.dtype)], axis=-1) if d > n else value
    r, g = len(lead), WEIGHTS[str(value.dtype)].group
    if g == 1:
        packed = value.reshape(*lead, k, d // width, width).swapaxes(r, r + 1)
        axes = [*range(r), r + 1, r, r + 2]
    else:
        lanes = value.reshape(*lead, k // g, g, d // width, width)
        packed = lanes.transpose(*range(r), r + 2, r, r + 3, r + 1)
        axes = [*range(r), r + 1, r + 3, r, r + 2]
    unpacked = emit(relax.op.permute_dims(tensor_constant(packed), axes))  # written by the writer threads
    whole = emit(relax.op.reshape(unpacked, value.shape))
    return whole if d == n else emit(relax.op.strided_slice(whole, [r + 1], [0], [n], assume_inbound=True))


def prepacked_weight(matmul: relax.Call, lookup, emit):
    """``matmul(x, W)`` with its constant weight (:func:`constant_weight`) in the engine's
    panels (:func:`panel_weight`), or made row-major once (torch's ``W.T``) when the panels
    do not fit; None when there is nothing to do (not constant, or already done)."""
    bound = bound_value(matmul.args[1], lookup)
    row_major = isinstance(bound, Constant)
    if not row_major and _permuted(bound, lookup) is None:
        return None  # not a constant weight, or one already packed
    value = constant_weight(matmul, lookup)
    if value is None or row_major and not _panels_of(value):
        return None  # not a stack of rows, or a row-major constant that stays as it is
    return relax.op.matmul(matmul.args[0], panel_weight(value, emit), matmul.attrs.out_dtype)


def _single_call(expr, lookup, uses: dict):
    """The call ``expr`` is (nested: one use by construction) or is bound to when its one
    use is the caller's (:func:`.inference.single_use_call`), else None."""
    return expr if isinstance(expr, relax.Call) else single_use_call(expr, lookup, uses)


def _projection(expr, lookup, uses: dict):
    """``(matmul call, bias or None)`` that ``expr`` is made of through reshapes: ``x @ W``
    or ``x @ W + b`` (either order) with ``b`` a constant; None otherwise."""
    node = _single_call(expr, lookup, uses)
    while node is not None and node.op.same_as(RESHAPE):
        node = _single_call(node.args[0], lookup, uses)
    if node is None or not node.op.same_as(ADD):
        return (node, None) if node is not None and node.op.same_as(MATMUL) else None
    for product, other in (node.args, node.args[::-1]):
        bias, matmul = _constant(bound_value(other, lookup)), _single_call(product, lookup, uses)
        if bias is not None and matmul is not None and matmul.op.same_as(MATMUL):
            return matmul, bias
    return None


def head_split(permute: relax.Call, lookup, uses: dict, emit):
    """``permute_dims(reshape(x @ W [+ b], (B, M, G..., D)), axes)`` with a constant
    weight (and bias), ``axes`` ending with ``M``'s then ``D``'s: as ``reshape(x, ...) @ W'
    [+ b']``, one ``K x D`` block of ``W`` per head (leading dims in the permute's order, B
    on ``x``'s side, the groups on the weight's), packed in panels (:func:`panel_weight`).
    None when ``permute`` is not such a split."""
    split, found = _static_dims(permute.args[0]), _projection(permute.args[0], lookup, uses)
    axes = _permuted(permute, lookup)[1]
    if split is None or found is None or len(split) < 3 or axes[-2:] != [1, len(split) - 1]:
        return None
    matmul, bias = found
    value = constant_weight(matmul, lookup)
    rows = _static_dims(matmul.args[0])
    (b, m), groups, d = split[:2], split[2:-1], split[-1]
    if value is None or int(np.prod(rows[:-1])) != b * m or int(np.prod(groups)) * d != value.shape[1]:
        return None
    if bias is not None and (bias.shape[-1:] != (value.shape[1],) or bias.size != value.shape[1]):
        return None
    lead = axes[:-2]
    order = [a - 2 for a in lead if a != 0]  # the groups, in the output's order
    heads = [1 if a == 0 else split[a] for a in lead]
    k = value.shape[0]
    weight = value.reshape(k, *groups, d).transpose([1 + g for g in order] + [0, len(groups) + 1])
    x = emit(relax.op.reshape(matmul.args[0], [b if a == 0 else 1 for a in lead] + [m, k]))
    product = relax.op.matmul(x, panel_weight(weight.reshape(*heads, k, d), emit), matmul.attrs.out_dtype)
    if bias is None:
        return product
    per_head = bias.reshape(*groups, d).transpose(order + [len(groups)]).reshape(*heads, 1, d)
    return relax.op.add(emit(product), tensor_constant(per_head))


def sliced_only(func: relax.Function, uses: dict) -> set[str]:
    """Names of the variables whose every use (``uses``: name -> count) is the data of a
    ``strided_slice``: a value sliced into pieces and nothing else."""
    slices: dict[str, int] = {}

    @relax.expr_functor.visitor
    class _Slices(relax.PyExprVisitor):
        def visit_call_(self, call):
            data = call.args[0] if call.args else None
            if call.op.same_as(STRIDED_SLICE) and isinstance(data, relax.Var):
                slices[str(data.name)] = slices.get(str(data.name), 0) + 1
            super().visit_call_(call)

    _Slices().visit_expr(func)
    return {name for name, count in slices.items() if uses.get(name) == count}


def _slice_range(call: relax.Call, shape) -> tuple[int, int, int] | None:
    """``(axis, start, stop)`` of a one-axis, unit-stride slice with static bounds."""
    if len(call.args) not in (4, 5) or len(call.args[1].fields) != 1:
        return None
    try:
        axis, lo, hi, *step = (int(arg.fields[0].value) for arg in call.args[1:])
    except (AttributeError, TypeError):
        return None
    if step and step[0] != 1:
        return None
    axis %= len(shape)
    lo, hi = (max(0, min(v + shape[axis] if v < 0 else v, shape[axis])) for v in (lo, hi))
    return (axis, lo, hi) if lo < hi else None


def sliced_product(call: relax.Call, lookup, sliced: set[str], emit):
    """A slice, along a head group, of a product :func:`head_split` made (ViT's fused QKV
    sliced into Q, K and V) as the product of that group's weights alone: each piece is
    written where it goes instead of copied out of the whole. ``sliced``: the variables
    only slices read (:func:`sliced_only`). None when ``call`` is not such a slice."""
    data = call.args[0]
    shape = _static_dims(data)
    if not isinstance(data, relax.Var) or str(data.name) not in sliced or shape is None:
        return None
    whole, found = lookup(data), _slice_range(call, shape)
    bias = None
    if isinstance(whole, relax.Call) and whole.op.same_as(ADD):
        whole, bias = lookup(whole.args[0]) if isinstance(whole.args[0], relax.Var) else None, _constant(whole.args[1])
        if bias is None:  # the add's other operand is computed: slicing the product alone drops it
            return None
    if found is None or not (isinstance(whole, relax.Call) and whole.op.same_as(MATMUL)):
        return None
    axis, lo, hi = found
    x, weight = whole.args
    value, xs = weight_value(weight, lookup), _static_dims(x)
    if value is None or xs is None or not (len(xs) == value.ndim == len(shape)) or axis >= len(shape) - 2 \
            or xs[axis] != 1 or bias is not None and bias.ndim != len(shape):
        return None
    piece = (slice(None),) * axis + (slice(lo, hi),)
    product = relax.op.matmul(x, panel_weight(value[piece], emit), whole.attrs.out_dtype)
    if bias is None:
        return product
    part = bias[piece] if bias.shape[axis] > 1 else bias
    return relax.op.add(emit(product), tensor_constant(part))
