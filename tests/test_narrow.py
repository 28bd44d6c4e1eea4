"""Rows good enough for a bfloat16 result (:mod:`jitbyoc.ir.narrow`): a gelu whose every
use casts it to bfloat16 computes through ``gelu_bf16``; one also stored in float32, or
cast to float16, keeps gelu. A linear layer's gelu rounded to bfloat16 lands within one
bfloat16 step of the exact value (plus gelu_bf16's bound, a fraction of |x|: in gelu's
tail, x < -3, the result is small against x and may be off by more steps) and of TVM's
build of the same module."""

from __future__ import annotations

import math
import shutil

import ml_dtypes
import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir, vecmath
from jitbyoc.ir.narrow import narrowed
from tests.conftest import assert_bits_equal, build_both, build_model, call_region

R = relax.op
X = kir.Buffer("x", (4, 16), "float32")


def _gelu(arg):
    return kir.Op("gelu", (arg,), "float32", "float32")


def _cast(arg, to):
    return kir.Op("astype", (arg,), "float32", to, (("to", to),))


def _ops(roots) -> list[str]:
    return [n.op for n in kir.walk(roots) if isinstance(n, kir.Op)]


def test_a_gelu_only_cast_to_bfloat16_takes_the_cheaper_row():
    g = _gelu(kir.Load(X))
    assert _ops(narrowed([_cast(g, "bfloat16")])) == ["gelu_bf16", "astype"]
    assert _ops(narrowed([_cast(g, "bfloat16"), _cast(g, "bfloat16")])) == ["gelu_bf16", "astype", "astype"]


def test_a_gelu_read_otherwise_keeps_its_row():
    g = _gelu(kir.Load(X))
    assert "gelu_bf16" not in _ops(narrowed([g, _cast(g, "bfloat16")]))  # also stored as it is
    assert "gelu_bf16" not in _ops(narrowed([_cast(g, "float16")]))
    assert "gelu_bf16" not in _ops(narrowed([_cast(kir.Op("add", (g, g), "float32", "float32"), "bfloat16")]))


def test_linear_gelu_rounded_to_bfloat16_within_a_step():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((24, 64)).astype(np.float32)
    w = (rng.standard_normal((96, 64)) * 0.4).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)

    def body(bb, xv):
        y = bb.emit(R.add(R.matmul(xv, R.permute_dims(relax.const(w))), relax.const(b)))
        return bb.emit(R.astype(R.nn.gelu(y), "bfloat16"))
    mod = build_model({"x": ((24, 64), "float32")}, body)
    assert any("gelu_bf16" in str(r.kernel) for r in jitbyoc.inspect(mod))
    ref, got = (np.asarray(o, np.float64) for o in build_both(mod).run(x))
    y = x.astype(np.float64) @ w.T.astype(np.float64) + b
    exact = y / 2 * np.vectorize(math.erfc)(-y / math.sqrt(2))
    # one bfloat16 step (8 bits) of each value, and gelu_bf16's own bound (a fraction of
    # |y|: where gelu is tiny, y < -5, it gives 0)
    step = 2.0 ** -7 * np.abs(exact) + vecmath.GELU_BF16_BOUND * np.abs(y)
    want = exact.astype(ml_dtypes.bfloat16).astype(np.float64)
    bad = np.abs(got - want) > step
    assert not bad.any(), f"beyond a bfloat16 step of the exact gelu at y={y[bad]}: {got[bad]} vs {want[bad]}"
    assert np.all(np.abs(got - ref) <= 2.0 ** -7 * np.abs(ref) + step), "beyond one step of TVM's build"
    # where gelu is not small against |y| (y > -1), a step only where rounding was nearly a tie
    assert np.mean(got[y > -1] == want[y > -1]) > 0.97


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")
def test_gelu_bf16_renders_the_same_in_c(tmp_path):
    from tests.test_c_renderer import c_and_jit

    x = np.concatenate([np.linspace(-8, 8, 181), [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(np.float32)
    mod = build_model({"x": ((x.size,), "float32")},
                      lambda bb, xv: bb.emit(R.astype(R.nn.gelu(xv), "bfloat16")))
    region, = jitbyoc.inspect(mod)
    assert "gelu_bf16" in str(region.kernel)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    got, want = (call_region(fn, region.kernel, [x])[0] for fn in (c_fn, jit_fn))
    assert_bits_equal(got, want, "gelu_bf16: C vs JIT")
