"""resize2d against TVM's default build and the kernel's numpy reference: NCHW and NHWC,
nearest (every rounding method) and linear, every coordinate transformation mode jitbyoc
takes, upscales, downscales and non-integer ratios with awkward sizes (1, 3, 5, 7, 13);
the integer path of an integer upscale; the variants left to TVM with their reason; the C
rendering against the LLVM one; a fused epilogue.

Nearest must pick the same pixels as TVM: equal outputs. Linear is TVM's formula
operation for operation in float32: a few ulps.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.resize import MODES, ROUNDINGS, Resize2d, _phases
from tests.diff_util import both, build, check_c_matches_llvm, model, run

R = relax.op
NEAREST = [("nearest_neighbor", mode, r) for mode, r in itertools.product(MODES, ROUNDINGS)]
LINEAR = [("linear", mode, "") for mode in MODES]
SIZES = [(5, 7, 10, 14), (8, 8, 4, 4), (6, 9, 13, 5), (3, 4, 9, 12), (7, 5, 7, 5), (1, 3, 2, 6), (4, 4, 12, 8),
         (3, 3, 6, 12)]


def case(layout, hw, out_hw, attrs, dtype="float32", batch=2, channels=3):
    shape = (batch, channels) + hw if layout == "NCHW" else (batch,) + hw + (channels,)
    return ([(shape, dtype)], (layout, out_hw) + attrs)


def make(bb, vs, attrs):
    layout, size, method, mode, rounding = attrs
    return bb.emit(R.image.resize2d(vs[0], size, layout=layout, method=method,
                                    coordinate_transformation_mode=mode, rounding_method=rounding))


def check(cases, seed=0):
    """One model of ``cases`` against TVM (one build each way) and the numpy reference."""
    mod = model(cases, make)
    rep = jitbyoc.report(mod)
    assert rep.offloaded_ops == len(cases) and not rep.fallbacks, str(rep)
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-1, 1, shapes[0][0]).astype("float32") for shapes, _ in cases]
    got, want = run(build(mod, True), arrays), run(build(mod, False), arrays)
    for x, g, w, (_, (layout, size, method, mode, rounding)) in zip(arrays, got, want, cases):
        what = f"{layout} {method} {mode} {rounding!r} {x.shape} -> {size}"
        ref = Resize2d.reference(x, size, layout, method, mode, rounding)
        if method == "nearest_neighbor":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} vs TVM")
            np.testing.assert_array_equal(ref, w, err_msg=f"{what}: numpy vs TVM")
        else:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"{what} vs TVM")
            np.testing.assert_allclose(ref, w, rtol=1e-6, atol=1e-6, err_msg=f"{what}: numpy vs TVM")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("method", ["nearest_neighbor", "linear"])
def test_every_mode_and_rounding(layout, method):
    variants = NEAREST if method == "nearest_neighbor" else LINEAR
    check([case(layout, (h, w), (oh, ow), v) for v in variants for h, w, oh, ow in SIZES
           if not (v[1] == "align_corners" and 1 in (oh, ow))])


def test_integer_upscale_takes_tvms_integer_path():
    """Nearest, asymmetric, floor, an integer ratio: TVM divides integers (o // 2, o // 3),
    not floats; the kernel does the same."""
    check([case("NCHW", (5, 4), (10, 12), ("nearest_neighbor", "asymmetric", r)) for r in ("", "floor")]
          + [case("NHWC", (3, 7), (9, 7), ("nearest_neighbor", "asymmetric", ""))])


def test_a_linear_power_of_two_upscale_runs_in_phases():
    """Output column i * k + j blends input columns i + d_j and i + d_j + 1 at t_j: the
    table of TVM's own float32 coordinates, taken by the NCHW rows (SIZES has k = 2 and 4)."""
    assert _phases("linear", "half_pixel", 3, 6) == [(-1, 0.75), (0, 0.25)]
    assert _phases("linear", "asymmetric", 5, 20) == [(0, 0.0), (0, 0.25), (0, 0.5), (0, 0.75)]
    assert _phases("linear", "pytorch_half_pixel", 7, 28) == [(-1, 0.625), (-1, 0.875), (0, 0.125), (0, 0.375)]
    for no in [("linear", "half_pixel", 4, 12), ("linear", "align_corners", 4, 8),
               ("nearest_neighbor", "half_pixel", 4, 8), ("linear", "half_pixel", 2, 4),
               ("linear", "half_pixel", 4, 4)]:
        assert _phases(*no) is None, no


@settings(max_examples=12, deadline=None)
@given(h=st.integers(1, 17), w=st.integers(1, 17), oh=st.integers(2, 40), ow=st.integers(2, 40),
       layout=st.sampled_from(["NCHW", "NHWC"]), variant=st.sampled_from(NEAREST + LINEAR),
       seed=st.integers(0, 2**16))
def test_random_shapes(h, w, oh, ow, layout, variant, seed):
    check([case(layout, (h, w), (oh, ow), variant, batch=1, channels=5)], seed=seed)


@pytest.mark.parametrize("attrs, dtype, why", [
    (("cubic", "half_pixel", ""), "float32", "method cubic"),
    (("linear", "tf_crop_and_resize", ""), "float32", "coordinate_transformation_mode tf_crop_and_resize"),
    (("nearest_neighbor", "align_corners", ""), "float32", "align_corners with an output of one row"),
])
def test_variants_left_to_tvm_say_why(attrs, dtype, why):
    out_hw = (1, 4) if attrs[1] == "align_corners" else (6, 8)
    mod = model([case("NCHW", (3, 4), out_hw, attrs, dtype=dtype)], make)
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert why in fallback.reason


def test_symbolic_spatial_sizes_are_left_to_tvm():
    mod = model([([((1, 3, "h", 4), "float32")], ("NCHW", (6, 8), "linear", "half_pixel", ""))], make, sym=("h",))
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert "symbolic or empty spatial sizes" in fallback.reason


@pytest.mark.parametrize("layout, attrs, out_hw", [
    ("NCHW", ("linear", "half_pixel", ""), (9, 7)),
    ("NHWC", ("nearest_neighbor", "asymmetric", "round_prefer_ceil"), (9, 7)),
    ("NCHW", ("nearest_neighbor", "asymmetric", "floor"), (10, 9)),  # rows of repeated pixels
    ("NCHW", ("linear", "half_pixel", ""), (10, 12)),  # a linear upscale by 4 in phases
])
def test_c_rendering_and_epilogue(layout, attrs, out_hw, tmp_path):
    """One region (resize2d with a fused relu): the C rendering matches the JIT bit for
    bit, and the fused result matches TVM's."""
    cases = [case(layout, (5, 3), out_hw, attrs)]
    mod = model(cases, lambda bb, vs, a: bb.emit(R.nn.relu(make(bb, vs, a))))
    rep = jitbyoc.report(mod)
    assert len(rep.regions) == 1 and rep.offloaded_ops == 2 and not rep.fallbacks, str(rep)
    x = np.random.default_rng(3).uniform(-1, 1, cases[0][0][0][0]).astype("float32")
    check_c_matches_llvm(mod, [x], tmp_path)
    got, want = both(mod, [x])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
