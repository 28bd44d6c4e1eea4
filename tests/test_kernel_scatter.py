"""scatter_elements against TVM's default build and the numpy reference: every reduction,
axes, repeated and negative indices."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import jitbyoc
from jitbyoc.kernels.scatter import ScatterElements, ScatterND
from tests.conftest import build_both, build_model

# bool only replaces; mean only on floats (see test_scatter_reasons)
KINDS = [(dt, r) for dt in ("float32", "float64", "int32", "int64", "int8", "uint8", "bool")
         for r in ("update", "add", "mul", "min", "max", "mean")
         if (dt != "bool" or r == "update") and (r != "mean" or dt.startswith("float"))]


@pytest.mark.parametrize("dtype,reduction", KINDS)
@pytest.mark.parametrize("dshape,ishape,axis", [((5, 7), (3, 7), 0), ((4, 6), (4, 9), 1), ((2, 5, 3), (2, 2, 3), -2)])
def test_scatter_elements_matches_tvm_and_numpy(dshape, ishape, axis, dtype, reduction):
    mod = build_model({"d": (dshape, dtype), "i": (ishape, "int64"), "u": (ishape, dtype)},
                      lambda bb, d, i, u: bb.emit(relax.op.scatter_elements(d, i, u, axis=axis, reduction=reduction)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(sum(dshape) + len(reduction))
    n = dshape[axis]
    d = rng.integers(1, 5, dshape).astype(dtype)  # int8 products of repeats wrap, in TVM as in numpy
    u = rng.integers(1, 5, ishape).astype(dtype)
    i = rng.integers(-n, n, ishape)  # repeats along the axis: the order of updates matters
    want, got = builds.run(d, i, u)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ScatterElements.reference(d, i, u, axis % len(dshape), reduction))


def test_scatter_reasons():
    mod = build_model({"d": ((4, 6), "int32"), "i": ((4, 6), "int64"), "u": ((4, 6), "int32")},
                      lambda bb, d, i, u: bb.emit(relax.op.scatter_elements(d, i, u, axis=1, reduction="mean")))
    (left,) = jitbyoc.report(mod).fallbacks
    assert "float" in left.reason


@pytest.mark.parametrize("reduction", ["update", "add", "mul", "min", "max"])
@pytest.mark.parametrize("dshape,ishape", [((4, 3, 4), (2, 1)), ((5, 6), (7, 2)), ((8,), (3, 1)), ((3, 4, 2), (2, 2, 2))])
def test_scatter_nd_matches_tvm_and_numpy(dshape, ishape, reduction):
    ushape = ishape[:-1] + dshape[ishape[-1]:]
    mod = build_model({"d": (dshape, "float32"), "i": (ishape, "int64"), "u": (ushape, "float32")},
                      lambda bb, d, i, u: bb.emit(relax.op.scatter_nd(d, i, u, reduction)))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    rng = np.random.default_rng(sum(dshape) + len(reduction))
    d, u = rng.integers(1, 5, dshape).astype("float32"), rng.integers(1, 5, ushape).astype("float32")
    depth = ishape[-1]
    i = np.stack([rng.integers(0, dshape[k], ishape[:-1]) for k in range(depth)], axis=-1)  # repeats happen
    want, got = builds.run(d, i, u)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ScatterND.reference(d, i, u, reduction))
