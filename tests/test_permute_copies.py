"""A transpose that keeps the innermost dim in place moves whole rows as bytes
(``llvm.memcpy`` in the JIT, ``memcpy`` in C): a region that asks for no loop vectorizer
had left them as element-by-element loops (BERT-layout attention, ``[1, 128, 12, 64]`` to
heads, 0.35 -> 0.25 ms; ShuffleNet's channel shuffle, the model 0.90-0.95x). Checked
against TVM's default build exactly (elements are only moved), and the C rendering
against the JIT bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from tests.conftest import assert_bits_equal, build_both, build_model, call_region
from tests.test_c_renderer import CC, c_and_jit

# permutations of 4 dims that keep the last one where it is, and move something
KEEP_LAST = [(0, 2, 1, 3), (1, 0, 2, 3), (2, 1, 0, 3), (1, 2, 0, 3), (2, 0, 1, 3)]


def _permute(shape, axes, dtype, relu):
    def body(bb, x):
        out = bb.emit(relax.op.permute_dims(x, list(axes)))
        return bb.emit(relax.op.nn.relu(out)) if relu else out
    return build_model({"x": (shape, dtype)}, body)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 9), min_size=3, max_size=3), st.integers(1, 70), st.sampled_from(KEEP_LAST),
       st.sampled_from(["float32", "int8", "float64", "bool"]), st.booleans())
def test_row_transposes_match_tvm(lead, inner, axes, dtype, relu):
    """Rows of odd lengths, unit dims among the moved ones, with an epilogue or none."""
    relu = relu and dtype != "bool"
    shape = (*lead, inner)
    mod = _permute(shape, axes, dtype, relu)
    (region,) = jitbyoc.inspect(mod)
    moved = [a for a in axes if shape[a] != 1]
    if moved != sorted(moved) and inner > 1:  # else a reshape, or (rows of one) a transpose
        assert "call void @\"llvm.memcpy" in region.llvm_ir
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape) * 50
    x = x > 0 if dtype == "bool" else x.astype(dtype)
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(x)
    np.testing.assert_array_equal(got, want)
    expect = np.transpose(x, axes)
    np.testing.assert_array_equal(got, np.maximum(expect, 0) if relu else expect)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_the_c_rendering_copies_the_same_bytes(tmp_path):
    mod = _permute((1, 128, 12, 64), (0, 2, 1, 3), "float32", relu=False)
    (region,) = jitbyoc.inspect(mod)
    assert "memcpy(&out0[" in region.c_source  # a row's copy (the helpers memcpy too)
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    x = np.random.default_rng(5).standard_normal((1, 128, 12, 64)).astype("float32")
    jit_out = call_region(jit_fn, region.kernel, [x])
    for got, want in zip(call_region(c_fn, region.kernel, [x]), jit_out):
        assert_bits_equal(got, want, "permute, C vs JIT")
    np.testing.assert_array_equal(jit_out[0], np.transpose(x, (0, 2, 1, 3)))


def test_a_permute_that_casts_runs_on_the_thread_pool():
    """Attention's heads cast to bfloat16 as they are permuted (the bf16 mode's Q, K and
    V, ``fold_slices.cast_while_permuting``): each element is also converted, so it takes
    the pool at an elementwise nest's size, not at a copy's (96K elements of BERT's layout
    had run on one thread while the other waited: BERT-base bf16's attention regions
    2.77 -> 2.27 ms)."""
    def body(bb, x):
        heads = bb.emit(relax.op.permute_dims(relax.op.reshape(x, (1, 128, 12, 64)), [0, 2, 1, 3]))
        return bb.emit(relax.op.astype(heads, "bfloat16"))
    mod = build_model({"x": ((1, 128, 768), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert stage.out.dtype == "bfloat16"  # the cast folded into the permute
    assert "TVMBackendParallelLaunch" in region.llvm_ir
    x = np.random.default_rng(6).standard_normal((1, 128, 768)).astype("float32")
    want, got = build_both(mod).run(x)
    np.testing.assert_array_equal(got.view("uint16"), want.view("uint16"))
