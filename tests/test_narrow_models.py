"""Models that are float16 or bfloat16 already (:mod:`jitbyoc.tvm.widen`): every op runs on
jitbyoc's float32 kernels, each op's result rounded to the model's dtype, products summed
in float32. The differential reference is TVM's default build of the same module widened
(the rewrite is Relax: it means the same to TVM); the numpy reference rounds each op's
float32 result and sums products in float32."""

from __future__ import annotations

import io
import warnings

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm import widen
from tests.conftest import assert_bits_equal, build_both, build_model, build_tvm, run

R = relax.op
BF16 = ml_dtypes.bfloat16
STEP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}  # one unit in the last place, relative to 1


def _widened(mod):
    return tvm.IRModule({gv: widen.widened(mod, f) if isinstance(f, relax.Function) else f
                         for gv, f in mod.functions.items()})


def _within_steps(got, want, dtype: str, steps: int, what: str):
    """``got`` within ``steps`` units in the last place of ``dtype`` of ``want`` (relative to
    ``want``'s largest magnitude: summation order moves a rounding boundary anywhere)."""
    got, want = (np.asarray(a, dtype=np.float32) for a in (got, want))
    bound = steps * STEP[dtype] * float(np.abs(want).max())
    worst = float(np.abs(got - want).max())
    assert worst <= bound, f"{what}: largest difference {worst} > {steps} steps ({bound})"


@pytest.mark.parametrize("dtype, numpy", [("float16", np.float16), ("bfloat16", BF16)])
def test_linear_layer_on_float32_kernels(dtype, numpy):
    """matmul + bias + gelu + layer norm + softmax in a narrow dtype: all offloaded (TVM
    alone cannot build a bfloat16 layer norm), against TVM's build of the widened module
    and numpy."""
    rng = np.random.default_rng(7)
    w, bias = (rng.standard_normal((96, 48)) / 10).astype(numpy), rng.standard_normal(48).astype(numpy)
    gamma, beta = rng.uniform(0.5, 1.5, 48).astype(numpy), rng.standard_normal(48).astype(numpy)

    def layer(bb, x):
        h = bb.emit(R.add(R.matmul(x, relax.const(w)), relax.const(bias)))
        h = bb.emit(R.nn.layer_norm(R.nn.gelu(h), relax.const(gamma), relax.const(beta), [-1]))
        return bb.emit(R.nn.softmax(h, -1))

    mod = build_model({"x": ((2, 5, 96), dtype)}, layer)
    builds = build_both(mod, tvm_builds=False)
    assert builds.report.fallbacks == [], str(builds.report)
    x = rng.standard_normal((2, 5, 96)).astype(numpy)
    got = run(builds.jit, x)
    assert got.dtype == np.dtype(numpy)
    _within_steps(got, run(build_tvm(_widened(mod)), x), dtype, 2, "vs TVM, widened")
    h = ((x.astype(np.float32) @ w.astype(np.float32)).astype(numpy) + bias).astype(numpy)
    h = (0.5 * h.astype(np.float32) * (1 + _erf(h.astype(np.float32) / np.sqrt(2)))).astype(numpy)
    h32 = h.astype(np.float32)
    h = ((h32 - h32.mean(-1, keepdims=True)) / np.sqrt(h32.var(-1, keepdims=True) + 1e-5)).astype(numpy)
    h = (h * gamma).astype(numpy) + beta
    e = np.exp(h.astype(np.float32) - h.astype(np.float32).max(-1, keepdims=True))
    _within_steps(got, (e / e.sum(-1, keepdims=True)).astype(numpy), dtype, 8, "vs numpy")


def _erf(x):
    from math import erf
    return np.vectorize(erf, otypes=[np.float64])(x).astype(np.float32)


def test_bfloat16_weights_stay_bfloat16():
    """A bfloat16 model's constant weight is read as bfloat16 (half the bytes), packed at
    build time: no float32 copy of it reaches a region."""
    w = np.ones((256, 128), BF16)
    mod = build_model({"x": ((4, 256), "bfloat16")}, lambda bb, x: bb.emit(R.matmul(x, relax.const(w))))
    (region,) = jitbyoc.inspect(mod)
    weights = [b for b in region.kernel.inputs if int(np.prod([int(d) for d in b.shape])) == w.size]
    assert [str(b.dtype) for b in weights] == ["bfloat16"], region.kernel.inputs


def test_float16_products_sum_in_float32():
    """4096 products of 0.1: summed in float16 (TVM's build of the model as it is) the sum
    stops growing at 256; in float32 it is 409.5 once rounded, as numpy's."""
    x, w = np.ones((1, 4096), np.float16), np.full((4096, 8), 0.1, np.float16)
    mod = build_model({"x": ((1, 4096), "float16")}, lambda bb, v: bb.emit(R.matmul(v, relax.const(w))))
    builds = build_both(mod)
    assert builds.report.fallbacks == [], str(builds.report)
    want, got = builds.run(x)
    assert float(want.max()) < 300  # TVM, summing in float16
    assert_bits_equal(got, (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16), "vs numpy")


def test_ops_jitbyoc_takes_narrow_are_not_widened():
    """max, permutes and moves of halves run as they are: no casts around them."""
    mod = build_model({"x": ((4, 6), "float16")},
                      lambda bb, x: bb.emit(R.permute_dims(R.maximum(x, relax.const(0, "float16")))))
    builds = build_both(mod)
    (region,) = builds.report.regions
    assert region.ops == ["relax.maximum", "relax.permute_dims"], region.ops
    x = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float16)
    want, got = builds.run(x)
    assert_bits_equal(got, want, "vs TVM")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_onnx_transformer_block(dtype):
    """A torch transformer block and a convolution exported to ONNX in ``dtype`` (torch's
    ``.to(torch.bfloat16)``; onnxruntime's float16 converter), through TVM's ONNX frontend:
    every op on jitbyoc, within a few steps of the float32 model."""
    torch = pytest.importorskip("torch")
    onnx = pytest.importorskip("onnx")
    from tvm.relax.frontend.onnx import from_onnx

    model, ref, inputs = _onnx_block(torch, onnx, dtype)
    mod = from_onnx(model, keep_params_in_input=False)
    with jitbyoc.enabled():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        rep = jitbyoc.last_report()
    assert rep.fallbacks == [], str(rep)
    numpy = np.float16 if dtype == "float16" else BF16
    got = run(vm, *[a.astype(numpy) for a in inputs])
    for g, r, steps in zip(got, ref, (4, 8)):
        _within_steps(g, r, dtype, steps, "vs the float32 model")


def _onnx_block(torch, onnx, dtype):
    nn = torch.nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.ln, self.q, self.k, self.v = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.up, self.down, self.conv = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, x, img):
            h = self.ln(x)
            x = x + nn.functional.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
            x = x + self.down(nn.functional.gelu(self.up(self.ln(x))))
            return x.softmax(-1), torch.relu(self.conv(img)).mean(dim=(2, 3))

    block = Block().eval()
    inputs = (torch.randn(1, 16, 64), torch.randn(1, 4, 12, 12))
    with torch.no_grad():
        ref = [t.numpy() for t in block(*inputs)]
    if dtype == "bfloat16":
        block, exported = block.to(torch.bfloat16), tuple(t.to(torch.bfloat16) for t in inputs)
    else:
        exported = inputs
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, exported, buf, input_names=["x", "img"], dynamo=False, opset_version=17)
    model = onnx.load_from_string(buf.getvalue())
    if dtype == "float16":
        float16 = pytest.importorskip("onnxruntime.transformers.float16")
        model = float16.convert_float_to_float16(model, keep_io_types=False)
    return model, ref, [t.numpy() for t in inputs]


@pytest.mark.parametrize("dtype, numpy", [("float16", np.float16), ("bfloat16", BF16)])
def test_lookup_in_a_narrow_table_reads_it_narrow(dtype, numpy):
    """An embedding lookup copies rows: the table stays in its dtype (no float32 copy of
    it, at build time or at run time), the rows equal numpy's bit for bit."""
    table = np.random.default_rng(3).standard_normal((50, 24)).astype(numpy)
    mod = build_model({"ids": ((2, 7), "int64")},
                      lambda bb, ids: bb.emit(R.multiply(R.take(relax.const(table), ids, axis=0),
                                                         relax.const(np.array(2, numpy)))))
    builds = build_both(mod, tvm_builds=False)
    assert builds.report.fallbacks == [], str(builds.report)
    (region,) = builds.report.regions
    assert f"{dtype}[50x24]" in " ".join(region.inputs), region.inputs
    ids = np.random.default_rng(4).integers(0, 50, (2, 7))
    assert_bits_equal(run(builds.jit, ids), (table[ids] * numpy(2)).astype(numpy), "vs numpy")


@pytest.mark.parametrize("dtype, numpy", [("float16", np.float16), ("bfloat16", BF16)])
def test_inference_dropout_of_a_narrow_tensor(dtype, numpy):
    """Inference dropout (SqueezeNet's, in an ONNX float16 file) is the identity in any
    float dtype: taken as it is, the value and the mask as numpy's."""
    def body(bb, x):
        out = bb.emit(R.nn.dropout(R.nn.relu(x)))
        return [bb.emit(relax.TupleGetItem(out, 0)), bb.emit(relax.TupleGetItem(out, 1))]

    builds = build_both(build_model({"x": ((3, 10), dtype)}, body), tvm_builds=False)
    assert builds.report.fallbacks == [], str(builds.report)
    x = np.random.default_rng(5).standard_normal((3, 10)).astype(numpy)
    value, mask = run(builds.jit, x)
    assert_bits_equal(value, np.maximum(x, numpy(0)), "value")
    assert_bits_equal(mask, np.ones_like(x), "mask")


def test_batch_norm_and_split_of_a_narrow_model():
    """An ONNX float16 CNN's batch norm (folded into the convolution by prepare: the
    convolution is widened after) and a split of halves (ViT's qkv): all on jitbyoc,
    against TVM's build of the widened module."""
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((8, 4, 3, 3)) / 6).astype(np.float16)
    mean, var = rng.standard_normal(8).astype(np.float16), rng.uniform(0.5, 2, 8).astype(np.float16)
    gamma, beta = rng.uniform(0.5, 1.5, 8).astype(np.float16), rng.standard_normal(8).astype(np.float16)

    def body(bb, x):
        y = bb.emit(R.nn.conv2d(x, relax.const(w), padding=1))
        bn = bb.emit(R.nn.batch_norm(y, *(relax.const(v) for v in (gamma, beta, mean, var)), axis=1,
                                         training=False))
        parts = bb.emit(R.split(bb.emit(R.nn.relu(relax.TupleGetItem(bn, 0))), 2, axis=1))
        return bb.emit(R.add(relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 1)))

    mod = build_model({"x": ((1, 4, 9, 9), "float16")}, body)
    builds = build_both(mod, tvm_builds=False)
    assert builds.report.fallbacks == [], str(builds.report)
    ops = {op for region in builds.report.regions for op in region.ops}
    assert "relax.multiply" not in ops, ops  # the norm folded into the convolution's weights
    x = rng.standard_normal((1, 4, 9, 9)).astype(np.float16)
    _within_steps(run(builds.jit, x), run(build_tvm(_widened(mod)), x), "float16", 4, "vs TVM, widened")


def test_narrow_n_ary_sum_becomes_adds():
    """ONNX's N-ary ``Sum`` of halves (``sum(stack(xs))``: ResNet-50's residuals in its
    float16 file) becomes adds, as in float32, each widened: no stack, no reduction."""
    def body(bb, a, b, c):
        return bb.emit(R.sum(R.stack([a, b, c], axis=0), axis=[0]))

    mod = build_model({k: ((2, 9), "float16") for k in "abc"}, body)
    builds = build_both(mod, tvm_builds=False)
    assert builds.report.fallbacks == [], str(builds.report)
    ops = {op for region in builds.report.regions for op in region.ops}
    assert "relax.add" in ops and not ops & {"relax.stack", "relax.sum"}, ops
    xs = [np.random.default_rng(k).standard_normal((2, 9)).astype(np.float16) for k in range(3)]
    assert_bits_equal(run(builds.jit, *xs), (xs[0] + xs[1]) + xs[2], "vs numpy")
