"""The ONNX project's real architectures, from the ``light_*.onnx`` files in the onnx wheel.

Those files (``onnx/backend/test/data/light``) keep each architecture but replace every
weight by a ``ConstantOfShape`` fill (0.02 everywhere) so the wheel stays small. A model
of constant weights is a poor benchmark: every channel computes the same thing and the
outputs say nothing about correctness. :func:`materialize` turns each ``ConstantOfShape``
whose shape is a constant into a random float32 initializer, scaled by what consumes it
(He initialization for conv/gemm weights, positive variances for batch norm), so TVM's
ONNX frontend sees real constant weights and onnxruntime runs the very same file.

The scales keep activations finite and the softmax outputs away from one-hot (where any
two runtimes agree and the check would say nothing): conv filters are zero-mean, and a
batch norm whose output joins a residual sum gets a scale of 0.2-0.4, or ResNet-50's
activations grow ~2x per block. The few float initializers the files already have
(trained biases and batch-norm statistics) are kept as they are.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from .case import Case, Skip


# name in the zoo -> file stem under onnx/backend/test/data/light
LIGHT_MODELS = {"alexnet": "bvlc_alexnet", "densenet121": "densenet121",
                "inception_v1": "inception_v1", "inception_v2": "inception_v2",
                "resnet50": "resnet50", "shufflenet": "shufflenet", "squeezenet": "squeezenet",
                "vgg19": "vgg19", "zfnet512": "zfnet512"}
# ops that pass a weight through unchanged in value (the light files unsqueeze batch-norm
# scales before a Mul, reshape a Gemm weight): the consumer that matters is further on
PASS_THROUGH = {"Unsqueeze", "Reshape", "Squeeze", "Flatten", "Transpose", "Identity"}


def light_path(stem: str) -> str:
    """The path of ``light_<stem>.onnx`` inside the installed onnx package."""
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{stem}.onnx")


def _consumers(graph) -> dict[str, list[tuple[object, int]]]:
    users: dict[str, list] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            users.setdefault(name, []).append((node, k))
    return users


def _final_use(name: str, users: dict) -> tuple[str, int, object | None]:
    """``(op_type, input index, node)`` of the first real consumer of ``name``."""
    for _ in range(8):  # a short chain of reshapes at most
        uses = users.get(name, [])
        if not uses:
            return "", -1, None
        node, k = uses[0]
        if node.op_type not in PASS_THROUGH:
            return node.op_type, k, node
        name = node.output[0]
    return "", -1, None


def _fan_in(op: str, node, shape: tuple[int, ...]) -> int:
    """Inputs summed into each output of a conv/gemm/matmul weight of ``shape``."""
    if op == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        if not trans_b:
            return shape[0]
    if op == "MatMul":
        return shape[0]
    return int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], op: str, index: int,
                  node, joins_residual: bool = False) -> np.ndarray:
    """A random float32 tensor of ``shape`` for input ``index`` of an ``op`` node.

    Conv/Gemm/MatMul weights get He initialization (std ``sqrt(2 / fan_in)``) so that
    activations keep their scale through relu layers (conv filters zero-mean); batch norm
    gets scales in [0.8, 1.2] ([0.2, 0.4] when ``joins_residual``), variances in
    [0.5, 1.5] (positive, or sqrt fails) and small means and offsets; anything else
    (biases, shifts) is small noise, or near 1 when it multiplies.

    Parameters
    ----------
    rng : numpy.random.Generator
        The model's generator.
    shape : tuple of int
        The tensor's shape (the ``ConstantOfShape``'s constant shape).
    op, index, node
        The consumer (past reshapes, see :data:`PASS_THROUGH`): op type, the input
        index the tensor feeds, the node itself (for Gemm's ``transB``).
    joins_residual : bool
        The consumer's output feeds an Add/Sum (the end of a residual branch).
    """
    if op in ("Conv", "Gemm", "MatMul") and index == 1:
        values = rng.standard_normal(shape) * np.sqrt(2.0 / max(_fan_in(op, node, shape), 1))
        if op == "Conv" and len(shape) > 1:  # zero-mean filters: relu's positive mean stays out
            values -= values.reshape(shape[0], -1).mean(axis=1).reshape((-1,) + (1,) * (len(shape) - 1))
    elif op == "BatchNormalization" and index == 1 and joins_residual:
        values = rng.uniform(0.2, 0.4, shape)  # keeps sums of residual branches from growing
    elif op == "BatchNormalization" and index in (1, 4):  # scale, variance
        values = rng.uniform(0.5, 1.5, shape) if index == 4 else rng.uniform(0.8, 1.2, shape)
    elif op == "Mul":
        values = rng.uniform(0.8, 1.2, shape)
    else:
        values = rng.standard_normal(shape) * 0.05
    return values.astype("float32")


def materialize(model, seed: str):
    """Replace every constant-shaped ``ConstantOfShape`` in ``model`` by a random initializer.

    Parameters
    ----------
    model : onnx.ModelProto
        A model whose weights are ``ConstantOfShape`` fills (modified in place).
    seed : str
        Seeds the generator (the model's name): the same weights on every run.

    Returns
    -------
    onnx.ModelProto
        ``model``, with the fills replaced, the shape initializers they used removed, and
        initializers no longer listed as graph inputs (so both frontends see them as
        constants and onnxruntime's inputs are the model's real ones).
    """
    from onnx import numpy_helper

    graph = model.graph
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    inits = {t.name: t for t in graph.initializer}
    users = _consumers(graph)
    keep, new = [], []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in inits:
            keep.append(node)
            continue
        shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
        op, index, user = _final_use(node.output[0], users)
        joins = user is not None and _final_use(user.output[0], users)[0] in ("Sum", "Add")
        new.append(numpy_helper.from_array(random_weight(rng, shape, op, index, user, joins),
                                           node.output[0]))
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new)
    used = {name for node in graph.node for name in node.input}
    alive = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(alive)
    names = {t.name for t in alive}
    inputs = [i for i in graph.input if i.name not in names and i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    # IR 3 (these files) wants every initializer listed as an input; IR 4 (opset 9's
    # era, onnx 1.3) lets initializers be plain constants
    model.ir_version = max(model.ir_version, 4)
    return model


def input_shapes(model) -> dict[str, tuple[int, ...]]:
    """The graph inputs and their shapes (symbolic dimensions become 1: batch 1)."""
    return {i.name: tuple(d.dim_value or 1 for d in i.type.tensor_type.shape.dim)
            for i in model.graph.input}


def light_model(name: str) -> Case | Skip:
    """The zoo's ``name`` (see :data:`LIGHT_MODELS`): materialized, through ``from_onnx``.

    Returns a :class:`Case` whose ``onnx_model`` is the materialized file (onnxruntime
    runs it), or a :class:`Skip` when onnx or the file is missing.
    """
    try:
        import onnx
    except ImportError:
        return Skip("onnx is not installed (pip install onnx)")
    path = light_path(LIGHT_MODELS[name])
    if not os.path.exists(path):
        return Skip(f"{path} is not in this onnx wheel")
    from tvm.relax.frontend.onnx import from_onnx

    model = materialize(onnx.load(path), name)
    onnx.checker.check_model(model)
    rng = np.random.default_rng(zlib.crc32(f"{name}/input".encode()))
    inputs = [rng.standard_normal(shape).astype("float32")
              for shape in input_shapes(model).values()]
    mod = from_onnx(model, keep_params_in_input=False)
    return Case(mod, inputs, onnx_model=model.SerializeToString())
