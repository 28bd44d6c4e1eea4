"""Models that reach TVM through its own frontends, and the torch twins of zoo models.

torch and onnx are optional: each function here returns a ``Skip`` naming the missing
package instead of raising, so the suite runs (and says what it skipped) without them.
"""

from __future__ import annotations

import importlib
import warnings
import zlib

import numpy as np

from .case import Case, Skip


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _skip(package: str):

    return Skip(f"{package} is not installed (pip install {package})")


def torch_twin(forward, ops_class):
    """A ``torch.nn.Module`` running ``forward`` with torch ops, or None without torch."""
    torch = _optional("torch")
    if torch is None:
        return None

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ops = ops_class()

        def forward(self, *tensors):
            return forward(self.ops, *tensors)

    return Twin().eval()


def from_torch(net, example):
    """``torch.export`` -> ``from_exported_program``; weights become Relax constants.

    ``net`` (eval mode) is also the case's torch form: the torch eager peer, and the
    source of onnxruntime's file.
    """
    import torch
    from tvm.relax.frontend.torch import from_exported_program


    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(net.eval(), (example,))
        mod = from_exported_program(exported, unwrap_unit_return_tuple=True)
    return Case(mod, [example.numpy()], torch_module=net)


def torch_export_mlp():
    """A torch MLP (Linear, relu, LayerNorm, tanh*sigmoid, residual), 32x256."""
    torch = _optional("torch")
    if torch is None:
        return _skip("torch")
    torch.manual_seed(zlib.crc32(b"torch_export_mlp"))
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.ln, self.l2 = nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256)

        def forward(self, x):
            h = self.l2(self.ln(torch.relu(self.l1(x))))
            return torch.tanh(h) * torch.sigmoid(h) + x

    return from_torch(Net(), torch.randn(32, 256))


def torch_export_cnn():
    """A small torch CNN: (conv3x3 + BatchNorm + relu + maxpool) x2, avgpool, Linear."""
    torch = _optional("torch")
    if torch is None:
        return _skip("torch")
    torch.manual_seed(zlib.crc32(b"torch_export_cnn"))
    nn = torch.nn

    def stage(cin, cout):
        bn = nn.BatchNorm2d(cout)
        bn.running_mean.uniform_(-0.1, 0.1)
        bn.running_var.uniform_(0.5, 1.5)
        return [nn.Conv2d(cin, cout, 3, padding=1), bn, nn.ReLU(), nn.MaxPool2d(2)]

    net = nn.Sequential(*stage(3, 32), *stage(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, 10))
    return from_torch(net, torch.randn(4, 3, 64, 64))


def onnx_mlp():
    """An ONNX graph made with ``onnx.helper``: MatMul+Add+Relu, MatMul+Add, x*sigmoid(x)."""
    onnx = _optional("onnx")
    if onnx is None:
        return _skip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from tvm.relax.frontend.onnx import from_onnx


    rng = np.random.default_rng(zlib.crc32(b"onnx_mlp"))
    weights = {"w1": rng.standard_normal((256, 512)) * 0.06, "b1": rng.standard_normal(512) * 0.1,
               "w2": rng.standard_normal((512, 256)) * 0.06, "b2": rng.standard_normal(256) * 0.1}
    inits = [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()]
    steps = [("MatMul", ["x", "w1"], "m1"), ("Add", ["m1", "b1"], "a1"), ("Relu", ["a1"], "r1"),
             ("MatMul", ["r1", "w2"], "m2"), ("Add", ["m2", "b2"], "a2"), ("Sigmoid", ["a2"], "s"),
             ("Mul", ["a2", "s"], "y")]
    nodes = [helper.make_node(op, ins, [out]) for op, ins, out in steps]
    graph = helper.make_graph(
        nodes, "onnx_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 256])], inits)
    # IR version 8 (onnx 1.10+): new onnx writes IR versions older runtimes refuse to load
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    mod = from_onnx(model, keep_params_in_input=False)
    x = rng.standard_normal((32, 256)).astype("float32")
    return Case(mod, [x], onnx_model=model.SerializeToString())
