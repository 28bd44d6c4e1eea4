"""THE op table: one row per elementwise op, with its LLVM rule, C rule and numpy reference.

A row either carries two *rules* (``llvm``: ``(builder, dtype, *values, **attrs) -> value``;
``c``: a format string over the operand names, or ``(dtype, *names, **attrs) -> str``) or
one *expansion* (``expand``: ``(emitter, dtype, *values, **attrs) -> value``) written once
in terms of other rows, which both renderers run through the same emitter interface. So
the transcendental functions are the same sequence of primitive operations in C and in
LLVM, and adding an elementwise op is one row here.

Rows with ``relax`` set are Relax ops (their rules are generated in
:mod:`jitbyoc.ir.rules`); the others are primitives the expansions use. Three fields say
how a Relax call maps onto a row: ``scalars`` (trailing call arguments that are constants,
passed as attributes: clip's bounds), ``relax_attrs_from`` (Relax attributes passed on:
astype's target dtype) and ``condition`` (the first operand is a bool condition and the
row's dtype is the other operands': where).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np
from llvmlite import ir

from . import bfloat, kir, quotients, vecmath
from .dtypes import ALL, BF16, FLOATS, HALF, INTS, NUMERIC
from .dtypes import dtype as lookup_dtype
from .llvmtypes import declare


class UnsupportedOp(NotImplementedError):
    """No lowering rule exists for an op/dtype pair."""


@dataclass(frozen=True)
class OpDef:
    arity: int
    ref: Callable
    dtypes: frozenset
    llvm: Callable | None = None
    c: str | Callable | None = None
    expand: Callable | None = None
    out: str | Callable | None = None  # result dtype when it differs from the operands'  
    relax: str | None = None
    ulp: int = 0  # documented error bound against the exact function (0: correctly rounded)
    scalars: tuple[str, ...] = ()  # attributes given as trailing constant call arguments
    relax_attrs_from: tuple[tuple[str, str], ...] = ()  # (attribute, Relax attribute)
    condition: bool = False  # operand 0 is a bool condition; the dtype is the others'
    traps: bool = False  # on integers, the CPU traps on some operands (division by zero)
    composite: str = ""  # its place in the anchor + bias + activation patterns: "bias", "activation"
    bf16_row: str = ""  # a cheaper row good enough where the result is rounded to bfloat16

    def relax_attrs(self, call) -> dict:
        """The attributes this row needs, taken from a Relax call of its op."""
        attrs = {name: _attr_value(getattr(call.attrs, field)) for name, field in self.relax_attrs_from}
        attrs.update((name, float(arg.value)) for name, arg in zip(self.scalars, call.args[self.arity:]))
        return attrs

    def result_dtype(self, dtype: str, attrs: dict) -> str:
        if callable(self.out):
            return self.out(dtype)
        return attrs.get("to") or self.out or dtype


def _attr_value(v):
    """A Relax attribute as a row attribute: a number as a float, anything else (a dtype) as text."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if hasattr(v, "value") and isinstance(v.value, (int, float)):
        return float(v.value)
    return str(v)


# ---- rule factories (one line per row below) -------------------------------------------

def _arith(fop: str, iop: str | None = None):
    def rule(b, dt, x, y):
        return getattr(b, fop if dt.is_float else iop)(x, y)
    return rule


def _cmp(op: str):
    def rule(b, dt, x, y):
        if dt.is_float:
            return b.fcmp_unordered(op, x, y) if op == "!=" else b.fcmp_ordered(op, x, y)
        return b.icmp_signed(op, x, y) if dt.signed else b.icmp_unsigned(op, x, y)
    return rule


def _intrinsic(name: str):
    def rule(b, dt, *xs):
        fname = f"llvm.{name}.{f'v{dt.lanes}' if dt.lanes > 1 else ''}f{dt.bits}"
        return b.call(declare(b.module, fname, dt.ir, [dt.ir] * len(xs)), xs)
    return rule


def _np_fma(x, y, z):
    """``x*y + z`` rounded once, as C's ``fma``: exact in rationals, then rounded to float64
    (correctly, by Python's division) and, for float32, through float64 rounded to odd
    (which leaves float32's rounding exact)."""
    def one(a, b, c):
        if not all(math.isfinite(v) for v in (a, b, c)):
            return a * b + c  # NaN and infinities: the product and sum rules decide
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        near = float(exact)
        if x.dtype == np.float32 and Fraction(near) != exact and math.isfinite(near) \
                and int(np.float64(near).view(np.int64)) % 2 == 0:
            near = math.nextafter(near, math.inf if exact > Fraction(near) else -math.inf)
        return near
    with np.errstate(all="ignore"):
        return np.vectorize(one, otypes=[np.float64])(x, y, z).astype(x.dtype)


def _np_divide(x, y):
    """numpy's division with C's integer semantics (truncation toward zero)."""
    if x.dtype.kind == "f":
        return np.divide(x, y)
    if x.dtype.kind == "u":
        return x // y
    x64, y64 = x.astype(np.int64), y.astype(np.int64)
    return (np.abs(x64) // np.abs(y64) * np.sign(x64) * np.sign(y64)).astype(x.dtype)


def _libm_call(name: str):
    """A call of libm's ``name`` (``namef`` for float32), lane by lane: LLVM has no
    intrinsic for it."""
    def rule(b, dt, *xs):
        scalar = lookup_dtype(dt.name)
        fn = declare(b.module, f"{name}{scalar.c_suffix}", scalar.ir, [scalar.ir] * len(xs))
        if dt.lanes == 1:
            return b.call(fn, xs)
        out = ir.Constant(dt.ir, ir.Undefined)
        for lane in range(dt.lanes):
            at = ir.Constant(ir.IntType(32), lane)
            out = b.insert_element(out, b.call(fn, [b.extract_element(x, at) for x in xs]), at)
        return out
    return rule


def _libm(name: str):
    """libm's ``name`` in C (``namef`` for float32); float16 through float32 and back: a
    ``_Float16`` argument makes ``fmod``/``fabs`` ambiguous overloads in C++ (TVM's export
    compiles with g++), and float holds every half exactly."""
    def rule(dt, *xs):
        if dt.is_float and dt.bits == 16:
            return f"(({dt.c}){name}f({', '.join(f'(float){x}' for x in xs)}))"
        return f"{name}{dt.c_suffix}({', '.join(xs)})"
    return rule


def wrapping_c(op: str):
    """C's ``x op y`` for integers wrapping as LLVM's ``add``/``sub``/``mul`` do: in an
    unsigned type of at least 32 bits, then converted back. Signed overflow is undefined in
    C (gcc folds ``x + 1 > x`` to true), and int8/int16/uint16 operands promote to int,
    where ``65535 * 65535`` overflows."""
    def rule(dt, *xs):
        if dt.is_float:
            return f"({f' {op} '.join(xs)})"
        wide = f"uint{max(32, dt.bits)}_t"
        return f"(({dt.c})({f' {op} '.join(f'({wide}){x}' for x in xs)}))"
    return rule


def _negate_c(dt, x):
    return f"(-{x})" if dt.is_float else wrapping_c("-")(dt, "0", x)


def _select_rule(pred: str):
    """max/min/relu as a compare and select, so NaN handling matches between renderers."""
    def rule(b, dt, x, y):
        return b.select(_cmp(pred)(b, dt, x, y), x, y)
    return rule


def _cast_llvm(b, dt, x, to):
    dst = lookup_dtype(to).with_lanes(dt.lanes)
    if dt.name == dst.name:
        return x
    if dt.is_bfloat:  # exactly to float32, then on as float32 goes
        f32 = lookup_dtype("float32").with_lanes(dt.lanes)
        return _cast_llvm(b, f32, bfloat.to_float32(b, x), to)
    if dst.is_bfloat:  # to float32 as any float32 cast, then rounded to bfloat16
        return bfloat.from_float32(b, _cast_llvm(b, dt, x, "float32"))
    if dt.is_bool:
        return b.uitofp(x, dst.ir) if dst.is_float else b.zext(x, dst.ir)
    if dst.is_bool:
        zero = ir.Constant(dt.ir, 0.0 if dt.is_float else 0)
        return b.fcmp_unordered("!=", x, zero) if dt.is_float else b.icmp_unsigned("!=", x, zero)
    if dt.is_float and dst.is_float:
        return b.fpext(x, dst.ir) if dst.bits > dt.bits else b.fptrunc(x, dst.ir)
    if dt.is_float:
        return b.fptosi(x, dst.ir) if dst.signed else b.fptoui(x, dst.ir)
    if dst.is_float:
        return b.sitofp(x, dst.ir) if dt.signed else b.uitofp(x, dst.ir)
    if dst.bits == dt.bits:
        return x
    if dst.bits < dt.bits:
        return b.trunc(x, dst.ir)
    return b.sext(x, dst.ir) if dt.signed else b.zext(x, dst.ir)


def _cast_c(dt, x, to):
    dst = lookup_dtype(to)
    if dt.is_bfloat and dt.name != dst.name:
        return _cast_c(lookup_dtype("float32"), bfloat.to_float32_c(x), to)
    if dst.is_bfloat and dt.name != dst.name:
        return bfloat.from_float32_c(_cast_c(dt, x, "float32"))
    if dst.is_bool and dt.is_float:
        return f"({x} != 0)"
    return f"(({dst.c}){x})"


def _bitcast_llvm(b, dt, x):
    return b.bitcast(x, lookup_dtype(_BITCAST[dt.name]).with_lanes(dt.lanes).ir)


def _bitcast_c(dt, x):
    return f"jb_bits_{'f' if dt.is_float else 'i'}{dt.bits}({x})"


def _abs_int(b, dt, x):
    if not dt.signed:
        return x
    return b.select(b.icmp_signed("<", x, ir.Constant(dt.ir, 0)), b.neg(x), x)


def _zero(dt):
    return ir.Constant(dt.ir, 0.0 if dt.is_float else 0)


def _floor_div_llvm(b, dt, x, y):
    """Integer division rounding down (C's ``/`` truncates): one less where the
    remainder is nonzero and its sign differs from the divisor's."""
    if not dt.signed:
        return b.udiv(x, y)
    r = b.srem(x, y)
    return b.sub(b.sdiv(x, y), b.zext(_floor_fix(b, dt, r, y), dt.ir))


def _floor_mod_llvm(b, dt, x, y):
    if dt.is_float:  # TVM's floormod of floats: x - floor(x / y) * y
        return b.fsub(x, b.fmul(_intrinsic("floor")(b, dt, b.fdiv(x, y)), y))
    if not dt.signed:
        return b.urem(x, y)
    r = b.srem(x, y)
    return b.select(_floor_fix(b, dt, r, y), b.add(r, y), r)


def _floor_fix(b, dt, r, y):
    neg = b.icmp_signed("!=", b.icmp_signed("<", r, _zero(dt)), b.icmp_signed("<", y, _zero(dt)))
    return b.and_(b.icmp_signed("!=", r, _zero(dt)), neg)


def _floor_fix_c(x, y) -> str:
    """C twin of :func:`_floor_fix`: the remainder is nonzero and its sign differs from
    the divisor's."""
    return f"({x} % {y} != 0 && (({x} % {y} < 0) != ({y} < 0)))"


def _floor_div_c(dt, x, y):
    if not dt.signed:
        return f"({x} / {y})"
    return f"({x} / {y} - {_floor_fix_c(x, y)})"


def _floor_mod_c(dt, x, y):
    if dt.is_float and dt.bits == 16:  # each operation in float, rounded to half, as LLVM legalizes half
        quotient = f"(float)(_Float16)((float){x} / (float){y})"
        product = f"(float)(_Float16)(floorf({quotient}) * (float){y})"
        return f"(_Float16)((float){x} - {product})"
    if dt.is_float:
        return f"({x} - {_libm('floor')(dt, f'({x} / {y})')} * {y})"
    if not dt.signed:
        return f"({x} % {y})"
    return f"({x} % {y} + ({_floor_fix_c(x, y)} ? {y} : 0))"


def _np_floor_mod(x, y):
    """numpy's mod for integers; TVM's ``x - floor(x / y) * y`` for floats (numpy's float
    mod rounds differently)."""
    if x.dtype.kind == "f":
        with np.errstate(divide="ignore", invalid="ignore"):
            return (x - np.floor(x / y) * y).astype(x.dtype)
    return np.mod(x, y)


def _mod_llvm(b, dt, x, y):
    """Remainder truncated toward zero (C's ``%``, ``fmod``)."""
    if dt.is_float:
        return b.frem(x, y)
    return b.srem(x, y) if dt.signed else b.urem(x, y)


def _relu_llvm(b, dt, x):
    zero = ir.Constant(dt.ir, 0.0 if dt.is_float else 0)
    return _select_rule(">")(b, dt, x, zero)


def _np_erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy()


def _np_gelu(x):
    # x/2 * erfc(-x/sqrt2): 1 + erf(x/sqrt2) cancels for x << 0
    erfc = np.vectorize(math.erfc, otypes=[x.dtype])(-x / np.sqrt(x.dtype.type(2))) if x.size else x
    return (0.5 * x * erfc).astype(x.dtype)


def _np_gelu_tanh(x):
    # 0.5*x*(1 + tanh(u)) as x * sigmoid(2u): 1 + tanh(u) cancels for x << 0
    k = np.sqrt(2 / np.pi).astype(x.dtype)
    return (x * _np_sigmoid(2 * k * (x + 0.044715 * x ** 3))).astype(x.dtype)


def _np_sigmoid(x):
    with np.errstate(over="ignore"):
        return (1 / (1 + np.exp(-x))).astype(x.dtype)


def _np_clip(x, lo, hi):
    """TVM's clip: ``max(min(x, hi), lo)`` with its NaN-ignoring min and max (NaN -> hi)."""
    return np.fmax(np.fmin(x, x.dtype.type(hi)), x.dtype.type(lo)).astype(x.dtype)


_BITCAST = {"float32": "int32", "int32": "float32", "float64": "int64", "int64": "float64"}
F, I, N, B, H = FLOATS, INTS, NUMERIC, frozenset({"bool"}), HALF
NB = NUMERIC | B

OPS: dict[str, OpDef] = {
    # arithmetic: bit-identical between renderers
    "add":      OpDef(2, np.add, N, _arith("fadd", "add"), wrapping_c("+"), relax="relax.add",
                      composite="bias"),
    "subtract": OpDef(2, np.subtract, N, _arith("fsub", "sub"), wrapping_c("-"), relax="relax.subtract"),
    "multiply": OpDef(2, np.multiply, N, _arith("fmul", "mul"), wrapping_c("*"), relax="relax.multiply"),
    # integers: C's (and TVM's) truncating division
    "divide":   OpDef(2, _np_divide, N, lambda b, dt, x, y: b.fdiv(x, y) if dt.is_float
                      else (b.sdiv if dt.signed else b.udiv)(x, y), "({0} / {1})", relax="relax.divide",
                      traps=True),
    "fma":      OpDef(3, _np_fma, F, _intrinsic("fma"), _libm("fma")),
    "maximum":  OpDef(2, np.maximum, N | H, _select_rule(">"), "({0} > {1} ? {0} : {1})", relax="relax.maximum"),
    "minimum":  OpDef(2, np.minimum, N | H, _select_rule("<"), "({0} < {1} ? {0} : {1})", relax="relax.minimum"),
    "negative": OpDef(1, np.negative, N | H, lambda b, dt, x: b.fneg(x) if dt.is_float else b.neg(x),
                      _negate_c, relax="relax.negative"),
    "abs":      OpDef(1, np.abs, N | H, lambda b, dt, x: _intrinsic("fabs")(b, dt, x) if dt.is_float
                      else _abs_int(b, dt, x), lambda dt, x: _libm("fabs")(dt, x) if dt.is_float
                      else f"({x} < 0 ? {_negate_c(dt, x)} : {x})", relax="relax.abs"),
    "relu":     OpDef(1, lambda x: np.maximum(x, 0).astype(x.dtype), N, _relu_llvm,
                      "({0} > 0 ? {0} : 0)", relax="relax.nn.relu", composite="activation"),
    "square":   OpDef(1, np.square, N, lambda b, dt, x: _arith("fmul", "mul")(b, dt, x, x),
                      lambda dt, x: wrapping_c("*")(dt, x, x), relax="relax.square"),
    "sqrt":     OpDef(1, np.sqrt, F, _intrinsic("sqrt"), _libm("sqrt"), relax="relax.sqrt"),
    "floor":    OpDef(1, np.floor, F, _intrinsic("floor"), _libm("floor"), relax="relax.floor"),
    "ceil":     OpDef(1, np.ceil, F, _intrinsic("ceil"), _libm("ceil"), relax="relax.ceil"),
    "rsqrt":    OpDef(1, lambda x: (1 / np.sqrt(x)).astype(x.dtype), F,
                      expand=lambda e, dt, x: e.op("divide", dt, e.const(1, dt), e.op("sqrt", dt, x)),
                      relax="relax.rsqrt"),
    # comparisons and logic: bool results
    "equal":         OpDef(2, np.equal, ALL | H, _cmp("=="), "({0} == {1})", out="bool", relax="relax.equal"),
    "not_equal":     OpDef(2, np.not_equal, ALL | H, _cmp("!="), "({0} != {1})", out="bool", relax="relax.not_equal"),
    "less":          OpDef(2, np.less, N | H, _cmp("<"), "({0} < {1})", out="bool", relax="relax.less"),
    "less_equal":    OpDef(2, np.less_equal, N | H, _cmp("<="), "({0} <= {1})", out="bool", relax="relax.less_equal"),
    "greater":       OpDef(2, np.greater, N | H, _cmp(">"), "({0} > {1})", out="bool", relax="relax.greater"),
    "greater_equal": OpDef(2, np.greater_equal, N | H, _cmp(">="), "({0} >= {1})", out="bool", relax="relax.greater_equal"),
    "logical_and":   OpDef(2, np.logical_and, B, lambda b, dt, x, y: b.and_(x, y), "({0} && {1})", relax="relax.logical_and"),
    "logical_or":    OpDef(2, np.logical_or, B, lambda b, dt, x, y: b.or_(x, y), "({0} || {1})", relax="relax.logical_or"),
    "logical_not":   OpDef(1, np.logical_not, B, lambda b, dt, x: b.not_(x), "(!{0})", relax="relax.logical_not"),
    # dtype of the operands is the dtype of the branches; the condition is bool
    "where":    OpDef(3, np.where, NB, lambda b, dt, c, x, y: b.select(c, x, y), "({0} ? {1} : {2})",
                      relax="relax.where", condition=True),
    "astype":   OpDef(1, lambda x, to: x.astype(to), NB | BF16 | H, _cast_llvm, _cast_c, relax="relax.astype",
                      relax_attrs_from=(("to", "dtype"),)),
    "clip":     OpDef(1, _np_clip, N,
                      expand=lambda e, dt, x, lo, hi: e.op("maximum", dt, e.op("minimum", dt, x,
                                                           e.const(hi, dt)), e.const(lo, dt)),
                      relax="relax.clip", scalars=("lo", "hi")),
    # transcendental: one expansion, rendered identically by both renderers
    "exp":      OpDef(1, np.exp, F, expand=vecmath.exp, relax="relax.exp", ulp=2),
    "expm1":    OpDef(1, np.expm1, F, expand=vecmath.expm1, ulp=3),
    "log":      OpDef(1, np.log, F, expand=vecmath.log, relax="relax.log", ulp=2),
    "tanh":     OpDef(1, np.tanh, F, expand=vecmath.tanh, relax="relax.tanh", ulp=4,
                      composite="activation"),
    "sigmoid":  OpDef(1, _np_sigmoid, F, expand=vecmath.sigmoid, relax="relax.sigmoid", ulp=4,
                      composite="activation"),
    "erf":      OpDef(1, _np_erf, F, expand=vecmath.erf, relax="relax.erf", ulp=4),
    "gelu":     OpDef(1, _np_gelu, F, expand=vecmath.gelu, relax="relax.nn.gelu", ulp=8,
                      composite="activation", bf16_row="gelu_bf16"),
    # within vecmath.GELU_BF16_BOUND * |x| in float32 (ulp: float64's, gelu's own)
    "gelu_bf16": OpDef(1, _np_gelu, F, expand=vecmath.gelu_bf16, ulp=8),
    "gelu_tanh": OpDef(1, _np_gelu_tanh, F, expand=vecmath.gelu_tanh, relax="relax.nn.gelu_tanh",
                       ulp=8, composite="activation"),  # for x >= -1.5; see vecmath
    "silu":     OpDef(1, lambda x: (x * _np_sigmoid(x)).astype(x.dtype), F, expand=vecmath.silu,
                      relax="relax.nn.silu", ulp=8, composite="activation"),
    "power":    OpDef(2, np.power, F, expand=vecmath.power, relax="relax.power",
                      ulp=64),  # for |y*ln|x|| <= 31; see vecmath
    # primitives for the expansions
    "select":   OpDef(3, np.where, NB, lambda b, dt, c, x, y: b.select(c, x, y), "({0} ? {1} : {2})"),
    "bitcast":  OpDef(1, None, F | I, _bitcast_llvm, _bitcast_c, out=_BITCAST.__getitem__),
    # integer bit ops (shifts by the width or more: undefined, as in C and TVM's LLVM build)
    "shl":      OpDef(2, np.left_shift, I, lambda b, dt, x, y: b.shl(x, y), wrapping_c("<<"),
                      relax="relax.left_shift"),
    "shr":      OpDef(2, np.right_shift, I, lambda b, dt, x, y: b.ashr(x, y) if dt.signed else b.lshr(x, y),
                      "({0} >> {1})", relax="relax.right_shift"),
    "bitand":   OpDef(2, np.bitwise_and, I | B, lambda b, dt, x, y: b.and_(x, y), "({0} & {1})",
                      relax="relax.bitwise_and"),
    "bitor":    OpDef(2, np.bitwise_or, I | B, lambda b, dt, x, y: b.or_(x, y), "({0} | {1})",
                      relax="relax.bitwise_or"),
    "bitxor":   OpDef(2, np.bitwise_xor, I | B, lambda b, dt, x, y: b.xor(x, y), "({0} ^ {1})",
                      relax="relax.bitwise_xor"),
    "bitnot":   OpDef(1, np.invert, I, lambda b, dt, x: b.not_(x), "(~{0})", relax="relax.bitwise_not"),
    "logical_xor": OpDef(2, np.logical_xor, B, lambda b, dt, x, y: b.xor(x, y), "({0} != {1})",
                         relax="relax.logical_xor"),
    # integer division and remainders (nonzero divisors; INT_MIN / -1 is undefined, as in C);
    # floor_mod of floats is TVM's x - floor(x / y) * y
    "floor_divide": OpDef(2, np.floor_divide, I, _floor_div_llvm, _floor_div_c, relax="relax.floor_divide",
                          traps=True),
    "floor_mod": OpDef(2, _np_floor_mod, N | H, _floor_mod_llvm, _floor_mod_c, relax="relax.floor_mod", traps=True),
    "mod":      OpDef(2, np.fmod, N | H, _mod_llvm, lambda dt, x, y: _libm("fmod")(dt, x, y) if dt.is_float
                      else f"({x} % {y})", relax="relax.mod", traps=True),
    # float classification and rounding
    "isnan":    OpDef(1, np.isnan, F | H, expand=lambda e, dt, x: e.op("not_equal", dt, x, x), out="bool",
                      relax="relax.isnan"),
    "isinf":    OpDef(1, np.isinf, F | H, expand=lambda e, dt, x: e.op("equal", dt, e.op("abs", dt, x),
                                                                  e.const(math.inf, dt)),
                      out="bool", relax="relax.isinf"),
    "isfinite": OpDef(1, np.isfinite, F | H, expand=lambda e, dt, x: e.op("less", dt, e.op("abs", dt, x),
                                                                     e.const(math.inf, dt)),
                      out="bool", relax="relax.isfinite"),
    # the C library's (TVM's LLVM build calls the same functions through the same intrinsics)
    "sin":      OpDef(1, np.sin, F, _intrinsic("sin"), _libm("sin"), relax="relax.sin", ulp=1),
    "cos":      OpDef(1, np.cos, F, _intrinsic("cos"), _libm("cos"), relax="relax.cos", ulp=1),
    **{name: OpDef(1, getattr(np, numpy), F, _intrinsic(name), _libm(name), relax=f"relax.{name}", ulp=2)
       for name, numpy in (("tan", "tan"), ("asin", "arcsin"), ("acos", "arccos"), ("atan", "arctan"),
                           ("sinh", "sinh"), ("cosh", "cosh"))},
    **{name: OpDef(1, getattr(np, numpy), F, _libm_call(name), _libm(name), relax=f"relax.{name}", ulp=2)
       for name, numpy in (("asinh", "arcsinh"), ("acosh", "arccosh"), ("atanh", "arctanh"))},
    "round":    OpDef(1, np.round, F, _intrinsic("nearbyint"), _libm("nearbyint"), relax="relax.round"),
    # round(x / s) for a divisor the loop does not change (a quantize's scale), exactly
    "round_quotient": OpDef(2, quotients.reference, F, quotients.round_quotient_llvm,
                            lambda dt, x, s: _libm("nearbyint")(dt, f"({x} / {s})")),
    # round(clamp(x / s, lo, hi)), lo <= hi integers: a quantize to 8 or 16 bits, clamped first
    "round_clamped_quotient": OpDef(4, quotients.clamped_reference, F, quotients.round_clamped_quotient_llvm,
                                    lambda dt, *xs: _libm("nearbyint")(dt, quotients.clamped_c(*xs))),
    # the same as x * (1 / s), untested: a requantization after reordered sums (quotients.reordered)
    "round_product": OpDef(2, quotients.product_reference, F, quotients.round_product_llvm,
                           lambda dt, x, s: _libm("nearbyint")(dt, quotients.product_c(x, s))),
    "round_clamped_product": OpDef(4, quotients.clamped_product_reference, F,
                                   quotients.round_clamped_product_llvm,
                                   lambda dt, x, s, lo, hi: _libm("nearbyint")(
                                       dt, quotients.clamped_c(x, s, lo, hi, quotients.product_c))),
    "trunc":    OpDef(1, np.trunc, F, _intrinsic("trunc"), _libm("trunc"), relax="relax.trunc"),
    # TVM's sign: 0 for NaN (both comparisons are false), where numpy's is NaN
    "sign":     OpDef(1, lambda x: np.where(x < 0, -1, np.where(x > 0, 1, 0)).astype(x.dtype), N,
                      expand=lambda e, dt, x: e.op("select", dt, e.op("greater", dt, x, e.const(0, dt)), e.const(1, dt),
                                                   e.op("select", dt, e.op("less", dt, x, e.const(0, dt)),
                                                        e.const(-1, dt), e.const(0, dt))
                                                   if lookup_dtype(dt).signed else e.const(0, dt)),
                      relax="relax.sign"),
    "leakyrelu": OpDef(1, lambda x, alpha: np.where(x > 0, x, x * x.dtype.type(alpha)).astype(x.dtype), F,
                       expand=lambda e, dt, x, alpha: e.op("select", dt, e.op("greater", dt, x, e.const(0, dt)),
                                                           x, e.op("multiply", dt, x, e.const(alpha, dt))),
                       relax="relax.nn.leakyrelu", relax_attrs_from=(("alpha", "alpha"),)),
}


def op_def(name: str, dtype: str | None = None) -> OpDef:
    """The row for ``name``; raises :class:`UnsupportedOp` naming the known ops."""
    row = OPS.get(name)
    if row is None:
        raise UnsupportedOp(f"jitbyoc: no lowering rule for op '{name}'; known: {sorted(OPS)}")
    if dtype is not None and dtype not in row.dtypes:
        raise UnsupportedOp(f"jitbyoc: op '{name}' has no rule for dtype {dtype}; "
                            f"supported: {sorted(row.dtypes)}")
    return row


def traps_on_masked_lanes(exprs) -> bool:
    """Whether an expression DAG holds an integer op that traps on the zeros a masked-off
    lane holds (division, modulo): such expressions are not evaluated on vectors whose
    tail lanes are masked off."""
    return any(isinstance(n, kir.Op) and op_def(n.op).traps and not lookup_dtype(n.in_dtype).is_float
               for n in kir.walk([e for e in exprs if e is not None]))
