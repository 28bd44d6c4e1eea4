"""Slices of a permute's result and permutes of those, as one windowed permute each
(jitbyoc/kernels/fold_slices.py): a fused q, k, v projection's head split. They only move
elements, so results must be bit-exact against TVM's build and numpy, in both renderings."""

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.layout import Permute
from tests.diff_util import both, inputs, model, one_region, run_c

R = relax.op


def _heads(bb, x, s, h, d):
    """timm's ViT: ``qkv.reshape(1, S, 3, H, D).permute(2, 0, 3, 1, 4)``, ``q, k, v =
    qkv[0], qkv[1], qkv[2]``, and ``k.transpose(-2, -1)``."""
    qkv = bb.emit(R.permute_dims(R.reshape(x, (1, s, 3, h, d)), [2, 0, 3, 1, 4]))
    q, k, v = (bb.emit(R.squeeze(R.strided_slice(qkv, [0], [i], [i + 1]), [0])) for i in range(3))
    return [q, bb.emit(R.permute_dims(k, [0, 1, 3, 2])), v]


def _numpy_heads(x, s, h, d):
    qkv = x.reshape(1, s, 3, h, d).transpose(2, 0, 3, 1, 4)
    return [qkv[0], qkv[1].transpose(0, 1, 3, 2), qkv[2]]


CASES = [([((s, 3 * h * d), dt)], (s, h, d)) for s, h, d, dt in
         ((197, 12, 64, "float32"), (5, 3, 16, "float64"), (33, 2, 40, "int32"), (2, 4, 8, "float32"))]


def _stages(mod) -> list:
    return [s for region in jitbyoc.inspect(mod) for s in region.kernel.stages]


def test_a_fused_qkv_head_split_is_three_windowed_permutes():
    """Before, the permute, each slice (on one thread) and k's transpose each copied their
    elements: five copies of the product where three write the results."""
    mod = model(CASES, lambda bb, vs, shape: _heads(bb, vs[0], *shape))
    one_region(mod)
    kinds = [type(st).__name__ for st in _stages(mod)]
    assert kinds == ["Permute"] * 3 * len(CASES), kinds
    assert all(any(st.begin) for st in _stages(mod) if st.axes[0] != 2 or st.begin[2])
    arrays = inputs(CASES)
    got, ref = both(mod, arrays)
    want = [w for a, (_, shape) in zip(arrays, CASES) for w in _numpy_heads(a, *shape)]
    for g, r, w in zip(got, ref, want):
        np.testing.assert_array_equal(g, r)
        np.testing.assert_array_equal(g, w)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the C rendering")
def test_windowed_permutes_render_alike_in_c(tmp_path):
    """The C rendering of each case's region (its outputs in the region's own order)."""
    for k, (shapes, shape) in enumerate(CASES):
        mod = model([(shapes, shape)], lambda bb, vs, shape: _heads(bb, vs[0], *shape))
        x = inputs(CASES)[k]
        (region,) = jitbyoc.inspect(mod)
        got = run_c(region, {mod["main"].params[0].name: x}, tmp_path)
        want = _numpy_heads(x, *shape)
        assert len(got) == 3
        for g in got:  # q and v have one shape, not the same elements
            assert any(g.shape == w.shape and np.array_equal(g, w) for w in want)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.randoms(use_true_random=False), st.booleans())
def test_random_windows_of_permutes(shape, rnd, again):
    """A permute, a unit-step slice of any window of its result, and maybe a second
    permute: folded where the window spans the input's innermost dim, else left as it
    was; bit-exact either way."""
    axes = list(range(len(shape)))
    rnd.shuffle(axes)
    out = [shape[a] for a in axes]
    begin = [rnd.randrange(n) for n in out]
    end = [rnd.randrange(b, n) + 1 for b, n in zip(begin, out)]
    second = list(range(len(shape)))
    rnd.shuffle(second)

    def make(bb, vs, _):
        y = bb.emit(R.strided_slice(R.permute_dims(vs[0], axes), list(range(len(shape))), begin, end))
        return bb.emit(R.permute_dims(y, second)) if again else y

    cases = [([(tuple(shape), "float32")], None)]
    mod = model(cases, make)
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    want = np.transpose(arrays[0], axes)[tuple(slice(b, e) for b, e in zip(begin, end))]
    want = np.transpose(want, second) if again else want
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[0], want)
    for permute in [s for s in _stages(mod) if isinstance(s, Permute) and any(s.begin)]:
        window = Permute.reference(arrays[0], permute.axes, permute.begin, permute.out.shape)
        np.testing.assert_array_equal(window.reshape(got[0].shape), got[0])


PERMUTE_CASTS = [((3, 70, 64), (1, 0, 2)), ((2, 12, 64, 40), (0, 1, 3, 2)), ((5, 33, 17), (2, 1, 0))]


def _permute_then_cast(bb, vs, axes):
    return bb.emit(R.astype(R.permute_dims(vs[0], list(axes)), "bfloat16"))


def test_a_permute_then_a_cast_to_bfloat16_is_one_converting_copy():
    """The bf16 mode's heads merged after attention, and Q and K^T before it: a float32
    permute whose result only a cast to bfloat16 reads writes the cast's output itself,
    rounding as it copies, in its row copies (innermost dim kept) and its tile transposes:
    the bits of TVM's build and of ml_dtypes."""
    import ml_dtypes

    cases = [([(shape, "float32")], axes) for shape, axes in PERMUTE_CASTS]
    mod = model(cases, _permute_then_cast)
    one_region(mod)
    kinds = [type(st).__name__ for st in _stages(mod)]
    assert kinds == ["Permute"] * len(cases), kinds
    arrays = inputs(cases)
    got, ref = both(mod, arrays)
    for g, r, a, (_, axes) in zip(got, ref, arrays, cases):
        want = np.transpose(a, axes).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(g.view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(g.view(np.uint16), r.view(np.uint16))


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the C rendering")
def test_a_converting_permute_renders_alike_in_c(tmp_path):
    import ml_dtypes

    for k, (shape, axes) in enumerate(PERMUTE_CASTS):
        cases = [([(shape, "float32")], axes)]
        mod = model(cases, _permute_then_cast)
        (region,) = jitbyoc.inspect(mod)
        x = inputs(cases, seed=k)[0]
        (got,) = run_c(region, {mod["main"].params[0].name: x}, tmp_path)
        want = np.transpose(x, axes).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
