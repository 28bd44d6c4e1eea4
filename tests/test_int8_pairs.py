"""Products of two quantized activations (:mod:`jitbyoc.tvm.quantized_pairs`): the int8
product with both zero points corrected is exact, so the float result is one conversion
and one scale of the exact integer sum, bit for bit against numpy; after a ``quantize``,
within one output step of TVM's build of the float graph."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from jitbyoc.tvm.prepare import prepare
from tests.conftest import build_both, build_model, run

R = relax.op
F32 = "float32"
CASES = pytest.mark.parametrize("da, db, za, zb", [
    ("uint8", "uint8", 120, 131), ("int8", "uint8", 3, 128), ("uint8", "int8", 0, -5), ("int8", "int8", -9, 0)])
SA, SB = 0.02, 0.03


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _product(da, db, za, zb, quantized_out: bool):
    """``(2, 3, 37, 64) @ (2, 3, 64, 29)`` of two dequantized activations, as attention's."""
    def body(bb, a, b):
        y = bb.emit(R.matmul(
            bb.emit(R.dequantize(a, relax.const(SA, F32), relax.const(za, da), axis=-1, out_dtype=F32)),
            bb.emit(R.dequantize(b, relax.const(SB, F32), relax.const(zb, db), axis=-1, out_dtype=F32))))
        if not quantized_out:
            return y
        return bb.emit(R.quantize(y, relax.const(0.05, F32), relax.const(7, "uint8"), axis=-1, out_dtype="uint8"))
    return build_model({"a": ((2, 3, 37, 64), da), "b": ((2, 3, 64, 29), db)}, body)


@CASES
def test_a_product_of_two_activations_is_the_exact_integer_sum_scaled(da, db, za, zb):
    mod = _product(da, db, za, zb, quantized_out=False)
    products = [b.value for b in prepare(mod, {"relax.dequantize"})["main"].body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul"]
    assert [str(p.ty.dtype) for p in products] == ["int32"]
    rng = np.random.default_rng(1)
    a, b = _ints(rng, da, (2, 3, 37, 64)), _ints(rng, db, (2, 3, 64, 29))
    exact = np.matmul(a.astype(np.int64) - za, b.astype(np.int64) - zb)
    want = exact.astype(np.float32) * (np.float32(SA) * np.float32(SB))
    builds = build_both(mod, tvm_builds=False)
    assert not builds.report.fallbacks, builds.report
    assert np.array_equal(run(builds.jit, a, b), want)


@CASES
def test_a_quantized_product_of_two_activations_is_within_one_step_of_tvm(da, db, za, zb):
    builds = build_both(_product(da, db, za, zb, quantized_out=True))
    rng = np.random.default_rng(2)
    a, b = _ints(rng, da, (2, 3, 37, 64)), _ints(rng, db, (2, 3, 64, 29))
    steps = np.abs(run(builds.jit, a, b).astype(int) - run(builds.tvm, a, b).astype(int))
    assert steps.max() <= 1 and (steps > 0).mean() < 0.01, (steps.max(), (steps > 0).mean())


def test_a_constant_operand_is_shifted_and_summed_at_build_time():
    """A constant weight with one nonzero zero point (``quantized_matmul`` leaves it):
    its int8 copy and column sums are constants, only the activations' rows are summed
    per call, and the result is still the exact integer sum scaled."""
    rng = np.random.default_rng(3)
    w = _ints(rng, "uint8", (64, 29))

    def body(bb, a):
        wf = bb.emit(R.dequantize(relax.const(w), relax.const(SB, F32), relax.const(131, "uint8"), axis=-1,
                                  out_dtype=F32))
        af = bb.emit(R.dequantize(a, relax.const(SA, F32), relax.const(120, "uint8"), axis=-1, out_dtype=F32))
        return bb.emit(R.matmul(af, wf))

    mod = build_model({"a": ((37, 64), "uint8")}, body)
    ops = [getattr(b.value.op, "name", "") for b in prepare(mod, {"relax.dequantize"})["main"].body.blocks[0].bindings
           if isinstance(b.value, relax.Call)]
    assert ops.count("relax.sum") == 1 and "relax.matmul" in ops, ops
    a = _ints(rng, "uint8", (37, 64))
    want = np.matmul(a.astype(np.int64) - 120, w.astype(np.int64) - 131).astype(np.float32) * \
        (np.float32(SA) * np.float32(SB))
    builds = build_both(mod, tvm_builds=False)
    assert not builds.report.fallbacks, builds.report
    assert np.array_equal(run(builds.jit, a), want)
