"""Attention in the bf16 mode (:func:`jitbyoc.lower_precision`): ``Q K^T`` and ``P V`` from
operands rounded to bfloat16, summed in float32, still one fused :class:`Attention` stage
(on AMX tiles where the machine has them), against numpy and TVM's build of the same
lowered module.

Bound: both products sum exact products of bfloat16 values in float32, and the softmax
runs in float32; what can differ between two correct builds is where the probabilities
``P`` (float32, summed in another order) round to bfloat16: one bfloat16 step, ``2**-8``
of ``P``, so ``|o - o'| <= 2**-8 * (P @ |V|)`` plus float32 rounding of the sums.
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.kernels.attention import Attention

from .conftest import build_both, run
from .test_kernel_attention import _attention, _inputs

BF16 = ml_dtypes.bfloat16


def _rounded(x: np.ndarray) -> np.ndarray:
    return x.astype(BF16).astype(np.float64)


def _reference(q, k, v, mask, heads, kv):
    """float64 attention of bfloat16-rounded Q, K, V with P rounded to bfloat16 before
    ``P V``; and ``P @ |V|`` (what the bound scales with)."""
    rep = heads // kv
    k, v = np.repeat(_rounded(k), rep, axis=1), np.repeat(_rounded(v), rep, axis=1)
    s = (_rounded(q) @ np.swapaxes(k, -1, -2)) * q.shape[-1] ** -0.5 + mask.astype(np.float64)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = _rounded(p / p.sum(axis=-1, keepdims=True))
    flat = (lambda o: o.transpose(0, 2, 1, 3).reshape(1, q.shape[2], -1))
    return flat(p @ v), flat(p @ np.abs(v))


def _within_bound(got, want, scale, what):
    excess = np.abs(got - want) - (2.0 ** -8 * scale + 2e-5)
    assert excess.max() <= 0, f"{what}: {excess.max()} past the bound"


def _bf16_attention(heads, kv, d, length="s"):
    mod = jitbyoc.lower_precision(_attention(heads, kv, d, length=length), "bf16")
    (region,) = jitbyoc.inspect(mod)
    (fused,) = [s for s in region.kernel.stages if isinstance(s, Attention)]
    assert {m.product.a for m in (fused.steps[0], fused.steps[-1])} == {"bfloat16"}
    return mod


@pytest.mark.parametrize("heads,kv,d,lengths", [(4, 4, 16, (1, 7, 64)), (8, 2, 64, (2, 17, 130)),
                                                 (3, 1, 20, (5, 33)), (12, 12, 64, (128, 197))])
def test_bf16_attention_fuses_and_stays_within_one_probability_step(heads, kv, d, lengths):
    for n in lengths:
        builds = build_both(_bf16_attention(heads, kv, d, length=n))
        assert not builds.report.fallbacks, str(builds.report)
        x = _inputs(n, heads, kv, d)
        got, want = run(builds.jit, *x), run(builds.tvm, *x)
        assert np.isfinite(got).all(), f"length {n}"
        ref, scale = _reference(*x, heads, kv)
        _within_bound(got, ref, scale, f"numpy, length {n}")
        _within_bound(got, want, scale, f"TVM, length {n}")


def test_a_decoders_attention_of_symbolic_length_stays_float32():
    """Its K and V are the whole cache: rounded for each token, a pass over the cache."""
    mod = jitbyoc.lower_precision(_attention(4, 2, 16, length="s"), "bf16")
    assert "bfloat16" not in mod.script()


def test_bf16_attention_stays_near_the_float32_model():
    """Against the float32 model: each operand rounded once (2**-9) moves an output by
    a few hundredths at most on unit-variance inputs; a misread pair (a unit's halves
    swapped, a row read a unit off) moves it by its whole size."""
    mod = _attention(8, 8, 64, length=130)
    bf16 = build_both(jitbyoc.lower_precision(mod, "bf16"), tvm_builds=False)
    f32 = build_both(mod, tvm_builds=False)
    x = _inputs(130, 8, 8, 64)
    got, exact = run(bf16.jit, *x), run(f32.jit, *x)
    assert np.abs(got - exact).max() < 0.05 and np.abs(got - exact).mean() < 5e-3


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the C export needs gcc")
def test_the_c_export_of_bf16_attention_sums_widened_pairs(tmp_path):
    heads, kv, d, n = 4, 2, 16, 23
    mod = _bf16_attention(heads, kv, d, length=n)
    builds = build_both(mod, tvm_builds=False)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="c")
    ex.export_library(str(tmp_path / "attention.so"), cc="gcc", options=["-O2", "-ffp-contract=off"])
    c_path = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "attention.so")), tvm.cpu())
    x = _inputs(n, heads, kv, d)
    got = run(c_path, *x)
    ref, scale = _reference(*x, heads, kv)
    _within_bound(got, ref, scale, "numpy")
    _within_bound(got, run(builds.jit, *x), scale, "JIT")
