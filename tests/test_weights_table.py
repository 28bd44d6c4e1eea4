"""Large region weights go to TVM's constant loader (``const_name_to_constant``), not to
the VM's constant pool, whose code generator hashes every tensor's bytes twice (VGG-19:
0.93 s of a 2 s build). The functions fetch them once a call; exported libraries keep them."""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm import weights_table
from tests.conftest import build_model, build_tvm, run

RNG = np.random.default_rng(0)
LARGE = (RNG.standard_normal((512, 512)) / 22.6).astype("float32")  # 1 MiB: over MIN_BYTES
SMALL = (RNG.standard_normal((512, 24)) / 22.6).astype("float32")  # 48 KiB: stays in the pool
BIAS = RNG.standard_normal((512,)).astype("float32")


def _layers(bb, x, large=LARGE):
    h = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.matmul(x, relax.const(large)), relax.const(BIAS))))
    return bb.emit(relax.op.matmul(h, relax.const(SMALL)))


def _pool_tensor_bytes(ex) -> list[int]:
    """The byte sizes of the float32 tensors in the executable's constant pool."""
    pool = next(line for line in ex.stats().splitlines() if "Constant pool" in line)
    shapes = re.findall(r"(?<![\w\"])\[(\d+(?:, \d+)*)\]", pool)
    return [4 * int(np.prod([int(d) for d in s.split(", ")])) for s in shapes]


def _table(ex) -> dict:
    loader = ex.mod.imports[0]
    assert loader.kind == "const_loader"
    return dict(loader["get_const_var_tensor"]())


def test_large_weights_leave_the_constant_pool_and_the_results_stay_tvms():
    mod = build_model({"x": ((4, 512), "float32")}, _layers)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert max(_pool_tensor_bytes(ex)) < weights_table.MIN_BYTES
    table = _table(ex)
    assert table and all(k.startswith("jitbyoc_weight_") for k in table)
    assert sum(t.numpy().nbytes for t in table.values()) >= LARGE.nbytes
    x = RNG.standard_normal((4, 512)).astype("float32")
    np.testing.assert_allclose(run(relax.VirtualMachine(ex, tvm.cpu()), x), run(build_tvm(mod), x),
                               rtol=1e-5, atol=2e-5)


def test_an_exported_library_keeps_the_weights(tmp_path):
    mod = build_model({"x": ((4, 512), "float32")}, _layers)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    x = RNG.standard_normal((4, 512)).astype("float32")
    want = run(relax.VirtualMachine(ex, tvm.cpu()), x)
    ex.export_library(str(tmp_path / "model.so"))
    loaded = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "model.so")), tvm.cpu())
    np.testing.assert_array_equal(run(loaded, x), want)


def test_two_functions_fetch_their_own_weights():
    """Names are the module's, not a function's: two functions numbering their weights
    alike would fetch each other's."""
    bb = relax.BlockBuilder()
    for name, rows, large in (("main", 4, LARGE), ("second", 2, -LARGE)):
        x = relax.Var("x", relax.TensorType((rows, 512), "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                out = bb.emit_output(_layers(bb, x, large))
            bb.emit_func_output(out)
    mod = bb.get()
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    ref = build_tvm(mod)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for name, rows in (("main", 4), ("second", 2)):
        x = tvm.runtime.tensor(RNG.standard_normal((rows, 512)).astype("float32"))
        np.testing.assert_allclose(vm[name](x).numpy(), ref[name](x).numpy(), rtol=1e-5, atol=2e-5)
    assert len(_table(ex)) == 2


def test_constants_already_named_for_the_loader_are_kept():
    """Another codegen's constants (RunCodegen names them) stay beside jitbyoc's."""
    mod = build_model({"x": ((4, 512), "float32")}, _layers)
    theirs = tvm.runtime.tensor(np.arange(4, dtype="float32"))
    with jitbyoc.enabled():  # a name jitbyoc would pick is taken: it picks another
        mod = mod.with_attr(weights_table.ATTR, {"their_const_0": theirs, "jitbyoc_weight_0": theirs})
        ex = tvm.compile(mod, target="llvm")
    table = _table(ex)
    assert len(table) == 3 and table["jitbyoc_weight_0"].numpy().shape == (4,)
    x = RNG.standard_normal((4, 512)).astype("float32")
    np.testing.assert_allclose(run(relax.VirtualMachine(ex, tvm.cpu()), x), run(build_tvm(mod), x),
                               rtol=1e-5, atol=2e-5)
