"""Lower precision, opt-in: :func:`lower_precision` rewrites a float32 model's products
to bfloat16 operands summed in float32, as OpenVINO's ``INFERENCE_PRECISION_HINT=bf16``
and torch's ``autocast(dtype=torch.bfloat16)`` compute them.

The rewrite is Relax, not a jitbyoc setting hidden in the build: ``matmul(x, W)`` of a
float32 ``x`` and a constant weight ``W`` becomes ``matmul(astype(x, "bfloat16"), W',
out_dtype="float32")`` with ``W'`` the weight rounded to bfloat16 once, here, and a
``conv2d`` of a constant weight likewise, where jitbyoc runs it faster so
(:func:`_narrower_is_faster`). The rewritten module means the same thing to TVM's own
build (its differential reference) as to jitbyoc's, which runs the products on
``vdpbf16ps`` (:mod:`jitbyoc.engines.products`) and reads ``W'`` packed at build time.
A product of two computed matrices (attention's ``Q K^T`` and ``P V``) gets both operands
rounded (:func:`_pairs`); fused attention then rounds the probabilities in its row block
and runs both products on bfloat16 pairs, on AMX tiles where the machine has them
(ViT-B/16 0.96x, BERT-base 0.98x the time with attention in float32; Sapphire Rapids).
Everything else (elementwise work, norms, softmax) stays float32, and the default stays
float32 and exact.

Error: each operand is rounded to nearest even once (relative error at most 2**-9), the
products of two bfloat16 values are exact in float32, and the sum runs in float32; so
``|y - x @ W| <= (2 * 2**-9 + 2**-18) * (|x| @ |W|) + gamma_K * (|x'| @ |W'|)``
elementwise (``gamma_K`` as in :mod:`jitbyoc.kernels.matmul`).
"""

from __future__ import annotations

import ml_dtypes
import tvm
from tvm import relax
from tvm.ir.prim import IntImm

from ..engines.conv_channel_plan import ChannelPlan
from ..engines.gemm_tiles import has_tiles
from ..ir.rules import why_not
from ..kernels import conv2d
from .constants import constant, tensor_constant
from .inference import MATMUL, conv2d_like
from .linear import weight_value
from .round_early import round_early, rounding_of

CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
MIN_CHANNELS = 2  # input channels per group below which a convolution stays float32 (depthwise)
SMALL_MAP = 49  # output pixels up to which a map float32 runs on channel vectors stays float32 unless bf16 does too
# A 3x3 stride-1 convolution is lowered where float32 would run it by Winograd's F(4x4,
# 3x3) too. Such convs used to stay float32 where the tiles fit the map (measured
# faster in quiet phases of this VM: Inception v1 0.91-1.03x, ResNet-50
# 0.91-1.01x), but the transforms' passes read what the other core wrote, and in the VM's
# slow phases they ran up to 2.2x their quiet time while bf16's direct engine held its own.
# Zen 4, 2 threads, exported bf16 builds in turns in one process, the rule off / on:
# ResNet-50 0.967 over 90 s (the rounds where the rule's build ran fast: 0.998, the slow
# ones: 0.945) and 0.978 over 60 s in the other order; Inception v1 0.968 (0.988, 0.944).


def _narrower_is_faster(geo) -> bool:
    """Whether jitbyoc runs ``geo`` faster in bf16. Measured (Zen 4, 2 threads, quiet machine,
    bf16 with a constant bf16 weight vs float32, each in turns): a 3x3 64->64 on 56x56
    1.85-1.92x against float32's direct convolution, and level with or faster than
    float32's Winograd (the note above this function); the 3-channel 7x7/2 stem
    1.42-1.44x (a weight packed per call: 3 channels do not pair); 3x3 grouped with 2
    channels a group 1.15x; but depthwise (one channel a group: every unit half zeros,
    against float32's own depthwise kernel) 0.48x, and a 3x3 512->512 on 7x7 0.74-0.82x on
    the pixel engine (vectors of pixels waste lanes on a 7-wide map) but 2.1x on
    output-channel vectors of pairs: a map that float32 runs on channel vectors is lowered
    where bf16 runs on them too. 1x1 and patch convolutions are products on the GEMM engine
    (1.8-1.9x): always. Grouped ones too: RegNetY's 784@7 (groups of 16) in its bf16 build
    0.070-0.074 ms on the pixel engine against 0.098-0.102 left float32 on channel vectors,
    784@14/2 level."""
    if geo.as_matmul:  # a product on the GEMM engine, in units of the reduction
        return True
    if geo.groups == 1 and geo.cg >= MIN_CHANNELS and has_tiles("bfloat16"):
        return True  # gathered as columns, a product on AMX tiles (ConvGeometry.columns)
    if geo.cg < MIN_CHANNELS:
        return False
    if geo.groups > 1:  # float32 runs some on channel vectors, bf16 on the pixel engine: still faster
        return True
    on_channels = lambda dt: isinstance(conv2d.engine_plan(geo, dt), ChannelPlan)  # noqa: E731
    return geo.oh * geo.ow > SMALL_MAP or on_channels("bfloat16") or not on_channels("float32")


PRECISIONS = ("bf16",)


def _pairs(call) -> bool:
    """Whether a float32 ``matmul`` of two computed operands runs in bfloat16: both
    operands matrices or stacks of them of static sizes (an encoder's attention, a
    prompt's). A vector times a matrix stays a float32 GEMV, and so does a decoder's step
    with symbolic lengths: its ``K`` and ``V`` are the whole cache, which would be
    rounded again, a pass over the cache, for each token."""
    x, y = call.args
    return all(str(v.ty.dtype) == "float32" and v.ty.ndim >= 2 and _static(v) for v in (x, y)) \
        and str(call.ty.dtype) == "float32"


def _static(value) -> bool:
    shape = value.ty.shape
    return isinstance(shape, relax.ShapeExpr) and all(isinstance(d, IntImm) for d in shape.values)


@relax.expr_functor.mutator
class _ToBFloat16(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.narrowed: dict = {}

    def visit_dataflow_block_(self, block):
        self.narrowed = {}  # a dataflow var lives in its block
        return super().visit_dataflow_block_(block)

    def visit_binding_block_(self, block):
        self.narrowed = {}
        return super().visit_binding_block_(block)

    def narrow(self, x):
        """``astype(x, "bfloat16")``, emitted once per ``x``: an Inception module's input
        feeds three convolutions, which each cast it (three passes, three buffers)."""
        if x not in self.narrowed:
            self.narrowed[x] = self.builder_.emit(relax.op.astype(x, "bfloat16"))
        return self.narrowed[x]

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op.same_as(CONV2D):
            return self._conv(call)
        if not call.op.same_as(MATMUL):
            return call
        x, weight = call.args
        value = weight_value(weight, self.lookup_binding)
        if value is None:
            return self._activations(call)
        if value.ndim != 2 or str(value.dtype) != "float32" \
                or str(x.ty.dtype) != "float32" or str(call.ty.dtype) != "float32":
            return call
        return relax.op.matmul(self.narrow(x), tensor_constant(value.astype(ml_dtypes.bfloat16)), "float32")

    def _activations(self, call):
        """A float32 product of two computed operands (attention's ``Q K^T`` and ``P V``)
        with both rounded to bfloat16, where jitbyoc pairs them (:func:`_pairs`)."""
        x, y = call.args
        if not _pairs(call):
            return call
        return relax.op.matmul(self.narrow(x), self.narrow(y), "float32")

    def _conv(self, call):
        """A float32 convolution of a constant weight, in bf16 where that runs faster
        (:func:`_narrower_is_faster`)."""
        x, weight = call.args
        value = constant(self.lookup_binding(weight) if isinstance(weight, relax.Var) else weight)
        if value is None or str(value.dtype) != "float32" or why_not(call) is not None \
                or str(call.ty.dtype) != "float32" or not _narrower_is_faster(conv2d.conv_geometry(call)):
            return call
        return conv2d_like(call, self.narrow(x), tensor_constant(value.astype(ml_dtypes.bfloat16)), out_dtype="float32")


ACTIVATIONS = ("float32", "bf16")


@relax.expr_functor.mutator
class _NarrowActivations(relax.PyExprMutator):
    """A computed float32 value that a product reads rounded (``astype(x, "bfloat16")``)
    and other work reads as it is: the other work reads the rounded value widened, so
    the value is stored once, in bfloat16. A residual stream
    (ResNet's ``relu(conv + x)``, a transformer's ``x + attention``) then moves half the
    bytes, as OpenVINO's bf16 default keeps activations."""

    def __init__(self, mod, narrowed: set):
        super().__init__(mod)
        self.narrowed = narrowed  # the vars some binding rounds to bfloat16
        self.widened: dict = {}  # var -> [its bfloat16 var, the widened var once a use needs it]

    def visit_var_binding_(self, binding):
        value = binding.value
        source = rounding_of(value)
        if source is not None and source in self.widened:  # one rounding
            if isinstance(binding.var, relax.DataflowVar):
                self.set_var_remap(binding.var, self.widened[source][0])
            else:  # an output var stays the function's, bound to the rounding
                super().visit_var_binding_(relax.VarBinding(binding.var, self.widened[source][0]))
            return
        var = binding.var
        if var not in self.narrowed or not isinstance(var, relax.DataflowVar):
            super().visit_var_binding_(binding)  # model outputs and inputs stay as they are
            return
        new = self.builder_.emit(self.visit_expr(value), var.name)
        self.set_var_remap(var, new)
        self.widened[var] = [self.builder_.emit(relax.op.astype(new, "bfloat16")), None]

    def visit_dataflow_var_(self, var):
        """A use of a rounded value reads it widened, emitted before its first use (there
        it joins the user's region: emitted beside the rounding, it would join the
        producer's, which would write it in float32 once more)."""
        pair = self.widened.get(var)
        if pair is None:
            return super().visit_dataflow_var_(var)
        if pair[1] is None:
            pair[1] = self.builder_.emit(relax.op.astype(pair[0], "float32"))
        return pair[1]


def _rounded_vars(func: relax.Function) -> set:
    """The float32 vars ``func`` rounds to bfloat16 somewhere."""
    found: set = set()

    def visit(e):
        source = rounding_of(e)
        if source is not None:
            found.add(source)
    relax.analysis.post_order_visit(func.body, visit)
    return found


def lower_precision(mod: tvm.IRModule, precision: str = "bf16", activations: str = "float32") -> tvm.IRModule:
    """``mod`` with its float32 products of a constant weight (linear layers, torch's
    ``x @ W.T`` included; convolutions, where bf16 runs faster) computed from bfloat16 operands
    summed in float32; build the
    result with ``tvm.compile`` as any module. ``precision``: ``"bf16"``. ``activations``:
    ``"float32"`` (the default: elementwise work reads float32 values) or ``"bf16"``: a
    value that a product reads rounded is stored rounded, and elementwise work reads it
    widened (:class:`_NarrowActivations`; OpenVINO's bf16 default)."""
    if precision not in PRECISIONS:
        raise ValueError(f"jitbyoc.lower_precision: precision {precision!r} is not one of {PRECISIONS}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"jitbyoc.lower_precision: activations {activations!r} is not one of {ACTIVATIONS}")
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            func = _ToBFloat16(mod).visit_expr(func)
            func = round_early(func)
            if activations == "bf16":
                func = _NarrowActivations(mod, _rounded_vars(func)).visit_expr(func)
            func = relax.analysis.remove_all_unused(func)
        out[gv] = func
    return tvm.IRModule(out, attrs=mod.attrs)
