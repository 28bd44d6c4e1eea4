"""The small op vocabulary the zoo's models are written in, with two renderings.

A model is written once as ``forward(ops, *tensors)``. :class:`RelaxOps` emits each call
into a ``relax.BlockBuilder`` (the model TVM and jitbyoc build); :class:`TorchOps` runs it
eagerly with torch (the peer, and the source of the peer's ONNX file). Both see the same
numpy inputs, so every peer runs exactly the model that TVM builds.
"""

from __future__ import annotations

import math

from tvm import relax

_R = relax.op


class RelaxOps:
    """Emit each op into ``bb`` (inside an open dataflow block) and return its var."""

    def __init__(self, bb: relax.BlockBuilder):
        self.bb = bb

    def _e(self, expr):
        return self.bb.emit(expr)

    def add(self, a, b):
        return self._e(_R.add(a, b))

    def sub(self, a, b):
        return self._e(_R.subtract(a, b))

    def mul(self, a, b):
        return self._e(_R.multiply(a, b))

    def scale(self, a, k: float):
        return self._e(_R.multiply(a, relax.const(k, "float32")))

    def relu(self, a):
        return self._e(_R.nn.relu(a))

    def exp(self, a):
        return self._e(_R.exp(a))

    def tanh(self, a):
        return self._e(_R.tanh(a))

    def sigmoid(self, a):
        return self._e(_R.sigmoid(a))

    def gelu(self, a):
        return self._e(_R.nn.gelu(a))

    def neg(self, a):
        return self._e(_R.negative(a))

    def abs(self, a):
        return self._e(_R.abs(a))

    def matmul(self, a, b):
        return self._e(_R.matmul(a, b))

    def conv2d(self, x, w, stride: int = 1, pad: int = 0):
        return self._e(_R.nn.conv2d(x, w, strides=stride, padding=pad))

    def max_pool2d(self, x, size: int, stride: int, pad: int):
        return self._e(_R.nn.max_pool2d(x, pool_size=size, strides=stride, padding=pad))

    def global_avg_pool(self, x):
        """NCHW -> NC (mean over H and W)."""
        return self._e(_R.mean(x, axis=[2, 3], keepdims=False))

    def softmax(self, x):
        return self._e(_R.nn.softmax(x, axis=-1))

    def layer_norm(self, x, gamma, beta):
        return self._e(_R.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=1e-5))

    def reshape(self, x, shape):
        return self._e(_R.reshape(x, shape))

    def permute(self, x, axes):
        return self._e(_R.permute_dims(x, axes))


class TorchOps:
    """The same vocabulary, run eagerly with torch (float32, NCHW, like :class:`RelaxOps`)."""

    def __init__(self):
        import torch
        import torch.nn.functional as F

        self.t, self.F = torch, F

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def scale(self, a, k: float):
        return a * k

    def relu(self, a):
        return self.F.relu(a)

    def exp(self, a):
        return self.t.exp(a)

    def tanh(self, a):
        return self.t.tanh(a)

    def sigmoid(self, a):
        return self.t.sigmoid(a)

    def gelu(self, a):
        return self.F.gelu(a)

    def neg(self, a):
        return -a

    def abs(self, a):
        return self.t.abs(a)

    def matmul(self, a, b):
        return self.t.matmul(a, b)

    def conv2d(self, x, w, stride: int = 1, pad: int = 0):
        return self.F.conv2d(x, w, stride=stride, padding=pad)

    def max_pool2d(self, x, size: int, stride: int, pad: int):
        return self.F.max_pool2d(x, size, stride=stride, padding=pad)

    def global_avg_pool(self, x):
        return x.mean(dim=(2, 3))

    def softmax(self, x):
        return self.t.softmax(x, dim=-1)

    def layer_norm(self, x, gamma, beta):
        return self.F.layer_norm(x, gamma.shape, gamma, beta, eps=1e-5)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def permute(self, x, axes):
        return x.permute(*axes)


def he_scale(fan_in: int) -> float:
    """Weight std that keeps activations O(1) through relu layers (He et al.)."""
    return math.sqrt(2.0 / fan_in)
