"""``jitbyoc.lower_precision(mod, "bf16", activations="bf16")``: a value that a product
reads rounded is stored once, rounded, and the rest of the model reads it widened (a
residual stream, ResNet's ``relu(conv + x)``). Against TVM's build of the same lowered
module, and against a float64 model of the same roundings."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tvm import relax

import jitbyoc
from tests.conftest import build_both, build_model

R = relax.op
BF16 = ml_dtypes.bfloat16
STEP = 2.0 ** -8  # bfloat16's unit roundoff


def _residual_model(rng, c=32, hw=13, output_a=False):
    """``a = relu(conv(x, w1) + b)``, ``y = relu(conv(a, w2) + a)``: ``a`` feeds a
    product and a sum."""
    w1, w2 = ((rng.standard_normal((c, c, 3, 3)) / (3 * c ** 0.5)).astype(np.float32) for _ in range(2))
    b = rng.standard_normal((1, c, 1, 1)).astype(np.float32)

    def body(bb, x):
        a = bb.emit(R.nn.relu(R.add(R.nn.conv2d(x, relax.const(w1), padding=1), relax.const(b))))
        y = bb.emit(R.nn.relu(R.add(R.nn.conv2d(a, relax.const(w2), padding=1), a)))
        return [y, a] if output_a else y
    return build_model({"x": ((1, c, hw, hw), "float32")}, body), (w1, w2, b)


def _conv(x, w):
    """float64 3x3 convolution, padding 1, NCHW/OIHW."""
    n, c, h, wd = x.shape
    p = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", p[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out


def _rounded(v):
    return np.asarray(v, np.float32).astype(BF16).astype(np.float64)


def test_a_residual_stream_is_stored_once_in_bfloat16():
    rng = np.random.default_rng(3)
    mod, (w1, w2, b) = _residual_model(rng)
    low = jitbyoc.lower_precision(mod, "bf16", activations="bf16")
    script = low.script()
    assert script.count('dtype="float32")') >= 1 and 'R.astype(lv' in script
    builds = build_both(low)
    assert not builds.report.fallbacks, builds.report
    # a's region writes a only in bfloat16: no float32 output of a's shape
    first = next(r for r in jitbyoc.inspect(low) if any(
        o.dtype == "bfloat16" for o in r.kernel.outputs))
    assert [o.dtype for o in first.kernel.outputs] == ["bfloat16"], first.kernel.outputs
    x = rng.standard_normal((1, 32, 13, 13)).astype(np.float32)
    ref, got = builds.run(x)
    # float64 model of the roundings: bf16 operands, a stored in bf16 and read widened
    a = np.maximum(_conv(_rounded(x), _rounded(w1)) + b, 0)
    ab = _rounded(a)
    want = np.maximum(_conv(ab, _rounded(w2)) + ab, 0)
    # float32 sums in another order, and a's rounding may land one bf16 step off
    scale = _conv(np.abs(ab), np.abs(_rounded(w2))) + np.abs(ab)
    for y in (got, ref):
        assert np.all(np.abs(y - want) <= 2 * STEP * scale + 1e-5)
    assert np.abs(got - want).max() < np.abs(
        jitbyoc_float32_activations(mod, x) - want).max() + 2 * STEP * scale.max()


def jitbyoc_float32_activations(mod, x):
    """The default mode's output: a read by the sum as float32."""
    return build_both(jitbyoc.lower_precision(mod, "bf16"), tvm_builds=False).run(x)[1]


def test_the_rounded_value_differs_from_float32_activations_by_its_rounding():
    """The two modes differ, by at most a bf16 step of ``a`` carried through the sum."""
    rng = np.random.default_rng(5)
    mod, _ = _residual_model(rng, c=16, hw=9)
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    narrow = build_both(jitbyoc.lower_precision(mod, "bf16", activations="bf16"), tvm_builds=False).run(x)[1]
    wide = jitbyoc_float32_activations(mod, x)
    assert not np.array_equal(narrow, wide)
    assert np.abs(narrow - wide).max() <= 4 * STEP * np.abs(wide).max()


def test_model_outputs_stay_float32_and_bad_settings_are_refused():
    """A value the model returns is not rounded (only what stays inside is stored
    narrow); an unknown setting is refused by name."""
    rng = np.random.default_rng(7)
    mod, _ = _residual_model(rng, c=16, hw=6, output_a=True)
    low = jitbyoc.lower_precision(mod, "bf16", activations="bf16")
    assert low["main"].ret_ty.fields[1].dtype == "float32"
    x = rng.standard_normal((1, 16, 6, 6)).astype(np.float32)
    ref, got = build_both(low).run(x)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'fp16'"):
        jitbyoc.lower_precision(mod, "bf16", activations="fp16")


def test_a_model_returning_its_product_rounded_builds():
    """A model whose output var is bound to ``astype(conv(x), "bfloat16")``: the conv's
    output is rounded once, and the output var stays the function's (bound to the one
    rounding, not replaced by it: a dataflow var returned from its block failed the
    build, 'Var lv2 is not defined')."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 6, 6), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.nn.conv2d(bb.emit(R.astype(x, "float32")), relax.const(w), padding=1))
            out = bb.emit_output(R.astype(y, "bfloat16"))
        bb.emit_func_output(out)
    low = jitbyoc.lower_precision(bb.get(), "bf16", activations="bf16")
    x = rng.standard_normal((1, 8, 6, 6)).astype(BF16)
    ref, got = build_both(low).run(x)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
