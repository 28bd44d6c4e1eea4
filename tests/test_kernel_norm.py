"""Normalizations (layer_norm, rms_norm, inference batch_norm) against TVM's default build
and float64 numpy.

Tolerance for layer_norm/rms_norm, per output element: the row statistics are sums of L
terms, within ``L * eps`` relative in any association order, which moves the normalized
value ``x_hat`` by about ``L * eps * |x_hat|``; the final scale and shift add a few
roundings. layer_norm's ``x - mean`` also carries the mean's rounding, up to
``L * eps * mean(|x|)`` absolute, into ``x_hat`` divided by the row's std: large when the
row's values are close to each other (two values 0.412 and 0.395: ``mean(|x|)/std = 49``;
TVM's build is off by the same amount, bit for bit). So
``|got - exact| <= (L + 8) * eps * (|x_hat * gamma| + |beta| + |gamma| * mean(|x|) / std) + eps``.
batch_norm is TVM's formula operation for operation: bit-identical to TVM.
"""

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.kernels.norm import RowNorm
from tests.diff_util import both, build, check_c_matches_llvm, inputs, model, one_region, run

R = relax.op


def norm_case(x_shape, axes, rms=False, dtype="float32"):
    nd = len(x_shape)
    block = sorted(a % nd for a in axes)
    pshape = tuple(x_shape[a] for a in block)
    params = [(pshape, dtype)] * (1 if rms else 2)
    return ([(x_shape, dtype)] + params, (axes, rms))


def make_norm(bb, vs, attrs):
    axes, rms = attrs
    if rms:
        return bb.emit(R.nn.rms_norm(vs[0], vs[1], axes=axes))
    return bb.emit(R.nn.layer_norm(vs[0], vs[1], vs[2], axes=axes))


def check_norm(got, arrays, axes, eps=1e-5):
    x, *params = arrays
    nd = x.ndim
    axes = sorted(a % nd for a in axes)
    shape = [x.shape[a] if a in axes else 1 for a in range(nd)]
    params = [p.astype(np.float64).reshape(shape) for p in params]
    want = RowNorm.reference(x, *params, axes=axes, epsilon=eps).astype(np.float64)
    length = int(np.prod([x.shape[a] for a in axes]))
    u = np.finfo(x.dtype).eps
    wide = x.astype(np.float64)
    if len(params) == 1:
        mag = np.abs(want)
    else:
        mean = wide.mean(axis=tuple(axes), keepdims=True)
        std = np.sqrt(((wide - mean) ** 2).mean(axis=tuple(axes), keepdims=True) + eps)
        x_hat = (wide - mean) / std
        cancel = np.abs(wide).mean(axis=tuple(axes), keepdims=True) / std  # the mean's rounding in x - mean
        mag = np.abs(x_hat * params[0]) + np.abs(params[1]) + np.abs(params[0]) * cancel
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= (length + 8) * u * mag + u).all(), f"max err {err.max()}"


GRID = [((1, 7), [-1]), ((3, 17), [1]), ((5, 127), [-1]), ((2, 3, 33), [1, 2]),
        ((2, 3, 33), [-2, -1]), ((128, 768), [-1]), ((4, 5, 17), [1]), ((3, 4, 5, 6), [1, 2])]


@pytest.mark.parametrize("rms", [False, True])
def test_layer_and_rms_norm_grid(rms):
    # TVM's own rms_norm fails to build for non-trailing axes: those are numpy-only below
    trailing = [(s, a) for s, a in GRID if sorted(x % len(s) for x in a)[-1] == len(s) - 1]
    cases = [norm_case(s, a, rms) for s, a in (trailing if rms else GRID)]
    mod = model(cases, make_norm)
    one_region(mod)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    pos = 0
    for g, r, (shapes, (axes, _)) in zip(got, ref, cases):
        check_norm(g, arrays[pos:pos + len(shapes)], axes)
        check_norm(r, arrays[pos:pos + len(shapes)], axes)  # TVM meets the same bound
        pos += len(shapes)


def test_rms_norm_inner_axes_and_float64_against_numpy():
    """Cases TVM's default build cannot compile (rms_norm over inner axes; layer_norm in
    float64): numpy is the reference."""
    cases = [norm_case((6, 5, 17), [1], rms=True), norm_case((4, 3, 9), [1, 2], rms=True),
             norm_case((6, 33), [-1], dtype="float64"), norm_case((6, 33), [-1], True, "float64")]
    mod = model(cases, make_norm)
    one_region(mod)
    arrays = inputs(cases)
    got = run(build(mod, True), arrays)
    pos = 0
    for g, (shapes, (axes, _)) in zip(got, cases):
        check_norm(g, arrays[pos:pos + len(shapes)], axes)
        pos += len(shapes)


def test_layer_norm_is_stable_far_from_zero():
    """Data with mean 1e4 and unit spread: a one-pass E[x^2] - E[x]^2 loses every digit
    here; the two-pass variance keeps the result within float32 resolution of 1e4."""
    cases = [norm_case((8, 768), [-1])]
    mod = model(cases, make_norm)
    x, g, b = inputs(cases)
    x = (x + np.float32(1e4)).astype("float32")
    (got,) = run(build(mod, True), [x, g, b])
    want = RowNorm.reference(x, g.astype(np.float64), b.astype(np.float64), axes=[1])
    # x itself is only known to 1e4 * eps = 1e-3, i.e. 1e-3 of one standard deviation
    np.testing.assert_allclose(got, want, atol=4e-3 * np.abs(g).max() + 1e-6)


def bn_case(shape, axis, dtype="float32"):
    c = shape[axis]
    return ([(shape, dtype)] + [((c,), dtype)] * 4, axis)


def make_bn(bb, vs, axis, **kw):
    x, *p = vs
    bn = bb.emit(R.nn.batch_norm(R.add(x, x), *p, axis=axis, training=False, **kw))
    return bb.emit(R.nn.relu(relax.TupleGetItem(bn, 0)))


def bn_inputs(cases, sizes=None):
    arrays = inputs(cases, sizes)
    return [np.abs(a) + 0.1 if k % 5 == 4 else a for k, a in enumerate(arrays)]  # var > 0


@pytest.mark.parametrize("flags", [{}, {"center": False}, {"scale": False}])
def test_batch_norm_inference_is_bit_identical_and_fused(flags):
    cases = [bn_case((2, 6, 5, 3), 1), bn_case((4, 17), -1), bn_case((3, 5, 7), 0),
             bn_case((2, 6, 5, 3), 1, "float64")]
    mod = model(cases, lambda bb, vs, a: make_bn(bb, vs, a, **flags))
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    assert all(isinstance(s, kir.Elementwise) for s in region.kernel.stages), "no kernel, no temp"
    arrays = bn_inputs(cases)
    got, ref = both(mod, arrays)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    x, gamma, beta, mean, var = (a.astype(np.float64) for a in arrays[:5])
    shape = (1, 6, 1, 1)
    y = (2 * x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + 1e-5)
    y = y * (gamma.reshape(shape) if flags.get("scale", True) else 1)
    y = y + (beta.reshape(shape) if flags.get("center", True) else 0)
    np.testing.assert_allclose(got[0], np.maximum(y, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 17])
def test_symbolic_batch(n):
    cases = [norm_case(("n", 64), [-1]), norm_case(("n", 3, 10), [-1], rms=True),
             bn_case(("n", 4, 3, 3), 1)]

    def make(bb, vs, attrs):
        return make_bn(bb, vs, attrs) if len(vs) == 5 else make_norm(bb, vs, attrs)

    mod = model(cases, make, sym=["n"])
    one_region(mod)
    arrays = bn_inputs(cases[2:], {"n": n})
    arrays = inputs(cases[:2], {"n": n}, seed=n) + arrays
    got, ref = both(mod, arrays)
    check_norm(got[0], arrays[:3], [-1])
    check_norm(got[1], arrays[3:5], [-1])
    np.testing.assert_array_equal(got[2], ref[2])


def test_fused_epilogues():
    """layer_norm -> gelu and rms_norm -> multiply run in the kernels' epilogues, for
    trailing axes (per row) and inner axes (once at the end)."""
    # distinct shapes: region outputs of one shape share one loop nest, which never fuses
    cases = [norm_case((16, 96), [-1]), norm_case((4, 12, 10), [1]),
             norm_case((16, 80), [-1], rms=True)]

    def make(bb, vs, attrs):
        y = make_norm(bb, vs, attrs)
        if attrs[1]:
            return bb.emit(R.multiply(y, relax.const(3.0, "float32")))
        return bb.emit(R.nn.gelu(y))

    mod = model(cases, make)
    one_region(mod)
    (region,) = jitbyoc.inspect(mod)
    stages = [s for s in region.kernel.stages if isinstance(s, RowNorm)]
    assert len(stages) == 3 and all(s.epilogue is not None for s in stages)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for g, r in zip(got, ref):  # gelu: vecmath erf vs TVM's erf, a few ulp
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6)


def test_transformer_and_resnet_chains_are_one_region():
    """BERT embedding: take + positional add + layer_norm + head split (reshape, permute).
    ResNet tail: batch_norm + relu + global average pool (mean) + flatten."""
    bert = ([((100, 32), "float32"), ((10,), "int64"), ((10, 32), "float32"),
             ((32,), "float32"), ((32,), "float32")], "bert")
    resnet = ([((2, 8, 7, 7), "float32")] + [((8,), "float32")] * 4, "resnet")

    def make(bb, vs, kind):
        if kind == "bert":
            w, ids, pos, g, b = vs
            e = bb.emit(R.add(R.take(w, ids, axis=0), pos))
            y = bb.emit(R.nn.layer_norm(e, g, b, axes=[-1]))
            return bb.emit(R.permute_dims(R.reshape(y, (10, 4, 8)), [1, 0, 2]))
        x, *p = vs
        bn = bb.emit(R.nn.batch_norm(x, *p, axis=1, training=False))
        r = bb.emit(R.nn.relu(relax.TupleGetItem(bn, 0)))
        return bb.emit(R.reshape(R.mean(r, axis=[2, 3], keepdims=True), (2, 8)))

    cases = [bert, resnet]
    mod = model(cases, make)
    info = one_region(mod)
    assert {"relax.take", "relax.nn.layer_norm", "relax.nn.batch_norm", "relax.mean",
            "relax.permute_dims"} <= set(info.ops)
    arrays = inputs(cases)
    arrays[1] = np.abs(arrays[1]) % 100
    arrays[-1] = np.abs(arrays[-1]) + 0.1
    got, ref = both(mod, arrays)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=2e-6)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.data())
def test_random_shapes_and_axis_blocks(shape, data):
    nd = len(shape)
    first = data.draw(st.integers(0, nd - 1))
    last = data.draw(st.integers(first, nd - 1))
    rms = data.draw(st.booleans())
    cases = [norm_case(tuple(shape), list(range(first, last + 1)), rms)]
    mod = model(cases, make_norm)
    arrays = inputs(cases)
    (got,) = run(build(mod, True), arrays)
    check_norm(got, arrays, list(range(first, last + 1)))


def test_unsupported_norms_stay_with_tvm_with_reasons():
    cases = [norm_case((4, 5, 6), [0, 2]), ([((4, 6), "float32"), ((6,), "float32"),
                                            ((6,), "float32")], "nocenter")]

    def make(bb, vs, attrs):
        if attrs == "nocenter":
            return bb.emit(R.nn.layer_norm(vs[0], vs[1], vs[2], axes=[-1], center=False))
        return make_norm(bb, vs, attrs)

    mod = model(cases, make)
    bn = model([bn_case((2, 3, 4), 1)], lambda bb, vs, a: bb.emit(relax.TupleGetItem(
        bb.emit(R.nn.batch_norm(*vs, axis=a, training=True)), 0)))
    reasons = [f.reason for m in (mod, bn) for f in jitbyoc.report(m).fallbacks]
    assert any("not one contiguous block" in r for r in reasons)
    assert any("center/scale=False" in r for r in reasons)
    assert any("training=True" in r for r in reasons)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the C rendering")
def test_c_rendering_matches_llvm(tmp_path):
    cases = [norm_case((64, 300), [-1]), norm_case((6, 40, 7), [1]),
             norm_case((64, 300), [-1], rms=True), bn_case((2, 6, 5, 3), 1)]

    def make(bb, vs, attrs):
        return make_bn(bb, vs, attrs) if len(vs) == 5 else make_norm(bb, vs, attrs)

    mod = model(cases, make)
    one_region(mod)
    # the row sums differ only by association order: about L * eps relative
    arrays = inputs(cases)
    arrays[-1] = np.abs(arrays[-1]) + 0.1  # batch_norm's moving variance
    check_c_matches_llvm(mod, arrays, tmp_path, rtol=300 * 1.2e-7, atol=300 * 1.2e-7)
