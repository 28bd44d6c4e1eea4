"""argmax/argmin against TVM's default build and TVM's fold in numpy (ties, NaN, -inf)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from jitbyoc.kernels.argreduce import ArgReduce
from tests.conftest import DTYPES, build_both, build_model


def awkward(shape, dtype, rng):
    """Ties everywhere; NaN and infinities among floats."""
    x = rng.integers(-3, 4, shape).astype(dtype)
    if np.dtype(dtype).kind == "f":
        flat = x.reshape(-1)
        flat[::7] = np.nan
        flat[3::11] = -np.inf
        flat[5::13] = np.inf
    return x


@pytest.mark.parametrize("kind", ["argmax", "argmin"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bool"])
def test_argmax_argmin_match_tvm(kind, dtype):
    shape = (3, 5, 17)
    cases = [(None, False), (0, False), (1, True), (-1, False), (2, True), (None, True)]

    def body(bb, x):
        op = getattr(relax.op, kind)
        return [bb.emit(op(x, axis=axis, keepdims=keep)) for axis, keep in cases]

    mod = build_model({"x": (shape, dtype)}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    x = awkward(shape, dtype, np.random.default_rng(7))
    want, got = builds.run(x)
    for (axis, keep), w, g in zip(cases, want, got):
        np.testing.assert_array_equal(g, w, err_msg=f"{kind} axis={axis} keepdims={keep}")
        np.testing.assert_array_equal(g, ArgReduce.reference(x, axis if axis is None else axis % 3, kind, keep))


def test_a_run_of_minus_infinity_gives_tvms_minus_one():
    mod = build_model({"x": ((2, 4), "float32")}, lambda bb, x: bb.emit(relax.op.argmax(x, axis=1)))
    builds = build_both(mod)
    x = np.array([[-np.inf] * 4, [np.nan, -np.inf, 2, 2]], "float32")
    want, got = builds.run(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [-1, 2])
