"""``pool(concat(parts, axis=1))`` pools each part (:mod:`jitbyoc.tvm.pool_concat`):
equal to TVM's build of the model as written; left alone where the concatenation has
another user, joins another axis, or joins dequantized tensors (a QDQ graph's)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tvm import relax

from jitbyoc.tvm.prepare import prepare
from tests.conftest import build_both, build_model

R = relax.op
PARTS = {"a": ((1, 8, 11, 11), "float32"), "b": ((1, 5, 11, 11), "float32"), "c": ((1, 3, 11, 11), "float32")}


def _pools_after_concat(mod) -> list[int]:
    """The channel counts of the pools in ``mod`` after preparing."""
    found = []
    relax.analysis.post_order_visit(prepare(mod, {"relax.concat"})["main"].body, lambda e: found.append(int(e.ty.shape[1]))
                                    if isinstance(e, relax.Call) and "pool2d" in getattr(e.op, "name", "") else None)
    return found


@pytest.mark.parametrize("pool", [
    lambda x: R.nn.max_pool2d(x, 3, 2),
    lambda x: R.nn.avg_pool2d(x, 3, 1, padding=1, count_include_pad=True),
    lambda x: R.nn.max_pool2d(x, (2, 3), (2, 1), padding=(1, 0, 0, 1), ceil_mode=True)])
def test_a_pool_of_a_channel_concat_pools_each_part(pool):
    mod = build_model(PARTS, lambda bb, a, b, c: bb.emit(pool(bb.emit(R.concat([R.nn.relu(a), b, c], axis=1)))))
    assert sorted(_pools_after_concat(mod)) == [3, 5, 8]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype(d) for s, d in PARTS.values()]
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    want, got = builds.run(*xs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_concat_with_other_users_or_on_another_axis_stays():
    shared = build_model(PARTS, lambda bb, a, b, c: (lambda cat: [bb.emit(R.nn.max_pool2d(cat, 3, 2)), cat])(
        bb.emit(R.concat([a, b, c], axis=1))))
    assert _pools_after_concat(shared) == [16]
    rows = build_model({"a": ((1, 4, 6, 11), "float32"), "b": ((1, 4, 5, 11), "float32")},
                       lambda bb, a, b: bb.emit(R.nn.max_pool2d(bb.emit(R.concat([a, b], axis=2)), 3, 2)))
    assert _pools_after_concat(rows) == [4]


def test_dequantized_parts_stay_for_the_integer_requantization():
    scale, zero = relax.const(np.float32(0.1)), relax.const(np.int8(3))

    def body(bb, a, b):
        parts = [bb.emit(R.dequantize(v, scale, zero, axis=1)) for v in (a, b)]
        return bb.emit(R.nn.max_pool2d(bb.emit(R.concat(parts, axis=1)), 3, 2))
    mod = build_model({"a": ((1, 4, 9, 9), "int8"), "b": ((1, 6, 9, 9), "int8")}, body)
    assert _pools_after_concat(mod) == [10]


def test_a_bfloat16_pool_splits_before_it_is_widened():
    """A bfloat16 max pool is computed widened to float32 (:mod:`jitbyoc.tvm.widen`); it is
    left narrow until the split, so each part's pool is widened, not the whole map."""
    parts = {k: (s, "bfloat16") for k, (s, _) in PARTS.items()}
    mod = build_model(parts, lambda bb, a, b, c: bb.emit(R.nn.max_pool2d(bb.emit(R.concat([a, b, c], axis=1)), 3, 2)))
    assert sorted(_pools_after_concat(mod)) == [3, 5, 8]
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s).astype("float32").astype(ml_dtypes.bfloat16) for s, _ in parts.values()]
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    want, got = builds.run(*xs)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
