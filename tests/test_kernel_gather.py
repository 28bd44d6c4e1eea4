"""gather_elements and one_hot, against TVM's default build and the numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax, tirx

from jitbyoc.kernels.gather import GatherElements, GatherND, OneHot
from tests.conftest import DTYPES, build_both, build_model


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,ishape,axis", [((4, 7), (3, 7), 0), ((4, 7), (4, 17), 1), ((2, 3, 5), (2, 3, 1), -1),
                                                ((5, 1, 3), (2, 1, 3), 0), ((6,), (9,), 0)])
def test_gather_elements_matches_tvm_and_numpy(xshape, ishape, axis, dtype):
    idx_dtype = "int32" if len(ishape) % 2 else "int64"
    mod = build_model({"x": (xshape, dtype), "i": (ishape, idx_dtype)},
                      lambda bb, x, i: bb.emit(relax.op.gather_elements(x, i, axis=axis)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(len(xshape) + ishape[-1])
    x = (rng.standard_normal(xshape) * 10).astype(dtype)
    i = rng.integers(0, xshape[axis], ishape).astype(idx_dtype)
    want, got = builds.run(x, i)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, GatherElements.reference(x, i, axis % len(xshape)))
    neg = i - xshape[axis]  # negative indices count from the end (TVM leaves them undefined)
    np.testing.assert_array_equal(builds.run(x, neg)[1], got)


@pytest.mark.parametrize("dtype,on,off", [("float32", 1.0, 0.0), ("int32", 5, -2), ("float64", -0.5, 2.0),
                                          ("uint8", 255, 3), ("bool", True, False)])
@pytest.mark.parametrize("shape,depth,axis", [((3, 4), 5, -1), ((3, 4), 6, 0), ((7,), 3, 1), ((2, 3, 2), 4, 1)])
def test_one_hot_matches_tvm_and_numpy(shape, depth, axis, dtype, on, off):
    """Indices in and out of ``[0, depth)``, negative ones included (they match nothing)."""
    mod = build_model({"i": (shape, "int64")}, lambda bb, i: bb.emit(relax.op.one_hot(
        i, tirx.const(on, dtype), tirx.const(off, dtype), depth, axis)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    i = np.random.default_rng(depth).integers(-2, depth + 2, shape)
    want, got = builds.run(i)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, OneHot.reference(i, on, off, depth, axis, dtype))


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("xshape,ishape,batch", [((2, 3, 4), (2, 2), 0), ((5, 4), (3, 1), 0), ((2, 3, 4), (2, 5, 1), 1),
                                                 ((3, 4, 5, 2), (3, 2, 2), 1), ((6,), (4, 1), 0)])
def test_gather_nd_matches_tvm_and_numpy(xshape, ishape, batch, dtype):
    mod = build_model({"x": (xshape, dtype), "i": (ishape, "int64")},
                      lambda bb, x, i: bb.emit(relax.op.gather_nd(x, i, batch_dims=batch)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(sum(xshape) + batch)
    x = (rng.standard_normal(xshape) * 5).astype(dtype)
    depth = ishape[-1]
    i = np.stack([rng.integers(0, xshape[batch + k], ishape[:-1]) for k in range(depth)], axis=-1)
    want, got = builds.run(x, i)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, GatherND.reference(x, i, batch))
