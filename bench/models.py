"""The model zoo: each entry is a small function returning a :class:`Case` or a :class:`Skip`.

Models written in :mod:`bench.ops` are built with ``relax.BlockBuilder`` and get a torch
twin for free (same numpy inputs, weights passed as inputs). The ``torch_export_*`` and
``onnx_*`` models come through TVM's own frontends instead (weights bound as constants);
see :mod:`bench.frontends`. The entries of the zoo suite (``--suite zoo``: real
architectures at full size, :mod:`bench.zoo`) are registered here too, with suite "zoo".
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tvm import relax

from . import frontends, zoo
from .case import Case, Skip
from .ops import RelaxOps, TorchOps, he_scale


@dataclass
class Entry:
    name: str
    make: Callable[[], Case | Skip]
    description: str
    repeat: int  # default timed repeats (zoo suite: rounds of blocks); heavy models get few
    quick: bool = False
    tags: list[str] = field(default_factory=list)
    suite: str = "default"  # "default" (python -m bench) or "zoo" (--suite zoo)
    # zoo suite: build and time TVM's default build too (it is single-threaded and
    # unscheduled: seconds per call on the big models), else check against onnxruntime
    tvm_default: bool = True


ZOO: dict[str, Entry] = {}
SUITES = ("default", "zoo")


def register(name: str, make: Callable[[], Case | Skip], description: str, repeat: int,
             quick: bool = False, suite: str = "default", tvm_default: bool = True) -> None:
    ZOO[name] = Entry(name, make, description, repeat, quick, suite=suite, tvm_default=tvm_default)


def rng_for(name: str) -> np.random.Generator:
    """A generator seeded from the model name, so inputs are the same on every run."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def from_forward(forward: Callable, inputs: dict[str, np.ndarray]) -> Case:
    """Build ``main(*inputs)`` by emitting ``forward(RelaxOps, *params)``; add its torch twin.

    Parameters
    ----------
    forward : callable
        ``forward(ops, *tensors)`` written against :mod:`bench.ops`.
    inputs : dict of str to numpy.ndarray
        Parameter names and values, in call order.
    """
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(a.shape, str(a.dtype))) for n, a in inputs.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(forward(RelaxOps(bb), *params))
        bb.emit_func_output(out)
    twin = frontends.torch_twin(forward, TorchOps)
    return Case(bb.get(), list(inputs.values()), torch_module=twin)


def _f32(rng, shape, std=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype("float32")


def seeds_10x10() -> Case:
    """The seeds' example: ``(x0 + x1 - x2) * x3`` on four 10x10 float32 inputs."""
    rng = rng_for("seeds_10x10")
    inputs = {f"x{i}": _f32(rng, (10, 10)) for i in range(4)}
    return from_forward(lambda o, a, b, c, d: o.mul(o.sub(o.add(a, b), c), d), inputs)


def fma_relu(n: int) -> Case:
    """``relu(a * b + c)`` with ``c`` a (1, n) row broadcast over (n, n)."""
    rng = rng_for(f"fma_relu_{n}")
    inputs = {"a": _f32(rng, (n, n)), "b": _f32(rng, (n, n)), "c": _f32(rng, (1, n))}
    return from_forward(lambda o, a, b, c: o.relu(o.add(o.mul(a, b), c)), inputs)


def transcendental(n: int) -> Case:
    """``gelu(tanh(a) * sigmoid(b) + exp(-|a|))`` on (n, n): the vector-math chain."""
    rng = rng_for(f"transcendental_{n}")
    inputs = {"a": _f32(rng, (n, n)), "b": _f32(rng, (n, n))}

    def forward(o, a, b):
        return o.gelu(o.add(o.mul(o.tanh(a), o.sigmoid(b)), o.exp(o.neg(o.abs(a)))))

    return from_forward(forward, inputs)


def mlp() -> Case:
    """784-1024-1024-10, batch 64: matmul + bias + relu twice, then matmul + bias."""
    rng = rng_for("mlp")
    dims = [784, 1024, 1024, 10]
    inputs = {"x": _f32(rng, (64, 784))}
    for i, (k, n) in enumerate(zip(dims, dims[1:])):
        inputs[f"w{i}"] = _f32(rng, (k, n), he_scale(k))
        inputs[f"b{i}"] = _f32(rng, (n,), 0.1)

    def forward(o, x, w0, b0, w1, b1, w2, b2):
        h = o.relu(o.add(o.matmul(x, w0), b0))
        h = o.relu(o.add(o.matmul(h, w1), b1))
        return o.add(o.matmul(h, w2), b2)

    return from_forward(forward, inputs)


def conv_block() -> Case:
    """conv2d 3x3 pad 1 (64 -> 64 channels) + bias + relu on 1x64x56x56."""
    rng = rng_for("conv_block")
    inputs = {"x": _f32(rng, (1, 64, 56, 56)), "w": _f32(rng, (64, 64, 3, 3), he_scale(576)),
              "b": _f32(rng, (1, 64, 1, 1), 0.1)}
    return from_forward(lambda o, x, w, b: o.relu(o.add(o.conv2d(x, w, 1, 1), b)), inputs)


def _resnet_weights(rng) -> dict[str, np.ndarray]:
    w = {"x": _f32(rng, (1, 3, 224, 224))}

    def conv(name, cin, cout, k):
        w[name + ".w"] = _f32(rng, (cout, cin, k, k), he_scale(cin * k * k))
        w[name + ".b"] = _f32(rng, (1, cout, 1, 1), 0.05)

    conv("stem", 3, 64, 7)
    for name, cin, cout, stride in _resnet_blocks():
        conv(name + ".c1", cin, cout, 3)
        conv(name + ".c2", cout, cout, 3)
        if stride != 1 or cin != cout:
            conv(name + ".down", cin, cout, 1)
    w["fc.w"] = _f32(rng, (512, 1000), he_scale(512))
    w["fc.b"] = _f32(rng, (1, 1000), 0.05)
    return w


def _resnet_blocks() -> list[tuple[str, int, int, int]]:
    out, cin = [], 64
    for stage, (cout, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)]):
        out += [(f"l{stage}.0", cin, cout, stride), (f"l{stage}.1", cout, cout, 1)]
        cin = cout
    return out


def resnet18() -> Case:
    """ResNet-18, batch 1, 224x224, random weights; batch norm folded into conv biases."""
    weights = _resnet_weights(rng_for("resnet18"))
    names = list(weights)

    def forward(o, *tensors):
        p = dict(zip(names, tensors))

        def conv(name, x, stride=1, pad=0):
            return o.add(o.conv2d(x, p[name + ".w"], stride, pad), p[name + ".b"])

        x = o.relu(conv("stem", p["x"], 2, 3))
        x = o.max_pool2d(x, 3, 2, 1)
        for name, cin, cout, stride in _resnet_blocks():
            h = o.relu(conv(name + ".c1", x, stride, 1))
            h = conv(name + ".c2", h, 1, 1)
            short = conv(name + ".down", x, stride, 0) if name + ".down.w" in p else x
            x = o.relu(o.add(h, short))
        return o.add(o.matmul(o.global_avg_pool(x), p["fc.w"]), p["fc.b"])

    return from_forward(forward, weights)


def transformer_block(seq: int = 128, hidden: int = 768, heads: int = 12, ffn: int = 3072) -> Case:
    """A BERT-style post-norm encoder block: attention + residual + layer norm + GELU MLP."""
    rng = rng_for("transformer_block")
    inputs = {"x": _f32(rng, (seq, hidden))}
    square = (hidden, hidden)
    for name, shape in [("wq", square), ("wk", square), ("wv", square), ("wo", square),
                        ("w1", (hidden, ffn)), ("w2", (ffn, hidden))]:
        inputs[name] = _f32(rng, shape, 0.02)
        inputs["b" + name[1:]] = _f32(rng, (shape[1],), 0.02)
    for name in ("ln1", "ln2"):
        inputs[name + ".g"] = (1 + _f32(rng, (hidden,), 0.1))
        inputs[name + ".b"] = _f32(rng, (hidden,), 0.1)
    names, d = list(inputs), hidden // heads

    def forward(o, *tensors):
        p = dict(zip(names, tensors))

        def dense(x, w):
            return o.add(o.matmul(x, p["w" + w]), p["b" + w])

        def split(x, axes):  # (seq, hidden) -> (heads, ...)
            return o.permute(o.reshape(dense(p["x"], x), (seq, heads, d)), axes)

        q, k, v = split("q", (1, 0, 2)), split("k", (1, 2, 0)), split("v", (1, 0, 2))
        att = o.softmax(o.scale(o.matmul(q, k), 1.0 / np.sqrt(d)))
        ctx = o.reshape(o.permute(o.matmul(att, v), (1, 0, 2)), (seq, hidden))
        x = o.layer_norm(o.add(p["x"], dense(ctx, "o")), p["ln1.g"], p["ln1.b"])
        h = dense(o.gelu(dense(x, "1")), "2")
        return o.layer_norm(o.add(x, h), p["ln2.g"], p["ln2.b"])

    return from_forward(forward, inputs)


def _register_all() -> None:
    register("seeds_10x10", seeds_10x10, "seeds' add->subtract->multiply, 4x 10x10", 50, quick=True)
    for n, reps, quick in [(10, 50, False), (256, 30, True), (1024, 10, False), (4096, 3, False)]:
        register(f"fma_relu_{n}", lambda n=n: fma_relu(n),
                 f"relu(a*b + c), {n}x{n}, c broadcast from a row", reps, quick)
    for n, reps, quick in [(256, 20, True), (2048, 3, False)]:
        register(f"transcendental_{n}", lambda n=n: transcendental(n),
                 f"gelu(tanh(a)*sigmoid(b) + exp(-|a|)), {n}x{n}", reps, quick)
    register("mlp", mlp, "MLP 784-1024-1024-10, batch 64", 5, quick=True)
    register("conv_block", conv_block, "conv3x3+bias+relu, 1x64x56x56", 5, quick=True)
    register("resnet18", resnet18, "ResNet-18, batch 1, 224x224, BN folded", 2)
    register("transformer_block", transformer_block,
             "encoder block, seq 128, hidden 768, 12 heads, MLP 3072", 3)
    register("torch_export_mlp", frontends.torch_export_mlp,
             "torch nn.Module via torch.export + from_exported_program", 20, quick=True)
    register("torch_export_cnn", frontends.torch_export_cnn,
             "torch CNN (conv+BN+relu+pool+linear) via torch.export", 5)
    register("onnx_mlp", frontends.onnx_mlp, "ONNX graph (onnx.helper) via relax.frontend.onnx",
             20, quick=True)
    for name, make, description, rounds, quick, tvm_default in zoo.ENTRIES:
        register(name, make, description, rounds, quick, suite="zoo", tvm_default=tvm_default)


_register_all()


def select(names: list[str] | None, quick: bool, suite: str = "default") -> list[Entry]:
    """The entries to run: ``names`` if given (in that order, from any one suite), else
    the quick or full ``suite``.

    Raises
    ------
    KeyError
        A name not in the zoo, a mix of suites, or an unknown suite; the message says
        what is known.
    """
    if names:
        unknown = [n for n in names if n not in ZOO]
        if unknown:
            raise KeyError(f"unknown model(s) {unknown}; known: {sorted(ZOO)}")
        if len({ZOO[n].suite for n in names}) > 1:  # the suites' rows have different columns
            raise KeyError(f"models {names} come from different suites; run each suite apart")
        return [ZOO[n] for n in names]
    if suite not in SUITES:
        raise KeyError(f"unknown suite {suite!r}; known: {list(SUITES)}")
    return [e for e in ZOO.values() if e.suite == suite and (e.quick or not quick)]
