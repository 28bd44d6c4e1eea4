"""float16: the op-table rows, reductions and copies that take it (moves, compares, max/min,
remainders), against TVM's default build bit for bit and numpy, on random and special
values; the C rendering against the JIT bit for bit. Both LLVM (for jitbyoc and for TVM)
and numpy compute each half operation in float and round its result to half, so exact
agreement is expected (floor_mod's three roundings included)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.ir.ops import OPS
from tests.conftest import RELAX_ROWS, assert_bits_equal, build_both, build_model, call_region, relax_call, sample
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit
from tests import test_ops as op_tests  # its tests, run here on float16 (not collected twice)

R = relax.op
F16 = "float16"
HALF_ROWS = [name for name in RELAX_ROWS if F16 in OPS[name].dtypes]


def test_the_rows_that_take_half():
    assert set(HALF_ROWS) == {"abs", "astype", "equal", "floor_mod", "greater", "greater_equal", "isfinite", "isinf",
                              "isnan", "less", "less_equal", "maximum", "minimum", "mod", "negative", "not_equal"}


@pytest.mark.parametrize("name", HALF_ROWS)
def test_row_matches_tvm_and_numpy(name):
    for attrs in op_tests.attrs_of(name, F16):  # astype: from half to each dtype
        op_tests.test_op(name, F16, attrs)


@pytest.mark.parametrize("name", HALF_ROWS)
def test_row_on_special_values(name):
    """NaN, infinities, signed zeros: with the float32 rows' deviations from numpy."""
    op_tests.test_exact_ops_on_special_values(name, F16)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("name", HALF_ROWS)
def test_c_rendering_matches_jit_bit_for_bit(name, tmp_path):
    arity, attrs = OPS[name].arity, op_tests.attrs_of(name, F16)[0]
    mod = build_model({f"x{k}": ((5, 37) if k % 2 == 0 else (1, 37), F16) for k in range(arity)},
                      lambda bb, *xs: bb.emit(relax_call(name, xs, attrs)))
    (region,) = jitbyoc.inspect(mod)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    arrays = [sample(name, F16, k, b.shape, rng) for k, b in enumerate(region.kernel.inputs)]
    (got,), (want,) = call_region(c_fn, region.kernel, arrays), call_region(jit_fn, region.kernel, arrays)
    assert_bits_equal(got, want, f"{name}: C vs JIT")


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("shape, axis", [((7,), 0), ((3, 17), 1), ((3, 17), 0), ((1, 7, 3), (0, 2))])
def test_max_min_reductions(op, shape, axis):
    mod = build_model({"x": (shape, F16)}, lambda bb, x: bb.emit(getattr(R, op)(x, axis=axis)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 100).astype(F16)
    x.flat[0] = -np.inf if op == "min" else np.inf
    want, got = (np.atleast_1d(a) for a in builds.run(x))
    assert_bits_equal(got, want, f"{op} vs TVM")
    assert_bits_equal(got, np.atleast_1d(getattr(np, op)(x, axis=axis)), f"{op} vs numpy")


def test_stack_and_elementwise_max_of_stacked_halves():
    """ONNX Max of several float16 inputs: stack, then a max over the new axis."""
    shapes = {"a": ((3, 1, 7), F16), "b": ((3, 1, 7), F16), "c": ((3, 1, 7), F16)}
    mod = build_model(shapes, lambda bb, *xs: bb.emit(R.max(R.stack(list(xs), axis=0), axis=0)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((3, 1, 7)).astype(F16) for _ in shapes]
    want, got = builds.run(*xs)
    assert_bits_equal(got, want, "vs TVM")
    assert_bits_equal(got, np.maximum(np.maximum(xs[0], xs[1]), xs[2]), "vs numpy")


def test_half_arithmetic_runs_in_float32_rounded_per_op():
    """Arithmetic on halves runs in float32, each op's result rounded to half
    (:mod:`jitbyoc.tvm.widen`), as TVM's LLVM build computes it: bit for bit with TVM and
    with numpy, which computes half ops the same way (float32 holds more than twice half's
    precision, so rounding twice is rounding once for +, *, / and sqrt)."""
    def chain(bb, x, y):
        return bb.emit(R.sqrt(R.divide(R.multiply(R.add(x, y), x), y)))

    mod = build_model({"x": ((3, 64), F16), "y": ((1, 64), F16)}, chain)
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(16)
    x, y = rng.uniform(0.01, 100, (3, 64)).astype(F16), rng.uniform(0.01, 100, (1, 64)).astype(F16)
    want, got = builds.run(x, y)
    assert_bits_equal(got, want, "vs TVM")
    assert_bits_equal(got, np.sqrt((x + y) * x / y), "vs numpy")


@pytest.mark.parametrize("src", ["float32", "float64", "int32", "int64", "uint8", "bool"])
def test_astype_to_half(src, tmp_path):
    """Conversions to float16 (the result of astype may be any stored dtype): rounded to
    nearest even, overflow to infinity, as TVM's build and numpy; C as the JIT."""
    rng = np.random.default_rng(zlib.crc32(src.encode()))
    if src == "bool":
        x = rng.random(64) < 0.5
    elif src.startswith("float"):
        x = np.concatenate([rng.standard_normal(48) * 10.0 ** rng.integers(-8, 6, 48),
                            [65504, 65519.99, 65520, 1e-8, -0.0, np.inf, -np.inf, np.nan, 2.0 ** -25,
                             3 * 2.0 ** -26, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -12, 2049, 2051, 1e6, -7e4]]).astype(src)
    else:
        x = rng.integers(0 if src == "uint8" else -70000, 255 if src == "uint8" else 70000, 64).astype(src)
    mod = build_model({"x": (x.shape, src)}, lambda bb, v: bb.emit(R.astype(v, F16)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(x)
    assert_bits_equal(got, want, "vs TVM")
    with np.errstate(over="ignore"):
        assert_bits_equal(got, x.astype(F16), "vs numpy")
    if CC is not None:
        (region,) = jitbyoc.inspect(mod)
        c_fn, jit_fn = c_and_jit(region, tmp_path)
        assert_bits_equal(call_region(c_fn, region.kernel, [x])[0], got, "C vs JIT")
