"""How a quantized graph's layers become regions and stages: the requantization after an
int8 product runs in the product's blocks and writes the uint8 result itself
(``KernelStage.epilogue_out``), a layer's tail that its frontend ordered after the next
layer's kernel still joins its layer, a dequantize joins the region that reads it, the
branches of a concatenation requantized to their own scales are concatenated as
integers, and a batch norm's factors computed from constants run before the product
they scale. Each against TVM's build of the same module, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.ir import kir
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.tvm.partition import regions
from jitbyoc.tvm.prepare import prepare
from tests.conftest import build_both, build_model, call_region
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit
from tests.test_int8 import _ints

R = relax.op


def _quantize(x, scale, zp, dtype="uint8"):
    return R.quantize(x, relax.const(np.float32(scale)), relax.const(zp, dtype), axis=1, out_dtype=dtype)


def _dequantize(q, scale, zp, dtype="uint8"):
    return R.dequantize(q, relax.const(np.float32(scale)), relax.const(zp, dtype), axis=1)


def _scaled_conv(bb, x, w, scale, padding=0):
    """``astype(conv2d(x, w) in int32) * scale``: a product as jitbyoc's prepare leaves it."""
    acc = bb.emit(R.nn.conv2d(x, relax.const(w), padding=padding, out_dtype="int32"))
    return bb.emit(R.multiply(R.astype(acc, "float32"), relax.const(scale)))


def _region_output_dtypes(mod) -> list[str]:
    part = jitbyoc.partition_for_jitbyoc(mod)
    return [str(t.dtype) for f in regions(part).values()
            for t in (f.ret_ty.fields if isinstance(f.ret_ty, relax.TupleType) else [f.ret_ty])]


def _requantized_conv(rng, k=16, c=8):
    w = _ints(rng, (k, c, 3, 3), "int8")
    scale = rng.uniform(1e-4, 4e-4, (1, k, 1, 1)).astype(np.float32)

    def body(bb, x):
        return bb.emit(_quantize(_scaled_conv(bb, x, w, scale, padding=1), 0.05, 3))
    return build_model({"x": ((1, c, 12, 11), "uint8")}, body)


def test_requantization_runs_in_the_product_and_writes_uint8():
    """The int32 sums stay the convolution's scratch; its epilogue requantizes each
    finished band into the uint8 output: no elementwise pass over the sums after it."""
    rng = np.random.default_rng(0)
    mod = _requantized_conv(rng)
    (region,) = jitbyoc.inspect(mod)
    (conv,) = region.kernel.stages
    assert isinstance(conv, Conv2d) and conv.out.dtype == "int32"
    assert conv.epilogue is not None and conv.epilogue_out.storage == region.kernel.outputs[0]
    x = _ints(rng, (1, 8, 12, 11), "uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_of_a_requantizing_epilogue(tmp_path):
    """The C nest applies the same epilogue to the sums once they are complete."""
    rng = np.random.default_rng(1)
    arrays = {"x": _ints(rng, (1, 4, 12, 11), "uint8"), "w": _ints(rng, (8, 4, 3, 3), "int8"),
              "s": rng.uniform(1e-4, 4e-4, (1, 8, 1, 1)).astype(np.float32),
              "qs": np.array(0.05, np.float32), "qz": np.array(3, np.uint8)}

    def body(bb, x, w, s, qs, qz):
        acc = bb.emit(R.nn.conv2d(x, w, padding=1, out_dtype="int32"))
        y = bb.emit(R.multiply(R.astype(acc, "float32"), s))
        return bb.emit(R.quantize(y, qs, qz, axis=1, out_dtype="uint8"))
    mod = build_model({k: (v.shape, str(v.dtype)) for k, v in arrays.items()}, body)
    (region,) = jitbyoc.inspect(mod)
    assert region.kernel.stages[-1].epilogue_out is not None
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    ref = build_both(mod).run(*arrays.values())[0]
    ins = [arrays[n] for n in region.arg_names[:len(region.kernel.inputs)]]
    for fn in (c_fn, jit_fn):
        (got,) = call_region(fn, region.kernel, ins)
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("hw", [(47, 47), (8, 8)])
def test_a_residual_requantization_over_a_large_map_runs_on_byte_vectors(hw):
    """ResNet's expansion with its residual, ``relu(dq(q(conv)) + dq(r))`` requantized: on
    a map of 2048+ pixels the epilogue takes a byte vector's lanes a step (four float
    vectors, one tie check), 47x47 ending in a masked part; a small map keeps a float
    vector's. Bit for bit as TVM's build."""
    from jitbyoc.render import isa

    rng = np.random.default_rng(3)
    w = _ints(rng, (24, 16, 1, 1), "int8")
    scale = rng.uniform(1e-4, 4e-4, (1, 24, 1, 1)).astype(np.float32)

    def body(bb, x, r):
        q = bb.emit(_quantize(_scaled_conv(bb, x, w, scale), 0.05, 3))
        y = bb.emit(R.add(bb.emit(_dequantize(q, 0.05, 3)), bb.emit(_dequantize(r, 0.04, 5))))
        return bb.emit(_quantize(bb.emit(R.nn.relu(y)), 0.07, 0))
    mod = build_model({"x": ((1, 16, *hw), "uint8"), "r": ((1, 24, *hw), "uint8")}, body)
    (region,) = jitbyoc.inspect(mod)
    wide = f"<{isa.lanes('int8')} x float>" in region.llvm_ir
    assert wide == (hw[0] * hw[1] >= 2048)
    x, r = _ints(rng, (1, 16, *hw), "uint8"), _ints(rng, (1, 24, *hw), "uint8")
    ref, got = build_both(mod).run(x, r)
    assert np.array_equal(ref, got)


def test_requantized_product_writes_uint8():
    """The same for a matmul (the GEMM engine's blocks)."""
    rng = np.random.default_rng(2)
    w = _ints(rng, (72, 40), "int8")

    def body(bb, x):
        acc = bb.emit(R.matmul(x, relax.const(w), out_dtype="int32"))
        y = bb.emit(R.multiply(R.astype(acc, "float32"), relax.const(np.float32(3e-4))))
        return bb.emit(R.quantize(y, relax.const(np.float32(0.02)), relax.const(128, "uint8"), axis=-1,
                                  out_dtype="uint8"))
    mod = build_model({"x": ((33, 72), "uint8")}, body)
    (region,) = jitbyoc.inspect(mod)
    assert [type(s).__name__ for s in region.kernel.stages] == ["MatMul"]
    assert region.kernel.stages[0].epilogue_out is not None
    x = _ints(rng, (33, 72), "uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


def test_a_layer_tail_ordered_after_the_next_kernel_joins_its_layer():
    """TVM's ONNX import of a fire module: both convolutions first, then both bias adds
    and requantizations. Each tail joins its own convolution's region, which hands on
    uint8, not the float sums."""
    rng = np.random.default_rng(3)
    w1, w2 = _ints(rng, (8, 4, 1, 1), "int8"), _ints(rng, (8, 4, 3, 3), "int8")
    s1, s2 = (rng.uniform(1e-3, 2e-3, (1, 8, 1, 1)).astype(np.float32) for _ in range(2))
    b1, b2 = (rng.standard_normal((1, 8, 1, 1)).astype(np.float32) for _ in range(2))

    def body(bb, x):
        y1 = _scaled_conv(bb, x, w1, s1)
        y2 = _scaled_conv(bb, x, w2, s2, padding=1)
        z1, z2 = bb.emit(R.add(y1, relax.const(b1))), bb.emit(R.add(y2, relax.const(b2)))
        return [bb.emit(_quantize(z1, 0.05, 10)), bb.emit(_quantize(z2, 0.07, 20))]
    mod = build_model({"x": ((1, 4, 9, 9), "uint8")}, body)
    assert _region_output_dtypes(mod) == ["uint8", "uint8"]
    x = _ints(rng, (1, 4, 9, 9), "uint8")
    for ref, got in zip(*build_both(mod).run(x)):
        assert np.array_equal(ref, got)


def test_a_dequantize_joins_the_region_that_reads_it():
    """A residual block: the block's uint8 output is dequantized for the next block's
    add. Standing right after the first convolution, the dequantize used to join its
    region, which then wrote the float tensor beside the uint8 one."""
    rng = np.random.default_rng(4)
    w1, w2 = _ints(rng, (8, 8, 1, 1), "int8"), _ints(rng, (8, 8, 1, 1), "int8")

    def body(bb, x):
        q = bb.emit(_quantize(_scaled_conv(bb, x, w1, np.float32(1e-3)), 0.05, 0))
        skip = bb.emit(_dequantize(q, 0.05, 0))
        y = _scaled_conv(bb, q, w2, np.float32(2e-3))
        return bb.emit(_quantize(R.nn.relu(R.add(y, skip)), 0.06, 0))
    mod = build_model({"x": ((1, 8, 10, 10), "uint8")}, body)
    assert "float32" not in _region_output_dtypes(mod)
    x = _ints(rng, (1, 8, 10, 10), "uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


def test_concat_of_branches_with_their_own_scales_concatenates_integers():
    """``quantize(concat(dequantize(a, sa), dequantize(b, sb)), sa)``: the branch already
    at the output's scale is moved as it is, the other requantized by itself; the concat
    moves uint8."""
    rng = np.random.default_rng(5)

    def body(bb, a, b):
        fa, fb = bb.emit(_dequantize(a, 0.04, 7)), bb.emit(_dequantize(b, 0.03, 2))
        return bb.emit(_quantize(R.concat([fa, fb], axis=1), 0.04, 7))
    mod = build_model({"a": ((1, 3, 5, 6), "uint8"), "b": ((1, 4, 5, 6), "uint8")}, body)
    text = prepare(mod, {"relax.dequantize", "relax.quantize"}).script()
    assert 'R.Tensor((1, 7, 5, 6), dtype="uint8") = R.concat(' in text
    args = _ints(rng, (1, 3, 5, 6), "uint8"), _ints(rng, (1, 4, 5, 6), "uint8")
    ref, got = build_both(mod).run(*args)
    assert np.array_equal(ref, got)


def test_batch_norm_factors_from_constants_run_before_the_product():
    """A QDQ graph's batch norm after an int8 convolution (its parameters dequantized
    from constants, computed after the convolution in the graph's order) fuses into the
    convolution's epilogue: its factors are computed first."""
    rng = np.random.default_rng(6)
    w = _ints(rng, (16, 8, 1, 1), "int8")
    gamma, beta = _ints(rng, (16,), "int8"), rng.integers(-50, 50, 16).astype(np.int32)
    mean, var = rng.standard_normal(16).astype(np.float32), rng.uniform(0.5, 2, 16).astype(np.float32)

    def body(bb, x):
        y = _scaled_conv(bb, x, w, np.float32(1e-3))
        g = bb.emit(R.dequantize(relax.const(gamma), relax.const(np.float32(0.01)), relax.const(0, "int8")))
        b = bb.emit(R.dequantize(relax.const(beta), relax.const(np.float32(0.002)), relax.const(0, "int32")))
        normed = bb.emit(R.nn.batch_norm(y, g, b, relax.const(mean), relax.const(var), axis=1,
                                             training=False))
        return bb.emit(_quantize(bb.emit(relax.TupleGetItem(normed, 0)), 0.05, 9))
    mod = build_model({"x": ((1, 8, 14, 14), "uint8")}, body)
    (region,) = jitbyoc.inspect(mod)
    big = [s for s in region.kernel.stages if kir.stage_writes(s)[-1].shape == (1, 16, 14, 14)]
    assert [type(s).__name__ for s in big] == ["Conv2d"] and big[0].epilogue is not None
    x = _ints(rng, (1, 8, 14, 14), "uint8")
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)


def test_a_batch_norm_tail_with_its_constants_joins_its_layer():
    """A ResNet block's first convolution and its shortcut import one after the other,
    then the first one's tail: requantize, dequantize, a batch norm whose parameters are
    dequantized constants bound after the shortcut, requantize. The whole tail (its
    constants with it) joins the first convolution's region and runs in its epilogue."""
    rng = np.random.default_rng(8)
    w1, w2 = _ints(rng, (8, 4, 1, 1), "int8"), _ints(rng, (16, 4, 1, 1), "int8")
    gamma, mean = _ints(rng, (8,), "int8"), rng.standard_normal(8).astype(np.float32)

    def body(bb, x):
        y1 = _scaled_conv(bb, x, w1, np.float32(1e-3))
        y2 = _scaled_conv(bb, x, w2, np.float32(2e-3))
        q1 = bb.emit(_quantize(y1, 0.05, 4))
        f1 = bb.emit(_dequantize(q1, 0.05, 4))
        g = bb.emit(R.dequantize(relax.const(gamma), relax.const(np.float32(0.01)), relax.const(0, "int8")))
        normed = bb.emit(R.nn.batch_norm(f1, g, relax.const(np.zeros(8, np.float32)), relax.const(mean),
                                         relax.const(np.ones(8, np.float32)), axis=1, training=False))
        return [bb.emit(_quantize(bb.emit(relax.TupleGetItem(normed, 0)), 0.04, 9)), bb.emit(_quantize(y2, 0.1, 0))]
    mod = build_model({"x": ((1, 4, 9, 9), "uint8")}, body)
    assert _region_output_dtypes(mod) == ["uint8", "uint8"]
    for region in jitbyoc.inspect(mod):
        big = [s for s in region.kernel.stages if kir.stage_writes(s)[-1].shape[-2:] == (9, 9)]
        assert [type(s).__name__ for s in big] == ["Conv2d"], region.kernel.stages
    x = _ints(rng, (1, 4, 9, 9), "uint8")
    for ref, got in zip(*build_both(mod).run(x)):
        assert np.array_equal(ref, got)


@pytest.mark.parametrize("dtype, zp", [("uint8", 7), ("int8", -3)])
def test_a_dequantized_quantize_is_never_a_byte(dtype, zp):
    """``dequantize(quantize(x))`` in one loop subtracts the zero point from the clamped
    float: no conversion to bytes and back. Bit for bit TVM's result, for ties, values
    beyond the range, infinities and NaN (clamped to the upper bound by both)."""
    def body(bb, x):
        q = bb.emit(_quantize(x, 0.25, zp, dtype))
        return bb.emit(R.multiply(_dequantize(q, 0.25, zp, dtype), relax.const(np.float32(3.0))))
    mod = build_model({"x": ((4, 300), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    casts = [n.dtype for s in region.kernel.stages for n in kir.walk([e for _, e in s.stores])
             if isinstance(n, kir.Op) and n.op == "astype"]
    assert dtype not in casts
    rng = np.random.default_rng(9)
    x = (rng.integers(-1200, 1200, (4, 300)) * 0.125).astype(np.float32)  # ties at .5 steps
    x[0, :4] = [np.inf, -np.inf, np.nan, 1e30]
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got, equal_nan=True)


def _quantized_constant_model(w, scale, zp):
    def body(bb, x):
        weight = bb.emit(R.reshape(relax.const(w), w.shape[-2:]))
        q = bb.emit(R.quantize(weight, relax.const(scale), relax.const(zp), axis=0, out_dtype="uint8"))
        return bb.emit(R.add(q, x))
    mod = build_model({"x": (w.shape[-2:], "uint8")}, body)
    prepared = prepare(mod, {"relax.reshape", "relax.quantize"})
    calls = [b.value.op.name for b in prepared["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    return mod, calls


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_quantized_constant_is_quantized_once_at_build_time(per_channel):
    """A weight the quantizer took for an activation (Inception v1's classifier: a float
    initializer reshaped in the graph, then quantize and dequantize) becomes a constant
    when the build starts, no quantize left to run per call, and its bytes are those TVM's
    legalization computes: ties to even (a scale of 0.25 makes them exact), the clip at
    both ends, the zero point added."""
    rng = np.random.default_rng(11)
    w = (rng.integers(-300, 300, (1, 1, 6, 16)) / 4).astype(np.float32)  # quarter steps: ties at .5
    w[0, 0, 0, :4] = [2.125, -2.125, 1e6, -1e6]
    scale = rng.uniform(0.1, 0.3, 6).astype(np.float32) if per_channel else np.float32(0.25)
    zp = np.full(6, 7, np.uint8) if per_channel else np.uint8(7)
    mod, calls = _quantized_constant_model(w, scale, zp)
    assert "relax.quantize" not in calls, calls
    x = np.zeros((6, 16), np.uint8)
    ref, got = build_both(mod).run(x)
    assert np.array_equal(ref, got)
    if not per_channel:  # 2.125 / 0.25 = 8.5: to 8, plus 7; -8.5: to -8, plus 7, clipped at 0
        assert got[0, :2].tolist() == [15, 0]
    assert got[0, 2] == 255 and got[0, 3] == 0


def test_a_quantized_constant_that_is_not_finite_is_left_to_run():
    """A weight with infinities (or NaN, where the clip's result is the CPU's) is not
    folded: the quantize runs as before, with TVM's results."""
    w = np.arange(96, dtype=np.float32).reshape(1, 1, 6, 16) - 40.5
    w[0, 0, 1, :2] = [np.inf, -np.inf]
    mod, calls = _quantized_constant_model(w, np.float32(0.25), np.uint8(7))
    assert "relax.quantize" in calls, calls
    ref, got = build_both(mod).run(np.zeros((6, 16), np.uint8))
    assert np.array_equal(ref, got)
