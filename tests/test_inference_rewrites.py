"""Build-time rewrites on constant weights (jitbyoc/tvm/inference.py) and pointwise
convolutions run as matrix products (jitbyoc/kernels/conv2d.py): each checked against
TVM's default build, and each checked to have happened (a test that passes without the
rewrite would not test it)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm.partition import regions
from tests.conftest import build_both, build_model

RNG = np.random.default_rng(7)


def _const(shape, low=None):
    data = RNG.uniform(low, 1.5, shape) if low is not None else RNG.standard_normal(shape)
    return relax.const(data.astype("float32"))


def _conv_bn(bb, x, k, *, kernel=3, stride=1, relu=True, keep_conv=False):
    c = x.ty.shape.values[1].value
    w = _const((k, c, kernel, kernel))
    conv = bb.emit(relax.op.nn.conv2d(x, w, strides=stride, padding=kernel // 2))
    bn = bb.emit(relax.op.nn.batch_norm(conv, _const((k,), 0.5), _const((k,)), _const((k,)),
                                        _const((k,), 0.5), axis=1, epsilon=1e-5,
                                        training=False))
    y = bb.emit(relax.TupleGetItem(bn, 0))
    y = bb.emit(relax.op.nn.relu(y)) if relu else y
    return [y, conv] if keep_conv else y


def _region_ops(mod) -> list[str]:
    """Per region, its ops as its symbol spells them, in full (a symbol keeps 40
    characters: a conv's packed weight puts ``permute_dims_reshape_`` first)."""
    part = jitbyoc.partition_for_jitbyoc(mod)
    return ["jitbyoc_" + "_".join(dict.fromkeys(op.removeprefix("relax.").replace(".", "_") for op in ops)) + "_"
            for ops in (_ops_of(f) for f in regions(part).values())]


def _ops_of(func) -> list[str]:
    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return calls


def _assert_close(got, want, rtol=2e-5):
    scale = max(float(np.max(np.abs(want))), 1e-30)
    assert float(np.max(np.abs(got - want))) <= rtol * scale


@pytest.mark.parametrize("kernel,stride", [(3, 1), (1, 1), (1, 2), (7, 2)])
def test_batch_norm_folds_into_the_conv_before_it(kernel, stride):
    mod = build_model({"x": ((1, 5, 15, 13), "float32")},
                      lambda bb, x: _conv_bn(bb, x, 19, kernel=kernel, stride=stride))
    assert not any("batch_norm" in s for s in _region_ops(mod)), "batch_norm was not folded"
    x = RNG.standard_normal((1, 5, 15, 13)).astype("float32")
    builds = build_both(mod)
    want, got = builds.run(x)
    _assert_close(got, want)


def test_batch_norm_does_not_fold_into_a_conv_whose_output_is_used_twice():
    mod = build_model({"x": ((1, 4, 9, 9), "float32")},
                      lambda bb, x: _conv_bn(bb, x, 8, keep_conv=True))
    symbols = _region_ops(mod)
    assert sum(s.count("conv2d") for s in symbols) == 1, symbols  # not computed twice
    assert any("multiply_add" in s for s in symbols), symbols  # the norm as x * s + t
    x = RNG.standard_normal((1, 4, 9, 9)).astype("float32")
    want, got = build_both(mod).run(x)
    for g, w in zip(got, want):
        _assert_close(g, w)


def test_batch_norm_of_a_non_constant_weight_is_not_folded():
    def body(bb, x, w):
        conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        bn = bb.emit(relax.op.nn.batch_norm(conv, _const((6,), 0.5), _const((6,)), _const((6,)),
                                            _const((6,), 0.5), axis=1, training=False))
        return bb.emit(relax.TupleGetItem(bn, 0))

    mod = build_model({"x": ((1, 3, 8, 8), "float32"), "w": ((6, 3, 3, 3), "float32")}, body)
    symbols = _region_ops(mod)
    assert any("multiply_add" in s for s in symbols), symbols  # not folded: x * s + t
    x, w = RNG.standard_normal((1, 3, 8, 8)).astype("float32"), RNG.standard_normal((6, 3, 3, 3)).astype("float32")
    want, got = build_both(mod).run(x, w)
    _assert_close(got, want)


@pytest.mark.parametrize("n", [2, 3])
def test_onnx_sum_of_a_stack_is_adds(n):
    """ONNX Sum as TVM's frontend emits it: broadcast_to each operand, stack, sum."""
    shape = (1, 6, 7, 5)

    def body(bb, *xs):
        same = [bb.emit(relax.op.broadcast_to(x, relax.ShapeExpr(shape))) for x in xs]
        stacked = bb.emit(relax.op.stack(same, axis=0))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.op.sum(stacked, axis=[0]))))

    mod = build_model({f"x{i}": (shape, "float32") for i in range(n)}, body)
    symbols = _region_ops(mod)
    assert not any("stack" in s or "broadcast_to" in s for s in symbols), symbols
    xs = [RNG.standard_normal(shape).astype("float32") for _ in range(n)]
    want, got = build_both(mod).run(*xs)
    np.testing.assert_array_equal(got, want)  # adds in the order TVM's reduction makes them


def test_sum_with_keepdims_or_another_axis_is_left_as_it_is():
    def body(bb, a, b):
        stacked = bb.emit(relax.op.stack([a, b], axis=1))
        return bb.emit(relax.op.sum(stacked, axis=[1], keepdims=True))

    mod = build_model({"a": ((3, 4), "float32"), "b": ((3, 4), "float32")}, body)
    a, b = (RNG.standard_normal((3, 4)).astype("float32") for _ in range(2))
    want, got = build_both(mod).run(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ---- pointwise convolutions on the GEMM engine --------------------------------------------

def _pointwise(epilogue, groups=1):
    def body(bb, x, w, *extra):
        conv = relax.op.nn.conv1d if x.ty.ndim == 3 else relax.op.nn.conv2d
        y = bb.emit(conv(x, w, groups=groups))
        return bb.emit(epilogue(y, *extra)) if epilogue else y
    return body


EPILOGUES = {
    "none": (None, []),
    "bias+relu": (lambda y, b: relax.op.nn.relu(relax.op.add(y, b)), [(1, 24, 1, 1)]),
    "residual": (lambda y, r: relax.op.add(y, r), [(1, 24, 9, 7)]),
    "row bias (no flat view)": (lambda y, r: relax.op.multiply(y, r), [(1, 1, 1, 7)]),
    "column bias (no flat view)": (lambda y, r: relax.op.subtract(y, r), [(9, 1)]),
}


@pytest.mark.parametrize("name", EPILOGUES)
@pytest.mark.parametrize("batch,groups", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_pointwise_conv_runs_as_a_matrix_product(name, batch, groups):
    """Grouped too (ShuffleNet, ResNeXt, RegNet): one product per group."""
    epilogue, extra = EPILOGUES[name]
    extra = [(batch,) + s[1:] if len(s) == 4 and s[0] == 1 and name == "residual" else s for s in extra]
    params = {"x": ((batch, 3 * 11, 9, 7), "float32"), "w": ((24, 3 * 11 // groups, 1, 1), "float32")}
    params.update({f"e{i}": (s, "float32") for i, s in enumerate(extra)})
    mod = build_model(params, _pointwise(epilogue, groups))
    (region,) = jitbyoc.inspect(mod)
    assert any("gemm" in e for e in region.engines), region.engines
    arrays = [RNG.standard_normal(s).astype("float32") for s, _ in params.values()]
    want, got = build_both(mod).run(*arrays)
    _assert_close(got, want, rtol=1e-5)


def test_pointwise_conv1d_runs_as_a_matrix_product():
    mod = build_model({"x": ((2, 16, 13), "float32"), "w": ((12, 16, 1), "float32"),
                       "b": ((1, 12, 1), "float32")},
                      _pointwise(lambda y, b: relax.op.nn.relu(relax.op.add(y, b))))
    (region,) = jitbyoc.inspect(mod)
    assert any("gemm" in e for e in region.engines), region.engines
    arrays = [RNG.standard_normal(s).astype("float32") for s in ((2, 16, 13), (12, 16, 1), (1, 12, 1))]
    want, got = build_both(mod).run(*arrays)
    _assert_close(got, want, rtol=1e-5)


def test_pointwise_conv_with_a_symbolic_batch():
    mod = build_model({"x": (("n", 16, 5, 5), "float32"), "w": ((8, 16, 1, 1), "float32"),
                       "b": ((1, 8, 1, 1), "float32")},
                      _pointwise(lambda y, b: relax.op.add(y, b)))
    builds = build_both(mod)
    for n in (1, 3):
        x = RNG.standard_normal((n, 16, 5, 5)).astype("float32")
        w, b = RNG.standard_normal((8, 16, 1, 1)).astype("float32"), RNG.standard_normal((1, 8, 1, 1)).astype("float32")
        want, got = builds.run(x, w, b)
        _assert_close(got, want, rtol=1e-5)
        assert got.shape == (n, 8, 5, 5)


def test_a_residual_sum_fuses_into_the_conv_before_it():
    """The ONNX ResNet form: conv -> Sum(conv, shortcut) -> relu -> next conv. The adds
    and the relu run in the first conv's output loop; no region starts with them (a
    leftover ``y = x`` binding from a dropped broadcast_to used to end the region)."""
    shape = (1, 8, 6, 6)

    def body(bb, x, w1, w2):
        y = bb.emit(relax.op.nn.conv2d(x, w1))
        same = [bb.emit(relax.op.broadcast_to(v, relax.ShapeExpr(shape))) for v in (y, x)]
        total = bb.emit(relax.op.sum(bb.emit(relax.op.stack(same, axis=0)), axis=[0]))
        return bb.emit(relax.op.nn.conv2d(bb.emit(relax.op.nn.relu(total)), w2, padding=1))

    mod = build_model({"x": (shape, "float32"), "w1": ((8, 8, 1, 1), "float32"),
                       "w2": ((4, 8, 3, 3), "float32")}, body)
    symbols = _region_ops(mod)
    assert len(symbols) == 2 and all(s.startswith("jitbyoc_nn_conv2d_") for s in symbols), symbols
    assert "add_nn_relu" in symbols[0] or "add_nn_relu" in symbols[1]
    arrays = [RNG.standard_normal(s).astype("float32") for s in (shape, (8, 8, 1, 1), (4, 8, 3, 3))]
    want, got = build_both(mod).run(*arrays)
    _assert_close(got, want, rtol=1e-5)


def test_a_conv_bias_between_conv_and_batch_norm_folds_too():
    """ONNX Conv with B, then BatchNormalization: TVM's frontend emits conv2d, add of a
    reshaped bias, batch_norm."""
    def body(bb, x):
        w, bias = _const((6, 3, 3, 3)), _const((6,))
        conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        y = bb.emit(relax.op.add(conv, bb.emit(relax.op.reshape(bias, (1, 6, 1, 1)))))
        bn = bb.emit(relax.op.nn.batch_norm(y, _const((6,), 0.5), _const((6,)), _const((6,)),
                                            _const((6,), 0.5), axis=1, training=False))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.TupleGetItem(bn, 0))))

    mod = build_model({"x": ((1, 3, 10, 10), "float32")}, body)
    symbols = _region_ops(mod)
    assert not any("batch_norm" in s for s in symbols), symbols
    # the bias's reshape is gone; a reshape stays only to unpack a packed weight (conv_weights)
    ops = [op for f in regions(jitbyoc.partition_for_jitbyoc(mod)).values() for op in _ops_of(f)]
    assert ops.count("relax.reshape") == ops.count("relax.permute_dims"), ops
    x = RNG.standard_normal((1, 3, 10, 10)).astype("float32")
    want, got = build_both(mod).run(x)
    _assert_close(got, want)


@pytest.mark.parametrize("bias_shape,x_shape", [((4,), (1, 3, 5, 4)), ((4, 1), (1, 3, 4, 5))])
def test_a_bias_that_broadcasts_along_w_or_h_is_not_folded_as_per_channel(bias_shape, x_shape):
    """``batch_norm(conv(x) + b)`` with ``b`` of shape (K,) or (K, 1): it broadcasts along
    the width or the height, not the channels, though its size is K; folded as one value
    per channel it gave wrong values where the output width (height) is K. Found by a
    review helper; ONNX: Conv, Add of a [K] constant, BatchNormalization."""
    def body(bb, x):
        conv = bb.emit(relax.op.nn.conv2d(x, _const((4, 3, 3, 3)), padding=1))
        y = bb.emit(relax.op.add(conv, _const(bias_shape)))
        bn = bb.emit(relax.op.nn.batch_norm(y, _const((4,), 0.5), _const((4,)), _const((4,)),
                                            _const((4,), 0.5), axis=1, training=False))
        return bb.emit(relax.TupleGetItem(bn, 0))

    mod = build_model({"x": (x_shape, "float32")}, body)
    want, got = build_both(mod).run(RNG.standard_normal(x_shape).astype("float32"))
    _assert_close(got, want)


def test_a_batch_norm_before_an_activation_becomes_a_multiply_and_an_add():
    """DenseNet's pre-activation norm (on a concat, not after a conv): x * s + t."""
    def body(bb, a, b):
        cat = bb.emit(relax.op.concat([a, b], axis=1))
        bn = bb.emit(relax.op.nn.batch_norm(cat, _const((7,), 0.5), _const((7,)), _const((7,)),
                                            _const((7,), 0.5), axis=1, epsilon=1e-3, training=False))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.TupleGetItem(bn, 0))))

    mod = build_model({"a": ((2, 3, 5, 6), "float32"), "b": ((2, 4, 5, 6), "float32")}, body)
    symbols = _region_ops(mod)
    assert not any("batch_norm" in s for s in symbols) and any("multiply" in s for s in symbols), symbols
    a, b = RNG.standard_normal((2, 3, 5, 6)).astype("float32"), RNG.standard_normal((2, 4, 5, 6)).astype("float32")
    want, got = build_both(mod).run(a, b)
    _assert_close(got, want)


@pytest.mark.parametrize("rows,folds", [(5, True), ((2, 3), True), (1, False), ("n", False)])
def test_a_linear_layers_transposed_constant_weight_is_made_once_at_build_time(rows, folds):
    """torch.export's linear: matmul(x, permute_dims(W)) with W a constant. With several
    rows the permute becomes a transposed constant, so no region repacks it per call; one
    row (or a symbolic count: decoders) keeps W.T for the GEMV path's row dot products."""
    w = RNG.standard_normal((24, 40)).astype("float32")

    def body(bb, x):
        wt = bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.op.matmul(x, wt))))

    lead = rows if isinstance(rows, tuple) else (rows,)
    mod = build_model({"x": (lead + (40,), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    assert ("relax.permute_dims" not in region.kernel.ops) == folds, region.kernel.ops
    assert ((40, 24) in [tuple(b.shape) for b in region.kernel.inputs]) == folds
    shape = tuple(3 if d == "n" else d for d in lead) + (40,)
    x = RNG.standard_normal(shape).astype("float32")
    want, got = build_both(mod).run(x)
    np.testing.assert_allclose(got, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-5)
    _assert_close(got, want, rtol=1e-6)


@pytest.mark.parametrize("shape,stride,groups", [((1, 32, 14, 14), (2, 2), 1), ((2, 24, 9, 11), (2, 3), 3),
                                                 ((1, 16, 7, 7), (3, 1), 1)])
def test_strided_pointwise_conv_subsamples_then_multiplies(shape, stride, groups):
    """ResNet's strided 1x1 shortcut: x[:, :, ::s, ::s] gathered once, then the product."""
    k = 12 * groups

    def body(bb, x, w, b, r):
        y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, w, strides=stride, groups=groups)), b))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, r))))

    out_hw = tuple((d - 1) // s + 1 for d, s in zip(shape[2:], stride))
    params = {"x": (shape, "float32"), "w": ((k, shape[1] // groups, 1, 1), "float32"),
              "b": ((1, k, 1, 1), "float32"), "r": ((shape[0], k) + out_hw, "float32")}
    mod = build_model(params, body)
    (region,) = jitbyoc.inspect(mod)
    assert any("gemm" in e for e in region.engines), region.engines
    arrays = [RNG.standard_normal(s).astype("float32") for s, _ in params.values()]
    want, got = build_both(mod).run(*arrays)
    _assert_close(got, want, rtol=1e-5)


def test_a_failing_rewrite_leaves_the_model_as_it_was(monkeypatch, caplog):
    """The rewrites are optimizations: if one raises, the function is partitioned as it
    is (here the batch norm is then offloaded as a norm) and the build still succeeds."""
    from jitbyoc.tvm import inference

    def broken(*_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(inference, "folded_batch_norm", broken)
    mod = build_model({"x": ((1, 5, 15, 13), "float32")}, lambda bb, x: _conv_bn(bb, x, 19))
    with caplog.at_level("WARNING", logger="jitbyoc"):
        symbols = _region_ops(mod)
    assert any("batch_norm" in s for s in symbols) and "boom" in caplog.text
    x = RNG.standard_normal((1, 5, 15, 13)).astype("float32")
    want, got = build_both(mod).run(x)
    _assert_close(got, want)


def test_models_that_differ_only_in_weights_share_code_after_folding():
    """Folding makes new constants, but constants are arguments of the compiled code:
    two models with other weights (and norms) run the same code."""
    codes = []
    for _ in range(2):
        mod = build_model({"x": ((1, 4, 9, 9), "float32")}, lambda bb, x: _conv_bn(bb, x, 8))
        codes.append([r.kernel.name for r in jitbyoc.inspect(mod)])
    assert codes[0] == codes[1] and codes[0]


def _fill(bb, shape, value=0.02, through_reshape=False):
    """A weight as TVM's ONNX frontend gives a ``ConstantOfShape`` fill: a scalar
    broadcast (here optionally broadcast flat, then reshaped)."""
    scalar = relax.const(np.float32(value))
    if not through_reshape:
        return bb.emit(relax.op.broadcast_to(scalar, shape))
    flat = bb.emit(relax.op.broadcast_to(scalar, (int(np.prod(shape)),)))
    return bb.emit(relax.op.reshape(flat, shape))


@pytest.mark.parametrize("through_reshape", [False, True])
def test_a_conv_weight_broadcast_from_a_constant_is_a_constant(through_reshape):
    """A conv weight made by broadcasting a constant (onnx's ConstantOfShape fills) is
    computed at build time: no region broadcasts it per call (AlexNet's light file:
    21-27 -> 12-14 ms, Zen 4)."""
    def body(bb, x):
        return bb.emit(relax.op.nn.conv2d(x, _fill(bb, (8, 5, 3, 3), through_reshape=through_reshape), padding=1))

    mod = build_model({"x": ((1, 5, 9, 9), "float32")}, body)
    ops = _region_ops(mod)
    assert not any("broadcast_to" in s for s in ops), ops
    x = RNG.standard_normal((1, 5, 9, 9)).astype("float32")
    want, got = build_both(mod).run(x)
    _assert_close(got, want)


@pytest.mark.parametrize("rows", [1, 6])
def test_a_linear_weight_broadcast_from_a_constant_is_a_constant(rows):
    """ONNX Gemm with transB of a filled weight: ``matmul(x, permute_dims(broadcast_to(c)))``
    reads a constant ``W.T`` (VGG-19's first fully connected layer: 19.7 -> 12.1 ms)."""
    def body(bb, x):
        wt = bb.emit(relax.op.permute_dims(_fill(bb, (24, 40), 0.03), [1, 0]))
        return bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, wt)), _fill(bb, (24,), 0.5)))

    mod = build_model({"x": ((rows, 40), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    assert "relax.broadcast_to" not in region.kernel.ops, region.kernel.ops
    x = RNG.standard_normal((rows, 40)).astype("float32")
    want, got = build_both(mod).run(x)
    want_np = np.broadcast_to(x.sum(axis=1, keepdims=True) * np.float32(0.03) + 0.5, (rows, 24))
    np.testing.assert_allclose(got, want_np, rtol=1e-5, atol=1e-5)
    _assert_close(got, want, rtol=1e-6)


def test_a_large_broadcast_an_elementwise_op_reads_stays_a_broadcast():
    """Only weights and small constants fold: a large broadcast read by an add stays a
    broadcast in the add's loop (a folded copy would be read from memory every call)."""
    def body(bb, x):
        return bb.emit(relax.op.add(x, _fill(bb, (256, 300))))

    mod = build_model({"x": ((256, 300), "float32")}, body)
    assert any("broadcast_to" in s for s in _region_ops(mod))
    x = RNG.standard_normal((256, 300)).astype("float32")
    want, got = build_both(mod).run(x)
    _assert_close(got, want)
