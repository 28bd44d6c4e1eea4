"""roi_align (NCHW) against TVM's default build (exactly: the same operations in the same
order) and the float64 numpy reference; every mode, aligned, sample ratios (fixed and
adaptive), regions inside, across and outside the image, tiny and empty ones; the C
rendering against the LLVM one; a fused epilogue; NHWC left to TVM."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.roi_align import RoiAlign
from tests.conftest import build_both, build_model
from tests.diff_util import check_c_matches_llvm

R = relax.op
ROIS = np.array([[0, 0.5, 1.0, 6.0, 5.5], [1, -2, -1, 3, 3], [1, 2.2, 3.1, 2.4, 3.3],
                 [0, 7.0, 5.0, 12, 9], [1, -9, -9, -5, -5]], "float32")
EMPTY = np.array([[0, 3, 3, 3, 3]], "float32")  # with aligned and an adaptive grid: no sample


def roi_model(x_shape, n_rois, pooled, scale, ratio, aligned, mode, after=None):
    def body(bb, x, rois):
        y = R.vision.roi_align(x, rois, pooled, scale, ratio, aligned, "NCHW", mode)
        return bb.emit(after(y) if after else y)
    return build_model({"x": (x_shape, "float32"), "rois": ((n_rois, 5), "float32")}, body)


def check(x, rois, pooled, scale, ratio, aligned, mode):
    if not aligned or ratio > 0:
        rois = np.concatenate([rois, EMPTY])  # at least a 1-pixel region, or a fixed grid
    builds = build_both(roi_model(x.shape, len(rois), pooled, scale, ratio, aligned, mode))
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(x, rois)
    np.testing.assert_array_equal(got, want)
    ref = RoiAlign.reference(x, rois, pooled, scale, ratio, aligned, mode)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("ratio, scale, pooled", [(-1, 1.0, (2, 3)), (0, 0.5, (1, 1)), (2, 1.0, (3, 1)),
                                                  (3, 0.25, (7, 7))])
def test_modes_ratios_and_regions(mode, aligned, ratio, scale, pooled):
    x = np.random.default_rng(ratio + 7).standard_normal((2, 3, 7, 17)).astype("float32")
    check(x, ROIS, pooled, scale, ratio, aligned, mode)


@settings(max_examples=8, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), n_rois=st.integers(1, 4), pooled=st.sampled_from([(1, 1), (2, 3)]),
       ratio=st.sampled_from([-1, 1, 2]), aligned=st.booleans(), mode=st.sampled_from(["avg", "max"]),
       seed=st.integers(0, 2**16))
def test_random_regions(h, w, n_rois, pooled, ratio, aligned, mode, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, h, w)).astype("float32")
    corners = np.sort(rng.uniform(-2, max(h, w) + 2, (n_rois, 2, 2)), axis=1).reshape(n_rois, 4)
    rois = np.concatenate([rng.integers(0, 2, (n_rois, 1)), corners], axis=1).astype("float32")
    check(x, rois, pooled, 1.0, ratio, aligned, mode)


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_a_bin_without_samples(mode):
    """An aligned empty region with an adaptive grid has no sample: TVM's reduction never
    runs, leaving its output unwritten (whatever the memory held); jitbyoc writes the
    fold's start, 0 (avg) or the lowest value (max), as the reference does."""
    x = np.ones((1, 2, 5, 5), "float32")
    _, got = build_both(roi_model(x.shape, 1, (2, 2), 1.0, -1, True, mode)).run(x, EMPTY)
    np.testing.assert_array_equal(got, RoiAlign.reference(x, EMPTY, (2, 2), 1.0, -1, True, mode))
    assert got.flat[0] == (0 if mode == "avg" else np.finfo("float32").min)


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_c_rendering_and_epilogue(mode, tmp_path):
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 17)).astype("float32")
    mod = roi_model(x.shape, len(ROIS), (2, 3), 1.0, -1, False, mode, after=R.nn.relu)
    check_c_matches_llvm(mod, [x, ROIS], tmp_path)
    want, got = build_both(mod).run(x, ROIS)
    np.testing.assert_array_equal(got, want)


def test_nhwc_stays_with_tvm():
    mod = build_model({"x": ((1, 7, 7, 3), "float32"), "rois": ((2, 5), "float32")}, lambda bb, x, r: bb.emit(
        R.vision.roi_align(x, r, (2, 2), 1.0, -1, False, "NHWC", "avg")))
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert "layout NHWC" in fallback.reason
