"""group_norm and instance_norm (a group_norm of one channel per group) against TVM's
default build and float64 numpy; the C rendering against the LLVM one; a fused epilogue;
the variants left to TVM.

Tolerance: jitbyoc computes TVM's one-pass statistics (``sum(x * x) / L - mean^2``) in
the data's dtype, its sums reassociated for vector lanes, so it differs from TVM's
sequential sums by ``L * eps`` relative in the statistics; for standardized data
``1e-4`` absolute covers it (float32), and the float64 reference agrees as closely.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.norm import GroupNorm
from tests.diff_util import both, check_c_matches_llvm, inputs, model

R = relax.op


def case(x_shape, groups, axis=1, dtype="float32"):
    c = x_shape[axis]
    return ([(x_shape, dtype), ((c,), dtype), ((c,), dtype)], (groups, axis))


def make(bb, vs, attrs):
    groups, axis = attrs
    nd = vs[0].ty.ndim
    return bb.emit(R.nn.group_norm(vs[0], vs[1], vs[2], num_groups=groups, channel_axis=axis,
                                   axes=list(range(axis + 1, nd)), epsilon=1e-5))


def make_instance(bb, vs, attrs):
    _, axis = attrs
    return bb.emit(R.nn.instance_norm(vs[0], vs[1], vs[2], channel_axis=axis,
                                      axes=list(range(axis + 1, vs[0].ty.ndim)), epsilon=1e-5))


def instance(x_shape, axis=1):
    """An instance_norm case: its groups for the reference are its channels."""
    return case(x_shape, x_shape[axis], axis)


def check(cases, seed=0, tol=1e-4, maker=make):
    mod = model(cases, maker)
    rep = jitbyoc.report(mod)
    assert rep.offloaded_ops == len(cases) and not rep.fallbacks, str(rep)
    arrays = inputs(cases, seed=seed)
    got, want = both(mod, arrays)
    for j, ((_, (groups, axis)), g, w) in enumerate(zip(cases, got, want)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"case {j} vs TVM")
        ref = GroupNorm.reference(*arrays[3 * j:3 * j + 3], groups=groups, axis=axis)
        np.testing.assert_allclose(g, ref, rtol=tol, atol=tol, err_msg=f"case {j} vs numpy")


def test_shapes_and_groups():
    check([case((2, 6, 7, 3), 3), case((1, 17, 3), 17), case((3, 4, 1, 1), 1), case((2, 7, 17), 7),
           case((5, 6), 2), case((2, 3, 4, 6), 2, axis=2), case((1, 3, 7, 5), 3)])


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 3), per=st.sampled_from([1, 3, 7]), groups=st.sampled_from([1, 2, 3]),
       hw=st.sampled_from([(1, 1), (3, 7), (17, 1)]), seed=st.integers(0, 2**16))
def test_random_shapes(n, per, groups, hw, seed):
    check([case((n, per * groups) + hw, groups)], seed=seed)


def test_c_rendering_and_epilogue(tmp_path):
    cases = [case((2, 6, 7, 3), 3)]
    mod = model(cases, lambda bb, vs, a: bb.emit(R.nn.relu(make(bb, vs, a))))
    arrays = inputs(cases, seed=5)
    check_c_matches_llvm(mod, arrays, tmp_path, rtol=1e-5, atol=1e-6)  # C sums in order, LLVM in lanes
    got, want = both(mod, arrays)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)


def test_center_and_scale_flags_are_ignored_as_tvm_does():
    """TVM's lowering applies gamma and beta whatever center/scale say; so does jitbyoc."""
    cases = [case((2, 6, 3, 5), 3)]
    mod = model(cases, lambda bb, vs, a: bb.emit(R.nn.group_norm(vs[0], vs[1], vs[2], num_groups=3, channel_axis=1,
                                                                  axes=[2, 3], center=False, scale=False)))
    assert jitbyoc.report(mod).fallbacks == []
    arrays = inputs(cases, seed=9)
    got, want = both(mod, arrays)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[0], GroupNorm.reference(*arrays, groups=3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attrs, dtype, why", [(dict(axes=[3]), "float32", "not every dim after"),
                                               ({}, "float64", "float32 only")])
def test_variants_left_to_tvm(attrs, dtype, why):
    def make_variant(bb, vs, _):
        kw = dict(num_groups=2, channel_axis=1, axes=[2, 3]) | attrs
        return bb.emit(R.nn.group_norm(vs[0], vs[1], vs[2], **kw))
    mod = model([case((1, 4, 3, 5), 2, dtype=dtype)], make_variant)
    (fallback,) = jitbyoc.report(mod).fallbacks
    assert why in fallback.reason


def test_instance_norm_runs_as_one_group_per_channel():
    """InstanceNormalization of ONNX models (style transfer, GANs) comes as instance_norm."""
    check([instance((2, 6, 7, 3)), instance((1, 17, 3)), instance((2, 3, 2, 3, 5)), instance((3, 4, 1, 1)),
           instance((2, 3, 4, 6), axis=2), instance((1, 5, 17, 9))], seed=3, maker=make_instance)


@pytest.mark.parametrize("axis, axes, dtype", [(3, [1, 2], "float32"), (1, [2, 3], "float16")])
def test_instance_norm_variants(axis, axes, dtype):
    """Channels last (each channel's values strided) stays with TVM, with the reason;
    float16 runs in float32, its result rounded (jitbyoc.tvm.widen)."""
    def make_variant(bb, vs, _):
        return bb.emit(R.nn.instance_norm(vs[0], vs[1], vs[2], channel_axis=axis, axes=axes))
    mod = model([case((1, 3, 5, 4), 4 if axis == 3 else 5, axis=axis, dtype=dtype)], make_variant)
    fallbacks = jitbyoc.report(mod).fallbacks
    if dtype == "float16":
        assert fallbacks == []
    else:
        (fallback,) = fallbacks
        assert "not every dim after" in fallback.reason and "instance_norm" in fallback.reason
    got, want = both(mod, inputs([case((1, 3, 5, 4), 1, axis=axis, dtype=dtype)], seed=2))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-3)  # TVM runs it either way
