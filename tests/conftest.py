"""Shared test helpers: build a model with BlockBuilder, compile it with TVM's default
pipeline and with jitbyoc, run both, and compare (exactly, bit for bit, or in ulps)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.toolchain import driver
from jitbyoc.toolchain.region import Region
from jitbyoc.ir import kir
from jitbyoc.ir import sizes as size_exprs
from jitbyoc.ir.ops import OPS
from jitbyoc.tvm.partition import CHECK_MISS

RELAX_ROWS = sorted(name for name, row in OPS.items() if row.relax)
# everything jitbyoc stores, in the order the tests walk them
DTYPES = ("float32", "float64", "int32", "int64", "bool", "int8", "int16", "uint8", "uint16", "uint32", "uint64")


class _CheckMisses(logging.Handler):
    """Collects the records of regions whose op checks passed but whose lowering failed."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record):
        if getattr(record, CHECK_MISS, False):
            self.found.append(record.getMessage())


@pytest.fixture(autouse=True)
def rules_check_what_they_build(request):
    """Issue 41, item 2: a call an op's rule accepts always lowers. Partitioning still
    leaves such a call to TVM (a build never fails for it), but every test, the ONNX
    conformance suite and the zoo's included, fails when one happens. Tests that break a
    builder on purpose are marked ``check_miss``."""
    handler = _CheckMisses()
    logger = logging.getLogger("jitbyoc")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
    if request.node.get_closest_marker("check_miss") is None:
        assert handler.found == [], "an op's rule accepted what its builder failed on"


# ---- models ---------------------------------------------------------------------------

def build_model(params: dict, body) -> tvm.IRModule:
    """``main(**params)`` whose dataflow block is ``body(bb, *vars)``.

    ``params`` maps a name to ``(shape, dtype)``; a str in a shape is a symbolic size,
    shared by every parameter that names it. ``body`` emits with ``bb.emit`` and returns
    the output (a var, or a list of vars for a tuple output).
    """
    syms: dict[str, tvm.ir.expr.Var] = {}

    def dim(d):
        return syms.setdefault(d, tvm.ir.expr.Var(d, "int64")) if isinstance(d, str) else d

    args = [relax.Var(name, relax.TensorType([dim(d) for d in shape], dtype))
            for name, (shape, dtype) in params.items()]
    return function_of(args, body)


def function_of(args: list, body) -> tvm.IRModule:
    """``main(*args)`` (Relax vars) whose dataflow block is ``body(bb, *args)`` (see
    :func:`build_model`)."""
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            out = body(bb, *args)
            gv = bb.emit_output(relax.Tuple(out) if isinstance(out, list) else out)
        bb.emit_func_output(gv)
    return bb.get()


def relax_call(name: str, args, attrs: dict | None = None) -> relax.Expr:
    """Row ``name`` of the op table as a Relax call; ``attrs`` are the row's keyword
    attributes (``to`` for astype, ``lo``/``hi`` for clip), passed positionally."""
    fn = relax.op
    for part in OPS[name].relax.split(".")[1:]:
        fn = getattr(fn, part)
    return fn(*args, *(attrs or {}).values())


# ---- building and running --------------------------------------------------------------

@dataclass
class Builds:
    tvm: relax.VirtualMachine | None  # None where TVM's own build fails
    jit: relax.VirtualMachine
    report: jitbyoc.Report

    def run(self, *arrays) -> tuple:
        return run(self.tvm, *arrays) if self.tvm else None, run(self.jit, *arrays)


def build_tvm(mod: tvm.IRModule) -> relax.VirtualMachine:
    with jitbyoc.disabled():
        return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())


def build_both(mod: tvm.IRModule, tvm_builds: bool = True) -> Builds:
    """``mod`` built by TVM's default pipeline (unless ``tvm_builds`` is False) and by
    jitbyoc, with jitbyoc's offload report."""
    ref = build_tvm(mod) if tvm_builds else None
    with jitbyoc.enabled():
        ours = tvm.compile(mod, target="llvm")
        rep = jitbyoc.last_report()
    return Builds(ref, relax.VirtualMachine(ours, tvm.cpu()), rep)


def run(vm: relax.VirtualMachine, *arrays):
    out = vm["main"](*[tvm.runtime.tensor(np.asarray(a, order="C")) for a in arrays])
    if isinstance(out, tvm.runtime.Tensor):
        return out.numpy()
    return [o.numpy() for o in out]


def jit_function(region: Region):
    """The packed function jitbyoc's build would run for ``region`` (its machine code,
    loaded the way a build loads it; no Relax involved)."""
    return driver.load_region(region)[region.symbol]


def call_region(fn, kernel: kir.Kernel, inputs) -> list[np.ndarray]:
    """Call a region's packed function on ``inputs`` with fresh outputs; symbolic sizes
    are read off the inputs."""
    outs = [tvm.runtime.tensor(np.zeros(shape, b.dtype))
            for b, shape in zip(kernel.outputs, output_shapes(kernel, inputs))]
    fn(*[tvm.runtime.tensor(np.asarray(a, order="C")) for a in inputs], *outs)
    return [o.numpy() for o in outs]


def output_shapes(kernel: kir.Kernel, inputs) -> list[tuple]:
    """The shapes of ``kernel``'s outputs for ``inputs``: plain symbolic sizes read off the
    inputs, derived ones computed from them."""
    sizes = {d: a.shape[i] for b, a in zip(kernel.inputs, inputs)
             for i, d in enumerate(b.shape) if isinstance(d, str) and d not in kernel.sizes}
    sizes |= {name: size_exprs.evaluate(tree, sizes) for name, tree in kernel.sizes.items()}
    return [tuple(sizes.get(d, d) for d in b.shape) for b in kernel.outputs]


def one_op_kernel(name: str, dtype: str, attrs: dict | None = None) -> kir.Kernel:
    """Row ``name`` applied to 1-D inputs of symbolic length "n"."""
    row = OPS[name]
    attrs = attrs or {}
    ins = [kir.Buffer(f"in{i}", ("n",), dtype) for i in range(row.arity)]
    out = kir.Buffer("out0", ("n",), row.result_dtype(dtype, attrs))
    node = kir.Op(name, tuple(kir.Load(b) for b in ins), dtype, out.dtype, tuple(sorted(attrs.items())))
    return kir.Kernel(f"test_{name}_{dtype}", ins, [out], [kir.Elementwise(("n",), ((out, node),))])


# ---- inputs ----------------------------------------------------------------------------

def sample(name: str, dt: str, k: int, shape, rng, to: str | None = None) -> np.ndarray:
    """Inputs for operand ``k`` of row ``name`` (``dt``: the row's operand dtype), inside
    the op's sensible domain: positive for log/sqrt/rsqrt, (-1, 1) for asin/acos/atanh,
    above 1 for acosh, nonzero denominators, positive
    bases for power, halves for floor/ceil, few distinct values for comparisons."""
    row = OPS[name]
    if dt == "bool" or (name == "where" and k == 0):
        return rng.random(shape) < 0.5
    if name in ("shl", "shr") and k == 1:  # shifts by less than the width
        return rng.integers(0, np.dtype(dt).itemsize * 8, shape).astype(dt)
    if name in ("floor_divide", "floor_mod", "mod", "divide") and k == 1 and not dt.startswith("float"):
        signs = rng.choice([-1, 1], shape) if dt.startswith("int") else 1  # never 0 or -1
        return (rng.integers(2, 50, shape) * signs).astype(dt)
    if dt.startswith("int"):
        return rng.integers(-3, 4, shape).astype(dt) if row.out == "bool" else \
            rng.integers(-1000, 1000, shape).astype(dt)
    if dt.startswith("uint"):
        return rng.integers(0, 4, shape).astype(dt) if row.out == "bool" else \
            rng.integers(0, 1000, shape).astype(dt)
    if row.out == "bool":
        x = rng.integers(-3, 4, shape) * 0.5  # so that equal elements happen
    elif name in ("log", "sqrt", "rsqrt"):
        x = 10.0 ** rng.uniform(-3, 3, shape)
    elif name in ("asin", "acos", "atanh"):
        x = rng.uniform(-0.999, 0.999, shape)
    elif name == "acosh":
        x = 1 + 10.0 ** rng.uniform(-3, 3, shape)
    elif name in ("divide", "mod") and k == 1:
        x = rng.choice([-1, 1], shape) * 10.0 ** rng.uniform(-2, 2, shape)
    elif name == "power":
        x = rng.uniform(0.1, 4, shape) if k == 0 else rng.uniform(-3, 3, shape)
    elif name in ("floor", "ceil"):
        x = rng.integers(-20, 20, shape) * 0.25
    elif name == "astype":  # inside every integer dtype's range (outside: undefined in C and LLVM)
        x = rng.uniform(-100, 127, shape) if to is None or not to.startswith("uint") else rng.uniform(0, 255, shape)
    else:
        x = rng.standard_normal(shape) * 3
    return np.asarray(x).astype(dt)


def operand_dtype(name: str, dt: str, k: int) -> str:
    """The dtype of operand ``k`` of row ``name`` applied to ``dt`` (where's condition is bool)."""
    return "bool" if name == "where" and k == 0 else dt


# ---- comparing -------------------------------------------------------------------------

def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str = ""):
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    bad = got.view(np.uint8).reshape(got.shape + (-1,)) != want.view(np.uint8).reshape(want.shape + (-1,))
    bad = bad.any(axis=-1) if got.ndim or bad.ndim > 1 else bad.any()
    if np.any(bad):
        idx = np.argwhere(np.atleast_1d(bad))[:5]
        g, w = np.atleast_1d(got), np.atleast_1d(want)
        pytest.fail(f"{what}: {int(np.sum(bad))} elements differ bit-wise; first at "
                    f"{idx.tolist()}: got {g[tuple(idx.T)]} want {w[tuple(idx.T)]}")


def ulp_error(got, exact, dtype: str) -> np.ndarray:
    """|got - exact| in ulps of ``dtype`` at ``exact``; 0 where both are the same NaN or
    infinity, inf where only one is. ``exact`` is a float64 array, or a pair (hi, lo) of
    float64 arrays whose sum is the exact value (for float64 results)."""
    hi, lo = exact if isinstance(exact, tuple) else (exact, 0.0)
    hi = np.atleast_1d(np.asarray(hi, np.float64))
    got = np.atleast_1d(np.asarray(got, np.float64))
    fi = np.finfo(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        spacing = np.spacing(np.maximum(np.abs(hi), fi.tiny).astype(dtype)).astype(np.float64)
        err = np.abs((got - hi) - lo) / spacing  # got - hi is exact when they are close
    with np.errstate(over="ignore"):
        rounded = hi.astype(dtype).astype(np.float64)  # exact values past the range are inf
    special = ~np.isfinite(got) | ~np.isfinite(rounded)
    same = (np.isnan(got) & np.isnan(rounded)) | (got == rounded)
    err[special] = np.where(same[special], 0, np.inf)
    return err


SQRT_2_PI = math.sqrt(2 / math.pi)


def documented_ulp(name: str, *xs) -> np.ndarray:
    """The bound vecmath's docstring states for row ``name`` at these inputs: the row's
    ``ulp``, except for the two bounds that grow with the input."""
    xs = np.broadcast_arrays(*[np.asarray(x, np.float64) for x in xs])
    if name == "power":
        x, y = xs
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.nan_to_num(2 * (1 + np.abs(y * np.log(np.abs(x)))), nan=np.inf)
    if name == "gelu_tanh":
        x = xs[0]
        return np.maximum(OPS[name].ulp, 3 * np.abs(2 * SQRT_2_PI * (x + 0.044715 * x ** 3)))
    return np.full(xs[0].shape, float(OPS[name].ulp))


def assert_within_ulp(got, exact, dtype: str, ulp: float, x=None, near_zero: bool = False,
                      what: str = ""):
    """``got`` is within ``ulp`` ulps of ``exact`` (see :func:`ulp_error`), with the two
    allowances vecmath's docstring states: with ``near_zero``, an absolute error of ``ulp``
    ulps of 1 is also fine; results below tiny*max(1, |x|) may be flushed (absolute error
    below that)."""
    fi = np.finfo(dtype)
    hi = np.atleast_1d(np.asarray(exact[0] if isinstance(exact, tuple) else exact, np.float64))
    got = np.atleast_1d(got)
    err = ulp_error(got, exact, dtype)
    ulp = np.broadcast_to(np.asarray(ulp, np.float64), err.shape)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.asarray(got, np.float64) - hi)
        ok = err <= ulp
        if near_zero:
            ok |= diff <= ulp * float(fi.eps)
        if x is not None:
            floor = float(fi.tiny) * np.maximum(1, np.abs(np.asarray(x, np.float64)))
            ok |= (np.abs(hi) < floor) & (diff <= floor)
    if not np.all(ok):
        i = int(np.argmax(np.where(ok, -1.0, np.nan_to_num(err, nan=np.inf))))
        at = f" at x={np.ravel(x)[i]!r}" if x is not None else ""
        pytest.fail(f"{what}: {int(np.sum(~ok))} of {ok.size} results exceed their ulp bound; "
                    f"worst {float(np.ravel(err)[i]):.4g} ulp (bound {float(np.ravel(ulp)[i]):g})"
                    f"{at}: got {np.ravel(got)[i]!r}, exact {np.ravel(hi)[i]!r}")
