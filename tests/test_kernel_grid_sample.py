"""grid_sample against TVM's default build and the kernel's numpy reference: every
method, padding mode and align_corners value TVM's op takes, 2-D and 3-D, awkward sizes
(1, 3, 7, 17), grid points inside, outside and several periods beyond the input (so
reflection folds more than once); the C rendering against the LLVM one; a fused epilogue.

The kernel is TVM's formula operation for operation in the data's dtype; results agree
with TVM's build to a few ulps (LLVM may fold TVM's ``x / 2`` and constant subtractions
differently, never by more than a rounding per step).
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.grid_sample import GridSample
from tests.diff_util import both, build, check_c_matches_llvm, model, run

R = relax.op
MODES_2D = list(itertools.product(("nearest", "bilinear", "bicubic"), ("zeros", "border", "reflection"),
                                  (False, True)))
MODES_3D = list(itertools.product(("nearest", "bilinear"), ("zeros", "border", "reflection"), (False, True)))


def case(x_shape, out_spatial, mode, dtype="float32"):
    k = len(x_shape) - 2
    return ([(x_shape, dtype), ((x_shape[0], k) + tuple(out_spatial), dtype)], mode)


def make(bb, vs, mode):
    method, padding, align = mode
    layout = "NCHW" if vs[0].ty.ndim == 4 else "NCDHW"
    return bb.emit(R.image.grid_sample(vs[0], vs[1], method=method, layout=layout, padding_mode=padding,
                                       align_corners=align))


def arrays_for(cases, seed, spread=1.3):
    """Data uniform in [-1, 1); grid points in [-spread, spread)."""
    rng = np.random.default_rng(seed)
    out = []
    for shapes, _ in cases:
        (xs, dt), (gs, _) = shapes
        out += [rng.uniform(-1, 1, xs).astype(dt), rng.uniform(-spread, spread, gs).astype(dt)]
    return out


def check(cases, *input_sets, tol=2e-5):
    """One model of ``cases`` (one TVM build: TVM's takes most of the time), run on each
    set of inputs."""
    mod = model(cases, make)
    rep = jitbyoc.report(mod)
    assert rep.offloaded_ops == len(cases) and not rep.fallbacks, str(rep)
    ours, theirs = build(mod, True), build(mod, False)
    for arrays in input_sets:
        for j, ((_, mode), g, w) in enumerate(zip(cases, run(ours, arrays), run(theirs, arrays))):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"case {j}: {mode} vs TVM")
            ref = GridSample.reference(arrays[2 * j], arrays[2 * j + 1], *mode)
            np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4, err_msg=f"case {j}: {mode} vs numpy")


def test_every_2d_mode():
    """Grid points within 1.3 (just outside the input) and within 4.5 (several periods)."""
    shapes = [((1, 3, 7, 17), (3, 7)), ((2, 1, 1, 3), (17, 1)), ((1, 2, 17, 7), (1, 3))]
    cases = [case(xs, os, mode) for mode in MODES_2D for xs, os in shapes
             if not (mode[1] == "reflection" and mode[2] and 1 in xs[2:])]
    check(cases, arrays_for(cases, seed=13, spread=1.3), arrays_for(cases, seed=45, spread=4.5))


def test_every_3d_mode():
    shapes = [((1, 2, 3, 7, 5), (2, 3, 7)), ((2, 1, 7, 3, 17), (1, 3, 1))]
    cases = [case(xs, os, mode) for mode in MODES_3D for xs, os in shapes]
    check(cases, arrays_for(cases, seed=3, spread=2.5))


def test_float64():
    cases = [case((1, 3, 7, 5), (3, 17), mode, "float64") for mode in MODES_2D[::2]]
    check(cases, arrays_for(cases, seed=4), tol=1e-12)


@settings(max_examples=6, deadline=None)
@given(h=st.integers(2, 9), w=st.integers(2, 9), oh=st.integers(1, 5), ow=st.integers(1, 5),
       mode=st.sampled_from(MODES_2D), seed=st.integers(0, 2**16))
def test_random_shapes(h, w, oh, ow, mode, seed):
    cases = [case((2, 3, h, w), (oh, ow), mode)]
    check(cases, arrays_for(cases, seed=seed, spread=2.0))


def test_reflection_with_aligned_corners_on_a_unit_dim_is_left_to_tvm():
    mod = model([case((1, 1, 1, 5), (2, 2), ("bilinear", "reflection", True))], make)
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert "static spatial dims > 1" in fallback.reason


@pytest.mark.parametrize("mode", [("bicubic", "reflection", False), ("bilinear", "zeros", True),
                                  ("nearest", "border", False)])
def test_c_rendering_and_epilogue(mode, tmp_path):
    """One region (grid_sample with a fused relu): the C rendering matches the JIT bit
    for bit, and the fused result matches TVM's."""
    cases = [case((2, 3, 7, 5), (3, 4), mode)]
    mod = model(cases, lambda bb, vs, m: bb.emit(R.nn.relu(make(bb, vs, m))))
    arrays = arrays_for(cases, seed=7, spread=2.0)
    check_c_matches_llvm(mod, arrays, tmp_path)
    got, want = both(mod, arrays)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
