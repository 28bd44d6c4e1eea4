"""``lower_precision`` rounds before a max pool or a concatenation that only a rounding
reads (:mod:`jitbyoc.tvm.round_early`): the same bits as rounding after them, in TVM's
build and in jitbyoc's; left alone where the float32 value has another reader."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.kernels.pool2d import Pool2d
from jitbyoc.render import isa
from jitbyoc.tvm import precision
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_both, build_model, build_tvm, run
from tests.diff_util import CC, region_constants, run_c

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


def _stem():
    """ResNet's stem in small: a 7x7/2 convolution, relu, a 3x3/2 max pool that two
    convolutions read (rounded: the rounding moves before the pool)."""
    rng = np.random.default_rng(7)

    def body(bb, x):
        y = bb.emit(R.nn.relu(R.nn.conv2d(x, _weight(rng, 32, 3, 7), strides=2, padding=3)))
        pool = bb.emit(R.nn.max_pool2d(y, 3, 2, padding=1))
        return [bb.emit(R.nn.conv2d(pool, _weight(rng, 32, 32, 1))),
                bb.emit(R.nn.conv2d(pool, _weight(rng, 16, 32, 3), padding=1))]
    return build_model({"x": ((1, 3, 32, 32), "float32")}, body)


def _pool_stage(mod, cpu: str):
    """The max pool of ``mod``'s regions as built for ``cpu`` (nothing runs)."""
    with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))):
        (pool,) = [s for r in jitbyoc.inspect(mod) for s in r.kernel.stages if isinstance(s, Pool2d)]
    return pool


@pytest.mark.parametrize("activations", ["float32", "bf16"])
def test_the_product_before_a_rounded_pool_writes_bfloat16_for_it(activations):
    """The rounding moved before the pool makes it a bfloat16 pool, which jitbyoc takes
    (:func:`jitbyoc.kernels.pool2d._builder`): the product before it writes its map in
    bfloat16, and the pool widens each value as it loads it. Half the bytes between them
    where the map had been written in float32 (the pool stayed float32: ResNet-50's
    stem, 64 x 112 x 112, 3.2 MB)."""
    lowered = jitbyoc.lower_precision(_stem(), "bf16", activations=activations)
    assert _dtypes(lowered, "relax.nn.max_pool2d") == ["bfloat16"]  # rounded before the pool
    for cpu in ("sapphirerapids", "znver4"):
        assert _pool_stage(lowered, cpu).inputs[0].dtype == "bfloat16", cpu
    x = np.random.default_rng(8).standard_normal((1, 3, 32, 32)).astype("float32")
    builds = build_both(lowered)
    assert not builds.report.fallbacks, builds.report
    for t, j in zip(*builds.run(x)):
        np.testing.assert_allclose(j, t, rtol=2**-7, atol=1e-5)  # the products sum in their own order


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_c_rendering_of_a_pool_of_bfloat16_matches_tvm(tmp_path):
    """The region as C (its pool reads bfloat16; the weight packed as for a machine with
    tiles), compiled and run here: TVM's values, but for the products' own order of sums."""
    rng = np.random.default_rng(9)
    x = relax.Var("x", relax.TensorType((1, 3, 20, 20), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = R.nn.relu(R.nn.conv2d(x, _weight(rng, 16, 3, 5), strides=2, padding=2))
            pooled = R.nn.max_pool2d(R.astype(y, "bfloat16"), 3, 2, padding=1)
            out = bb.emit_output(R.astype(pooled, "float32"))
        bb.emit_func_output(out)
    lowered = jitbyoc.lower_precision(bb.get(), "bf16")
    sapphire = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})  # the weight packed as for tiles
    with isa.compiling_for(machine_for(sapphire)):
        (region,) = jitbyoc.inspect(lowered)
    assert [s.inputs[0].dtype for s in region.kernel.stages if isinstance(s, Pool2d)] == ["bfloat16"]
    xv = rng.standard_normal((1, 3, 20, 20)).astype("float32")
    (got,) = run_c(region, {"x": xv, **region_constants(lowered, sapphire)}, tmp_path)
    np.testing.assert_allclose(got, run(build_tvm(lowered), xv), rtol=2**-7, atol=1e-5)
