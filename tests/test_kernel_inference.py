"""prelu and inference dropout, against TVM's default build and numpy."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from tests.conftest import build_both, build_model


def prelu_reference(x, alpha, axis):
    shape = [1] * x.ndim
    shape[axis] = alpha.size
    return np.where(x > 0, x, x * alpha.reshape(shape))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape,axis,slopes", [((2, 3, 5, 5), 1, 3), ((4, 7), -1, 7), ((4, 7), 1, 1),
                                               ((3, 17, 2), 0, 3), ((1, 9, 1, 1), 1, 9)])
def test_prelu_matches_tvm_and_numpy(shape, axis, slopes, dtype):
    mod = build_model({"x": (shape, dtype), "a": ((slopes,), dtype)},
                      lambda bb, x, a: bb.emit(relax.op.add(relax.op.nn.prelu(x, a, axis=axis), x)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(len(shape) * 10 + slopes)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[::5] = np.nan
    a = rng.standard_normal(slopes).astype(dtype)
    want, got = builds.run(x, a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, prelu_reference(x, a, axis % len(shape)) + x, rtol=1e-6)


def test_inference_dropout_is_the_identity_and_a_mask_of_ones():
    """Both results, as TVM gives them; the dropout costs no copy (it is a value)."""
    def body(bb, x):
        d = bb.emit(relax.op.nn.dropout(relax.op.multiply(x, x), rate=0.3))
        return [bb.emit(relax.op.add(relax.TupleGetItem(d, 0), x)), bb.emit(relax.TupleGetItem(d, 1))]
    mod = build_model({"x": ((3, 33), "float32")}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == [] and len(builds.report.regions) == 1, str(builds.report)
    x = np.random.default_rng(0).standard_normal((3, 33)).astype("float32")
    want, got = builds.run(x)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[1], np.ones_like(x))


@pytest.mark.parametrize("out_dtype", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_dequantize_match_tvm(out_dtype, per_channel):
    """ONNX QuantizeLinear/DequantizeLinear as TVM's frontend writes them: per tensor or
    per channel (axis 1), values that round both ways and saturate at both ends."""
    shape, c = (2, 3, 5), 3
    pshape = (c,) if per_channel else ()

    def body(bb, x, s, z):
        q = bb.emit(relax.op.quantize(x, s, z, axis=1, out_dtype=out_dtype))
        return [q, bb.emit(relax.op.dequantize(q, s, z, axis=1, out_dtype="float32"))]

    mod = build_model({"x": (shape, "float32"), "s": (pshape, "float32"), "z": (pshape, out_dtype)}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(len(out_dtype) + per_channel)
    x = (rng.standard_normal(shape) * 200).astype("float32")
    x.flat[::7] = np.float32(2.5)  # halves: round to even
    s = np.asarray(rng.uniform(0.5, 2.0, pshape), "float32")
    z = np.asarray(rng.integers(0, 5, pshape), out_dtype)
    want, got = builds.run(x, s, z)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("out_dtype", ["int8", "uint8"])
def test_a_dequantized_quantize_matches_tvm_at_every_extreme(out_dtype):
    """quantize then dequantize with one zero point: jitbyoc clamps the rounded value to
    bounds less the zero point (kernels.inference._recentred) instead of adding it and
    taking it off; the same values for ties, saturation at both ends, infinities and NaN."""
    def body(bb, x, s, z):
        q = bb.emit(relax.op.quantize(x, s, z, axis=-1, out_dtype=out_dtype))
        return bb.emit(relax.op.dequantize(q, s, z, axis=-1, out_dtype="float32"))

    mod = build_model({"x": ((4, 40), "float32"), "s": ((), "float32"), "z": ((), out_dtype)}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    x = np.concatenate([np.arange(-130, 130, 2.5), [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e30, -1e30, 0.0, -0.0,
                                                    2.0 ** 24 + 2, -(2.0 ** 24) - 2, 127.5, -128.5, 255.5]])
    x = np.resize(x.astype("float32"), (4, 40))
    z = np.asarray(-3 if out_dtype == "int8" else 9, out_dtype)
    want, got = builds.run(x, np.float32(0.5), z)
    np.testing.assert_array_equal(got, want)
