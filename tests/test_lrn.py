"""ONNX's LRN as TVM's frontend imports it, ``x / (bias + alpha * mean(x*x)) ** beta``
with the mean an average pool over channels:

* a scalar constant that is a ``power``'s exponent stays inside its region, as a literal,
  and ``power`` with a literal exponent in :data:`jitbyoc.ir.vecmath.BY_ROOTS` is
  multiplies and square roots (Inception v1's LRN regions were mostly exp(y*log x));
* the quotient runs in the average's blocks (:func:`jitbyoc.lower._merged`: it reads the
  conv's result and its bias over ``(1, C, H, W)``, the pool writes a ``(1, 1, C, H*W)``
  view), not in a pass of its own."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.ir.vecmath import BY_ROOTS, BY_ROOTS_ULP
from jitbyoc.kernels.pool2d import Pool2d
from jitbyoc.lower import _merged
from tests.conftest import assert_within_ulp, build_model
from tests.diff_util import build, check_c_matches_llvm, run
from tests.spatial_util import CC

mpmath.mp.prec = 120
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, -2.5, 0.5, -0.5]


def _power_model(dt: str, n: int, y: float):
    return build_model({"x": ((n,), dt)}, lambda bb, x: bb.emit(
        relax.op.power(x, relax.const(y, dt))))


def _inputs(dt: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    x = np.concatenate([2.0 ** rng.uniform(-30, 30, n - 200), rng.uniform(0.5, 2, 200 - len(SPECIALS)),
                        SPECIALS])
    return x.astype(dt)


def _exact(x: np.ndarray, y: float, dt: str):
    """float64 pow for float32 results; mpmath at 120 bits, as (hi, lo), for float64."""
    if dt == "float32":
        with np.errstate(all="ignore"):
            return np.power(x.astype(np.float64), y)
    hi, lo = np.empty(x.shape), np.zeros(x.shape)
    for i, v in enumerate(x):
        with np.errstate(all="ignore"):
            hi[i] = np.power(v, y)
        if np.isfinite(v) and v > 0 and np.isfinite(hi[i]) and hi[i] != 0:
            exact = mpmath.power(mpmath.mpf(float(v)), mpmath.mpf(y))
            lo[i] = float(exact - mpmath.mpf(hi[i]))
    return hi, lo


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("y", sorted(BY_ROOTS))
def test_literal_exponent_by_roots_within_its_bound_and_c_pow_rules(dt, y, tmp_path):
    n = 4000
    mod = _power_model(dt, n, y)
    (region,) = jitbyoc.inspect(mod)
    assert [b.name for b in region.kernel.inputs] == ["in0"], "the exponent is a literal, not a parameter"
    roots = y != int(y)
    assert ("llvm.sqrt" in region.llvm_ir) == roots
    x = _inputs(dt, n)
    (got,) = run(build(mod, True), [x])
    with np.errstate(all="ignore"):
        c_pow = np.power(x, np.full_like(x, y))  # C's pow (a scalar exponent takes numpy's sqrt)
    special = ~np.isfinite(x) | (x <= 0) | (x == 1)
    np.testing.assert_array_equal(got[special], c_pow[special], err_msg=f"pow(special, {y})")
    np.testing.assert_array_equal(np.signbit(got[special]), np.signbit(c_pow[special]))
    finite = ~special
    exact = _exact(x[finite], y, dt)
    assert_within_ulp(got[finite], exact, dt, BY_ROOTS_ULP, x=x[finite], what=f"x ** {y} ({dt})")
    if CC is not None and y in (0.75, -0.5, 2.5):
        check_c_matches_llvm(mod, [x], tmp_path)


def _lrn(bb, x, beta: float = 0.75):
    sq = bb.emit(relax.op.expand_dims(relax.op.multiply(x, x), 1))
    avg = bb.emit(relax.op.squeeze(relax.op.nn.avg_pool3d(
        sq, pool_size=(5, 1, 1), padding=(2, 0, 0, 2, 0, 0), layout="NCDHW", count_include_pad=True), [1]))
    scaled = relax.op.add(relax.op.multiply(avg, relax.const(np.float32(1e-4))), relax.const(np.float32(2.0)))
    return bb.emit(relax.op.divide(x, relax.op.power(scaled, relax.const(np.float32(beta)))))


def test_lrn_tail_equals_tvm_within_its_bound():
    """ONNX LRN as TVM's frontend imports it (``power(bias + alpha * avg, 0.75)``), its
    constants inside the region: against TVM's build, within the root's bound plus the
    average's summation order."""
    shape = (1, 16, 9, 9)
    mod = build_model({"x": (shape, "float32")}, _lrn)
    rep = jitbyoc.report(mod)
    assert rep.fallbacks == [], str(rep)
    (region,) = jitbyoc.inspect(mod)
    # alpha and bias stay arguments (regions differing in them share code), 0.75 is a literal
    assert len(region.kernel.inputs) == 3 and "llvm.sqrt" in region.llvm_ir
    x = (np.random.default_rng(3).standard_normal(shape) * 10).astype("float32")
    (got,), (want,) = run(build(mod, True), [x]), run(build(mod, False), [x])
    np.testing.assert_allclose(got, want, rtol=8e-7, atol=0)


@pytest.mark.parametrize("beta", [0.75, 0.6])
def test_lrn_quotient_runs_in_the_average_pools_blocks(beta):
    """conv + bias + relu, then LRN: the quotient, which reads the activation (the conv's
    result plus its per-channel bias), is the pool's epilogue; nothing runs after the pool.
    Against TVM's build (the conv sums in another order)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((16, 8, 3, 3)) / 8).astype("float32")
    bias = rng.standard_normal((1, 16, 1, 1)).astype("float32")

    def body(bb, x, w, bias):
        conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        return _lrn(bb, bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(conv, bias)))), beta)

    mod = build_model({"x": ((1, 8, 10, 10), "float32"), "w": (w.shape, "float32"),
                       "bias": (bias.shape, "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    stages = region.kernel.stages
    (pool,) = [k for k, s in enumerate(stages) if isinstance(s, Pool2d)]
    assert stages[pool].epilogue is not None and pool == len(stages) - 1, stages
    x = rng.standard_normal((1, 8, 10, 10)).astype("float32")
    args = [x, w, bias]
    (got,), (want,) = run(build(mod, True), args), run(build(mod, False), args)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_merged_views_of_broadcast_operands():
    seen, lrn = (1, 16, 10, 10), (1, 1, 16, 100)
    assert _merged((1, 16, 1, 1), seen, lrn) == (1, 1, 16, 1)  # a per-channel bias
    assert _merged((16, 1, 1), seen, lrn) == (1, 1, 16, 1)  # right-aligned
    assert _merged(seen, seen, lrn) == lrn
    assert _merged((1, 1, 10, 1), seen, lrn) is None  # broadcast over half of a merged run
    assert _merged((1, 16, 1, 1), seen, (1, 160, 10)) is None  # channels merged with rows
    assert _merged((1, 1, 1, 1), seen, (1, 160, 10)) == (1, 1, 1)
