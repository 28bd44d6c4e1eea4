"""A concatenation moves its operands' rows as bytes (``llvm.memcpy`` in the JIT,
``memcpy`` in C), so a region that concatenates asks for no loop vectorizer: SqueezeNet's
ten concatenating regions compiled in 30 ms each with it, 18 without. Checked against
TVM's default build exactly (elements are only moved), and the C rendering against the
JIT bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.render.optimization import GLUE_VECTORS
from tests.conftest import assert_bits_equal, build_both, build_model, call_region
from tests.test_c_renderer import CC, c_and_jit


def _concat(shapes, axis, dtype, relu=True):
    params = {f"x{i}": (s, dtype) for i, s in enumerate(shapes)}

    def body(bb, *xs):
        out = bb.emit(relax.op.concat(list(xs), axis=axis))
        return bb.emit(relax.op.nn.relu(out)) if relu else out
    return build_model(params, body)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.lists(st.integers(1, 70), min_size=2, max_size=4), st.integers(1, 40),
       st.sampled_from(["float32", "int8", "float64"]), st.integers(1, 2), st.booleans())
def test_concatenations_match_tvm(batch, channels, side, dtype, axis, relu):
    """Channel (axis 1) and row (axis 2) concatenations of odd sizes, with an epilogue or
    none; batch 1 with at least 32K elements takes the blocked path (ranges of the axis
    on threads)."""
    shapes = [(batch, c, side, side) if axis == 1 else (batch, 3, c, side) for c in channels]
    mod = _concat(shapes, axis, dtype, relu)
    (region,) = jitbyoc.inspect(mod)
    assert "call void @\"llvm.memcpy" in region.llvm_ir
    rng = np.random.default_rng(sum(channels) * side)
    args = [(rng.standard_normal(s) * 50).astype(dtype) for s in shapes]
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(*args)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shapes", [[(2, 3, 5, 7), (2, 4, 5, 7)], [(1, 33, 40, 40), (1, 7, 40, 40)]])
def test_a_concatenating_region_asks_for_no_loop_vectorizer(shapes):
    """Rows by batch (2 x 2 memcpy) and ranges of channels on threads (64K elements)."""
    (region,) = jitbyoc.inspect(_concat(shapes, 1, "float32", relu=False))
    assert region.pipeline == GLUE_VECTORS
    (region,) = jitbyoc.inspect(_concat(shapes, 1, "float32"))  # the relu runs as vectors
    assert region.pipeline == GLUE_VECTORS


def test_bool_concatenations_are_byte_copies_too():
    """bool elements are stored as bytes: the same memcpy."""
    flags = build_model({"a": ((2, 5), "bool"), "b": ((2, 7), "bool")},
                        lambda bb, a, b: bb.emit(relax.op.concat([a, b], axis=1)))
    (region,) = jitbyoc.inspect(flags)
    assert region.pipeline == GLUE_VECTORS
    a, b = np.arange(10).reshape(2, 5) % 3 == 0, np.arange(14).reshape(2, 7) % 2 == 0
    want, got = build_both(flags).run(a, b)
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_the_c_rendering_copies_the_same_bytes(tmp_path):
    mod = _concat([(1, 33, 40, 40), (1, 7, 40, 40)], 1, "float32")  # blocked: 64K elements
    (region,) = jitbyoc.inspect(mod)
    assert "memcpy(&" in region.c_source
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(b.shape).astype("float32") for b in region.kernel.inputs]
    jit_out = call_region(jit_fn, region.kernel, arrays)
    for got, want in zip(call_region(c_fn, region.kernel, arrays), jit_out):
        assert_bits_equal(got, want, "concat, C vs JIT")
    np.testing.assert_array_equal(jit_out[0], np.maximum(np.concatenate(arrays, axis=1), 0))
