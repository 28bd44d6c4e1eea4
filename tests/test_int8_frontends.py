"""Quantized models from torch's PT2E flow: torchao's ``X86InductorQuantizer`` (where torch
2.13 keeps the x86 quantizer), prepared, calibrated and converted. TVM's torch frontend
does not import the converted graph's ``quantized_decomposed`` ops; exported to ONNX
(``torch.onnx.export(..., dynamo=True)``) it is a QDQ graph, whose convolution and linear
layer jitbyoc runs as uint8 x int8 products (docs/usage.md, quantized models)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
pytest.importorskip("onnxscript")  # torch.onnx.export's dynamo exporter

from tvm.relax.frontend.onnx import from_onnx  # noqa: E402

from tests.conftest import build_both  # noqa: E402
from tests.test_int8 import _int8_products  # noqa: E402


class _ConvLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _pt2e_quantized(x):
    """The model quantized as the x86 recipe does it, and the torch result for ``x``."""
    torch.manual_seed(0)
    model = torch.export.export(_ConvLinear().eval(), (x,)).module()
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    model = pt2e.prepare_pt2e(model, quantizer)
    for _ in range(4):
        model(torch.randn(x.shape))
    model = pt2e.convert_pt2e(model)
    return model, model(x).detach().numpy()


def test_a_pt2e_quantized_model_runs_on_int8_products_through_onnx():
    """Both layers become uint8 x int8 products; the output (the linear layer's float
    result) matches TVM's build of the same graph and torch's converted model. TVM sums
    dequantized floats where jitbyoc sums the integers exactly: the difference is float
    rounding, well below one step of the quantized activation (its scale is about
    1e-2 here, the outputs about 0.3)."""
    torch.manual_seed(1)
    x = torch.randn(1, 8, 8, 8)
    model, want = _pt2e_quantized(x)
    proto = torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in proto.graph.node}
    mod = from_onnx(proto, shape_dict={proto.graph.input[0].name: list(x.shape)}, keep_params_in_input=False)
    assert len(_int8_products(mod)) == 2
    builds = build_both(mod)
    assert not builds.report.fallbacks, builds.report
    ref, got = builds.run(x.numpy())
    bound = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=bound)
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
