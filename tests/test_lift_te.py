"""Calls TVM's ONNX frontend writes as tensor expressions (``Clip``: ``emit_te`` of
``topi.maximum`` and ``topi.minimum``) are lifted back to Relax ops, so a convolution's
ReLU6 joins its region (:mod:`jitbyoc.tvm.lift_te`). Each against TVM's build of the same
module; a ``call_tir`` that only carries an op's name stays with TVM."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import from_onnx

import jitbyoc
from tests.conftest import build_both, build_model


def _conv_clip(opset: int, bounds: tuple, dtype=np.float32):
    """Conv (a 3x3 of 4 -> 8 channels, with bias) then Clip: bounds as inputs from opset
    11, as attributes before it (None: that bound absent)."""
    rng = np.random.default_rng(opset)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(dtype), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(dtype), "b")
    inits, clip_inputs, attrs = [w, b], ["y", "", ""], {}
    for k, (name, value) in enumerate(zip(("min", "max"), bounds)):
        if value is not None and opset >= 11:
            inits.append(numpy_helper.from_array(np.array(value, dtype), name))
            clip_inputs[1 + k] = name
        elif value is not None:
            attrs[name] = float(value)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", clip_inputs if opset >= 11 else ["y"], ["z"], **attrs)]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [1, 4, 10, 9])],
                              [helper.make_tensor_value_info("z", elem, [1, 8, 10, 9])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return from_onnx(model, keep_params_in_input=False)


def _call_tirs(mod) -> int:
    found = []
    for f in mod.functions.values():
        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(f.body, lambda e: found.append(e) if isinstance(
                e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_tir")) else None)
    return len(found)


@pytest.mark.parametrize("opset, bounds", [(13, (0.0, 6.0)), (13, (None, 0.5)), (13, (-0.25, None)),
                                           (13, (float("nan"), 1.0)), (6, (0.0, 6.0)), (6, (-1.0, 1.5))])
def test_an_onnx_clip_joins_its_convolution(opset, bounds):
    """Without the lift the clip's maximum and minimum were ``call_tir``s left to TVM
    (fails without: the report listed them, and the region ended at the add)."""
    mod = _conv_clip(opset, bounds)
    assert _call_tirs(mod) == sum(b is not None for b in bounds)
    builds = build_both(mod)
    assert builds.report.fallbacks == []
    (region,) = builds.report.regions
    assert "relax.nn.conv2d" in region.ops and {"relax.maximum", "relax.minimum"} & set(region.ops)
    assert not {"relax.isnan", "relax.where"} & set(region.ops)  # the bounds, made NaN-safe, are constants
    x = np.random.default_rng(1).standard_normal((1, 4, 10, 9)).astype(np.float32) * 3
    x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    ref, got = builds.run(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # the conv sums in another order


def test_lifted_primfuncs_are_dropped():
    """The PrimFuncs the lifted calls used are not left in the module for TVM to compile."""
    part = jitbyoc.partition_for_jitbyoc(_conv_clip(13, (0.0, 6.0)))
    assert _call_tirs(part) == 0
    assert not [gv for gv, f in part.functions.items() if isinstance(f, tirx.PrimFunc)]


def test_a_primfunc_named_after_an_op_that_computes_something_else_stays_with_tvm():
    """Only a PrimFunc equal to the op's own legalization is lifted: ``maximum`` here adds
    one to the larger operand."""
    def maximum(a, b):
        return te.compute(a.shape, lambda *i: tirx.max(a(*i), b()) + tirx.const(1.0, "float32"))

    def body(bb, x, lo):
        return bb.emit_te(maximum, bb.emit(relax.op.add(x, x)), lo)
    mod = build_model({"x": ((2, 5), "float32"), "lo": ((), "float32")}, body)
    builds = build_both(mod)
    assert [f.op for f in builds.report.fallbacks] == ["relax.call_tir"]
    x = np.random.default_rng(2).standard_normal((2, 5)).astype(np.float32)
    ref, got = builds.run(x, np.float32(0.5))
    np.testing.assert_array_equal(got, ref)


def test_an_integer_clip_with_constant_bounds_is_lifted():
    """Integer bounds reach ``emit_te`` as constants the PrimFunc reads as 0-d buffers."""
    def body(bb, x):
        lo = bb.emit_te(__import__("tvm").topi.maximum, x, relax.const(np.int32(-3)))
        return bb.emit_te(__import__("tvm").topi.minimum, lo, relax.const(np.int32(7)))
    mod = build_model({"x": ((3, 9), "int32")}, body)
    builds = build_both(mod)
    assert builds.report.fallbacks == []
    x = np.arange(-13, 14, dtype=np.int32).reshape(3, 9)
    ref, got = builds.run(x)
    np.testing.assert_array_equal(got, ref)


def _onnx_model(nodes, x_shape, y_shape, inits=(), opset=13):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, list(x_shape))],
                              [helper.make_tensor_value_info("y", 1, list(y_shape))], list(inits))
    return from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]),
                     keep_params_in_input=False)


@pytest.mark.parametrize("mode, stride", [("SAME_UPPER", 1), ("SAME_UPPER", 2), ("SAME_LOWER", 2)])
def test_a_same_padded_convolution_pads_itself(mode, stride):
    """``auto_pad`` reaches Relax as ``emit_te(topi.nn.pad)`` before the convolution: lifted
    to ``nn.pad``, the convolution takes the padding (one region, no padded copy; fails
    without: the pad stayed with TVM)."""
    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((6, 3, 3, 3), np.float32), "w")
    out = (-(-8 // stride), -(-7 // stride))
    mod = _onnx_model([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=mode, strides=[stride] * 2)],
                      (1, 3, 8, 7), (1, 6, *out), [w])
    builds = build_both(mod)
    assert builds.report.fallbacks == []
    (region,) = builds.report.regions
    assert "relax.nn.pad" not in region.ops
    x = np.random.default_rng(4).standard_normal((1, 3, 8, 7)).astype(np.float32)
    ref, got = builds.run(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pads, value", [((0, 0, 1, 2, 0, 1, 0, 0), 0.0), ((1, 0, 0, 3, 0, 2, 1, 0), -1.5)])
def test_an_onnx_constant_pad_is_a_region(pads, value):
    """ONNX ``Pad`` (constant mode) is ``emit_te(topi.nn.pad)`` too: jitbyoc's pad kernel
    takes it, bit for bit; other modes stay with TVM."""
    y = [n + pads[i] + pads[i + 4] for i, n in enumerate((2, 3, 4, 5))]
    node = helper.make_node("Pad", ["x"], ["y"], pads=list(pads), value=value)
    builds = build_both(_onnx_model([node], (2, 3, 4, 5), y, opset=2))
    assert builds.report.fallbacks == []
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    ref, got = builds.run(x)
    np.testing.assert_array_equal(got, ref)


def test_a_uint8_pad_with_its_value_as_an_input_is_a_region():
    """Opset 11's ``Pad`` on bytes, pads and value as constant inputs (a QDQ graph pads
    with the zero point)."""
    pads = numpy_helper.from_array(np.array([0, 0, 2, 1, 0, 0, 0, 1], np.int64), "pads")
    value = numpy_helper.from_array(np.array(7, np.uint8), "v")
    graph = helper.make_graph([helper.make_node("Pad", ["x", "pads", "v"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 2, 5, 6])],
                              [pads, value])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mod = from_onnx(model, keep_params_in_input=False)
    builds = build_both(mod)
    assert builds.report.fallbacks == []
    x = np.random.default_rng(7).integers(0, 256, (1, 2, 3, 4)).astype(np.uint8)
    ref, got = builds.run(x)
    np.testing.assert_array_equal(got, ref)


def test_an_edge_pad_stays_with_tvm():
    node = helper.make_node("Pad", ["x"], ["y"], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="edge")
    builds = build_both(_onnx_model([node], (1, 2, 3, 3), (1, 2, 5, 5), opset=2))
    assert [f.op for f in builds.report.fallbacks] == ["relax.call_tir"]
    x = np.random.default_rng(6).standard_normal((1, 2, 3, 3)).astype(np.float32)
    ref, got = builds.run(x)
    np.testing.assert_array_equal(got, ref)


def test_a_bound_sanitized_from_a_tensor_that_is_not_constant_still_lifts():
    """``where(isnan(c), -inf, lo)`` with ``lo`` an input, not ``c``: not a constant bound.
    Comparing ``lo`` with ``c`` once raised (NumPy's NaN-aware equality of no value), so
    the whole function's preparing failed and the clip stayed with TVM."""
    from tvm import topi

    def body(bb, x, lo):
        c = relax.const(np.float32(0.0))
        bound = bb.emit(relax.op.where(bb.emit(relax.op.isnan(c)), relax.const(np.float32(-np.inf)), lo))
        return bb.emit_te(topi.maximum, bb.emit(relax.op.add(x, x)), bound)
    mod = build_model({"x": ((2, 5), "float32"), "lo": ((), "float32")}, body)
    builds = build_both(mod)
    assert "relax.call_tir" not in [f.op for f in builds.report.fallbacks]
    x = np.random.default_rng(8).standard_normal((2, 5)).astype(np.float32)
    ref, got = builds.run(x, np.float32(0.25))
    np.testing.assert_array_equal(got, ref)
