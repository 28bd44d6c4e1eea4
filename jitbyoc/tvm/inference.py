"""Inference-time rewrites of what the frontends emit, done once at build time (the way
onnxruntime's graph optimizer and oneDNN do before they run a model):

* **Batch norm folds into the convolution before it.** ``batch_norm(conv2d(x, W))`` with
  constant ``W``, ``gamma``, ``beta``, ``mean``, ``var`` and ``training=False`` is
  ``conv2d(x, W * s) + (beta - mean * s)`` with ``s = gamma / sqrt(var + eps)``, computed
  in float64 here. The kernel then adds one bias per channel in its output loop instead
  of a subtract, a square root, a divide, a multiply and an add per element (ResNet-50
  puts one after each of its 53 convolutions). Only the weights change, and weights are
  arguments of the compiled code, so models that differ only in weights still share it.
* **An N-ary sum is adds.** ONNX ``Sum`` reaches Relax as ``sum(stack([a, b, ...]),
  axis)``: a copy of every operand into a stacked buffer, then a reduction. Operands of
  one shape become ``((a + b) + ...)``, the order TVM's reduction adds them in, so the
  add joins the producer's fused output loop (ResNet's residual connections).
* **broadcast_to a tensor's own shape** is the tensor, and a **reshaped constant** a
  constant. (Linear layers' constant weights: :mod:`.linear`.)
  A bias the frontend adds between the conv and the batch norm folds with it.
* **Weights computed from constants are constants** (:func:`constant_chain`): a
  convolution's or a product's weight made by broadcasts, reshapes and float casts of a
  constant (TVM's ONNX frontend gives a ``ConstantOfShape`` fill as
  ``broadcast_to(scalar)``) is computed once here, as onnxruntime and OpenVINO fold such
  subgraphs when they make a session, so the weight is packed once too instead of
  broadcast on every call. A small broadcast constant (a bias: at most
  :data:`SMALL_FOLD` elements) is folded wherever it is read.
* **A quantized constant is a constant** (:func:`quantized_constant`): a weight the
  quantizer took for an activation (Inception v1's classifier: a float initializer,
  reshaped in the graph, then QuantizeLinear and DequantizeLinear) is quantized once here,
  as TVM's legalization would on every call (0.15 ms of Inception v1's 7 in int8).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir import Op

from ..ir import quotients
from ..ir.dtypes import dtype as lookup_dtype
from .constants import constant as _constant
from .constants import tensor_constant

CONV2D, BATCH_NORM, ADD = Op.get("relax.nn.conv2d"), Op.get("relax.nn.batch_norm"), Op.get("relax.add")
RESHAPE, PERMUTE_DIMS, MATMUL = (Op.get(f"relax.{n}") for n in ("reshape", "permute_dims", "matmul"))
SUM, STACK, BROADCAST_TO = Op.get("relax.sum"), Op.get("relax.stack"), Op.get("relax.broadcast_to")
TRIGGERS = frozenset({"relax.nn.batch_norm", "relax.stack", "relax.broadcast_to", "relax.reshape",
                      "relax.matmul"})
# ops of a chain over constants that constant_chain evaluates: each keeps the elements'
# order (a broadcast repeats them), so numpy computes exactly what TVM would
_SHAPE_OPS = {Op.get(f"relax.{n}") for n in ("broadcast_to", "reshape", "expand_dims", "squeeze")}
ASTYPE = Op.get("relax.astype")
SMALL_FOLD = 1 << 16  # elements of a broadcast constant folded whatever reads it


def _static_dims(expr) -> tuple[int, ...] | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(hasattr(v, "value") for v in values):
        return None
    return tuple(int(v.value) for v in values)


def bound_value(expr, lookup):
    """What ``expr`` is: the value a variable is bound to, or the expression itself."""
    return lookup(expr) if isinstance(expr, relax.Var) else expr


def constant_chain(expr, lookup, depth: int = 8) -> np.ndarray | None:
    """The value of ``expr`` when it is (a variable bound to) broadcasts, reshapes,
    ``expand_dims``/``squeeze`` and float-to-float casts of a constant, with static shapes,
    else None (a constant itself is left to its reader: None)."""
    call = bound_value(expr, lookup)
    if depth == 0 or not isinstance(call, relax.Call) or not call.args:
        return None
    dims = _static_dims(call)
    source = call.args[0]
    value = _constant(bound_value(source, lookup))
    if value is None:
        value = constant_chain(source, lookup, depth - 1)
    if value is None or dims is None:
        return None
    if any(call.op.same_as(op) for op in _SHAPE_OPS):
        if call.op.same_as(BROADCAST_TO):
            return np.broadcast_to(value, dims)
        return value.reshape(dims)
    dtype = str(getattr(call.ty, "dtype", ""))
    if call.op.same_as(ASTYPE) and value.dtype.kind == "f" and _wide_float(dtype):
        return value.astype(dtype)
    return None


def _wide_float(name: str) -> bool:
    """float32 or float64: a cast numpy rounds as TVM does (no half types here)."""
    try:
        d = lookup_dtype(name)
    except KeyError:  # not a dtype jitbyoc knows: no fold
        return False
    return d.is_float and d.bits >= 32


def quantized_constant(call: relax.Call, lookup) -> relax.Constant | None:
    """``quantize(x, scale, zp)`` of a constant float32 ``x`` (or a :func:`constant_chain`)
    with constant parameters, as the constant TVM's legalization computes: ``clip(round(x
    / scale) + zp)`` in float32, half to even, then the cast. None for anything else: where
    ``x`` or ``scale`` is not finite or a scale is 0 (the clip's NaN is the CPU's), or the
    type is wider than 16 bits (int32's bound is no float32: the cast past it is the CPU's)."""
    x = _constant(bound_value(call.args[0], lookup))
    if x is None:
        x = constant_chain(call.args[0], lookup)
    scale, zp = (_constant(bound_value(a, lookup)) for a in call.args[1:3])
    to = str(call.attrs.out_dtype)
    if x is None or scale is None or zp is None or x.dtype != np.float32 or scale.dtype != np.float32 \
            or not x.ndim or to not in ("int8", "uint8", "int16", "uint16") \
            or not (np.isfinite(x).all() and np.isfinite(scale).all() and scale.all()):
        return None
    along = [1] * x.ndim
    along[int(call.attrs.axis) % x.ndim] = -1  # a per-channel parameter lies along the axis
    scale, zp = (p.reshape(along) if p.size > 1 else p.reshape(()) for p in (scale, zp))
    return tensor_constant(quotients.quantized(x, scale, zp, to))


def folded_constant(expr, lookup, limit: int | None = None):
    """``expr`` (:func:`constant_chain`) as a constant of its value, or None (not such a
    chain, or more than ``limit`` elements). The value stays numpy's broadcast view:
    :func:`.constants.tensor_constant` writes it once, into the constant's own memory
    (an ``np.full`` first took 1.2 s of VGG-19's fills, then was copied again)."""
    value = constant_chain(expr, lookup)
    if value is None or limit is not None and value.size > limit:
        return None
    return tensor_constant(value)


def use_counts(func: relax.Function) -> dict[str, int]:
    """How many times the variables of each name are used in ``func`` (by name: the
    rewriting remakes variables; two variables of one name only make a count larger,
    which only stops a fold)."""
    counts: dict[str, int] = {}

    @relax.expr_functor.visitor
    class _Count(relax.PyExprVisitor):
        def visit_var_(self, var):
            counts[str(var.name)] = counts.get(str(var.name), 0) + 1

        def visit_dataflow_var_(self, var):
            counts[str(var.name)] = counts.get(str(var.name), 0) + 1

    _Count().visit_expr(func)
    return counts


def single_use_call(var, lookup, uses: dict):
    """The call bound to ``var`` when ``uses`` (name -> count) says its one use is the
    caller's, else None: a value used elsewhere too would be computed twice if a rewrite
    folded it."""
    value = lookup(var) if isinstance(var, relax.Var) else None
    return value if isinstance(value, relax.Call) and uses.get(str(var.name)) == 1 else None


def _bn_source(bn: relax.Call, lookup, uses: dict):
    """``(conv2d call, constant bias or None)`` that ``bn``'s input is made of, when the
    conv (and its bias add) feed nothing else (:func:`single_use_call`)."""
    def single(var):
        return single_use_call(var, lookup, uses)

    first = single(bn.args[0])
    if first is not None and first.op.same_as(ADD):
        operand = first.args[1]
        bound = lookup(operand) if isinstance(operand, relax.Var) else None  # a folded reshape
        conv, bias = single(first.args[0]), _constant(operand if bound is None else bound)
        if conv is not None and conv.op.same_as(CONV2D) and bias is not None:
            return conv, bias
        return None
    return (first, None) if first is not None and first.op.same_as(CONV2D) else None


def _scale_shift(bn: relax.Call, stats: list) -> tuple[np.ndarray, np.ndarray]:
    """Inference batch norm as ``x * scale + shift``, in float64, from its constant
    ``gamma, beta, mean, var``."""
    gamma, beta, mean, var = (s.astype(np.float64) for s in stats)
    scale = 1.0 / np.sqrt(var + float(bn.attrs.epsilon))
    if bn.attrs.scale:
        scale = scale * gamma
    return scale, -mean * scale + (beta if bn.attrs.center else 0.0)


def folded_batch_norm(bn: relax.Call, lookup, uses: dict):
    """``(conv2d call with scaled weights, bias constant)`` for ``bn(conv(x) [+ bias])``,
    or None when it does not fold (not constant, not NCHW/OIHW on axis 1, training, a
    bias that is not per channel, not float)."""
    source = _bn_source(bn, lookup, uses)
    if source is None or bn.attrs.training:
        return None
    conv, bias = source
    a, k = conv.attrs, (_static_dims(conv) or (0, 0))[1]
    if str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" or \
            (a.out_layout is not None and str(a.out_layout) != "NCHW"):
        return None
    if int(bn.attrs.axis) % 4 != 1 or len(_static_dims(conv) or ()) != 4:
        return None
    weight, *stats = (_constant(e) for e in (conv.args[1], *bn.args[1:]))
    if weight is None or any(s is None for s in stats) or weight.dtype.kind != "f":
        return None
    # one value per output channel (a (K,) or (K, 1) bias broadcasts along W or H)
    if bias is not None and (bias.ndim > 4 or not (bias.size == 1 or bias.ndim >= 3 and bias.shape[-3] == bias.size == k)):
        return None
    if bias is not None:  # (conv + b - mean): the bias moves the mean
        stats[2] = stats[2].astype(np.float64) - np.broadcast_to(bias.astype(np.float64).reshape(-1), (k,))
    scale, shift = _scale_shift(bn, stats)
    dt = weight.dtype
    w = (weight.astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(dt)
    new_conv = relax.op.nn.conv2d(conv.args[0], tensor_constant(w), a.strides, a.padding,
                                  a.dilation, a.groups, "NCHW", "OIHW", "NCHW", a.out_dtype)
    return new_conv, tensor_constant(shift.astype(dt).reshape(1, -1, 1, 1))


def conv2d_like(conv: relax.Call, data, weight, padding=None, out_dtype=None) -> relax.Call:
    """``conv`` (a ``conv2d``) remade on ``data`` and ``weight``, its attributes kept but
    ``padding`` and ``out_dtype`` where given."""
    a = conv.attrs
    return relax.op.nn.conv2d(data, weight, a.strides, a.padding if padding is None else padding, a.dilation,
                              a.groups, str(a.data_layout), str(a.kernel_layout),
                              None if a.out_layout is None else str(a.out_layout),
                              a.out_dtype if out_dtype is None else out_dtype)


def affine_batch_norm(bn: relax.Call):
    """``(x * s, t)`` (to be added) for an inference ``batch_norm`` with constant parameters that feeds
    no convolution it could fold into (DenseNet's and Inception's pre-activation norms):
    a multiply and an add per element, where the op itself takes a square root and a
    divide. None when a parameter is not constant or the norm is training."""
    x = bn.args[0]
    stats = [_constant(e) for e in bn.args[1:]]
    ndim = len(_static_dims(x) or ())
    if bn.attrs.training or any(s is None for s in stats) or not ndim or stats[0].dtype.kind != "f":
        return None
    scale, shift = _scale_shift(bn, stats)
    axis = int(bn.attrs.axis) % ndim
    shape = (-1,) + (1,) * (ndim - axis - 1)
    dt = str(stats[0].dtype)
    return (relax.op.multiply(x, tensor_constant(scale.astype(dt).reshape(shape))),
            tensor_constant(shift.astype(dt).reshape(shape)))


def constant_reshape(call: relax.Call):
    """``reshape(constant, static shape)`` as a constant (frontends reshape biases for
    broadcasting), else None."""
    value, dims = _constant(call.args[0]), _static_dims(call)
    if value is None or dims is None:
        return None
    return tensor_constant(value.reshape(dims))


def summed_stack(call: relax.Call, lookup):
    """The operands of ``sum(stack(xs, axis=k), axis=[k])`` when they can simply be added
    (same static shape and dtype, no keepdims), else None. ``lookup`` maps a variable to
    the expression bound to it."""
    if call.attrs.keepdims or call.attrs.axis is None or len(call.attrs.axis) != 1:
        return None
    stacked = lookup(call.args[0])
    if not (isinstance(stacked, relax.Call) and stacked.op.same_as(STACK)):
        return None
    ndim = len(_static_dims(stacked) or ())
    if not ndim or int(call.attrs.axis[0]) % ndim != int(stacked.attrs.axis) % ndim:
        return None
    items = list(stacked.args[0].fields) if isinstance(stacked.args[0], relax.Tuple) else None
    if not items or len({_static_dims(x) for x in items}) != 1 or \
            len({str(x.ty.dtype) for x in items}) != 1:
        return None
    return items


def unbroadcast(call: relax.Call):
    """``broadcast_to(x, shape)``'s ``x`` when ``shape`` is ``x``'s own, else None."""
    dims = _static_dims(call.args[0])
    return call.args[0] if dims is not None and dims == _static_dims(call) else None
