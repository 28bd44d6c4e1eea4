"""``lower_precision`` rounds before a max pool or a concatenation that only a rounding
reads (:mod:`jitbyoc.tvm.round_early`): the same bits as rounding after them, in TVM's
build and in jitbyoc's; left alone where the float32 value has another reader."""

from __future__ import annotations

import numpy as np
from tvm import relax

import jitbyoc
from jitbyoc.tvm import precision
from tests.conftest import build_both, build_model, build_tvm, run

R = relax.op
X = {"x": ((1, 8, 12, 12), "float32")}


def _weight(rng, k: int, c: int, size: int):
    return relax.const((rng.standard_normal((k, c, size, size)) * 0.3).astype("float32"))


def _module(f32_reader: str | None = None):
    """An Inception module's shape: two branches concatenated; convolutions read the
    concatenation, and its max pool of stride 1. ``f32_reader``: "pool" or "concat" also
    returns that value as it is (a float32 reader)."""
    rng = np.random.default_rng(5)

    def body(bb, x):
        a = bb.emit(R.nn.relu(R.nn.conv2d(x, _weight(rng, 6, 8, 1))))
        b = bb.emit(R.nn.relu(R.nn.conv2d(x, _weight(rng, 10, 8, 3), padding=1)))
        cat = bb.emit(R.concat([a, b], axis=1))
        pool = bb.emit(R.nn.max_pool2d(cat, 3, 1, padding=1))
        outs = [bb.emit(R.nn.conv2d(cat, _weight(rng, 4, 16, 1))), bb.emit(R.nn.conv2d(pool, _weight(rng, 4, 16, 1)))]
        return outs + ({"pool": [pool], "concat": [cat]}.get(f32_reader, []))
    return build_model(X, body)


def _dtypes(mod, op: str) -> list[str]:
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(str(e.ty.dtype))
                                    if isinstance(e, relax.Call) and getattr(e.op, "name", "") == op else None)
    return found


def _rounded_late(mod):
    """``mod`` lowered without the rewrite: each product's operand rounded where it is read."""
    func = relax.analysis.remove_all_unused(precision._ToBFloat16(mod).visit_expr(mod["main"]))
    return type(mod)({"main": func})


def test_pool_and_concatenation_take_rounded_values_with_the_same_bits():
    mod = _module()
    lowered = jitbyoc.lower_precision(mod, "bf16")
    assert _dtypes(lowered, "relax.nn.max_pool2d") == ["bfloat16"]
    assert _dtypes(lowered, "relax.concat") == ["bfloat16"]
    x = np.random.default_rng(6).standard_normal(X["x"][0]).astype("float32")
    want = run(build_tvm(_rounded_late(mod)), x)
    builds = build_both(lowered)
    assert not builds.report.fallbacks, builds.report
    tvm_out, jit_out = builds.run(x)
    for w, t in zip(want, tvm_out):
        np.testing.assert_array_equal(t, w)  # exact: rounding is monotone, a concat moves values
    for w, j in zip(want, jit_out):
        np.testing.assert_allclose(j, w, rtol=1e-5, atol=1e-5)  # jitbyoc sums in its own order


def test_values_read_as_float32_stay_float32():
    pool_read = jitbyoc.lower_precision(_module("pool"), "bf16")
    assert _dtypes(pool_read, "relax.nn.max_pool2d") == ["float32"]
    cat_read = jitbyoc.lower_precision(_module("concat"), "bf16")
    assert _dtypes(cat_read, "relax.concat") == ["float32"] and _dtypes(cat_read, "relax.nn.max_pool2d") == ["bfloat16"]
