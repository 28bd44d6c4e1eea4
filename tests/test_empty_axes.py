"""Ops along a symbolic axis that is empty at run time. Index ops (index_tensor too): every index is then
out of range. TVM's own build reads out of bounds; jitbyoc divided by the axis size to
wrap the index (SIGFPE, the process killed) or read element 0 of an empty tensor. Now a
gather fills its result with 0 (NaN for ``take`` in mode "nan") and a scatter writes
nothing, in the LLVM and the C renderings alike. Products with no columns (N = 0): the
GEMM engine divided by its count of column blocks, 0 (SIGFPE); now they are empty."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc

R = relax.op
K = tvm.tirx.Var("k", "int64")


def _take(mode):
    return lambda d, i: R.take(d, i, axis=0, mode=mode)


# name: (data's shape (k is 0 at run time), indices' shape, op, expected result's shape, fill)
CASES = {
    "gather_nd, batch_dims 1": ((3, K, 2), (3, 2, 1), lambda d, i: R.gather_nd(d, i, 1), (3, 2, 2), 0.0),
    "gather_nd": ((K, 4), (5, 1), lambda d, i: R.gather_nd(d, i), (5, 4), 0.0),
    "index_tensor": ((K, 4), (3,), lambda d, i: R.index_tensor(d, relax.Tuple([i])), (3, 4), 0.0),
    "gather_elements": ((2, K), (2, 3), lambda d, i: R.gather_elements(d, i, axis=1), (2, 3), 0.0),
    "take wrap": ((K, 4), (3,), _take("wrap"), (3, 4), 0.0),
    "take fast": ((K, 4), (3,), _take("fast"), (3, 4), 0.0),
    "take clip": ((K, 4), (3,), _take("clip"), (3, 4), 0.0),
    "take nan": ((K, 4), (3,), _take("nan"), (3, 4), np.nan),
    "scatter_nd": ((K, 4), (2, 1), lambda d, i: R.scatter_nd(d, i, R.ones((2, 4), "float32")), (0, 4), None),
    "scatter_elements": ((2, K), (2, 3), lambda d, i: R.scatter_elements(
        d, i, R.ones((2, 3), "float32"), axis=1), (2, 0), None),
}


def _model(first_shape, second_shape, op, second_dtype="int64") -> tvm.IRModule:
    """``main(a, b) = op(a, b)``: ``a`` float32, ``b`` of ``second_dtype``."""
    a = relax.Var("a", relax.TensorType(first_shape, "float32"))
    b = relax.Var("b", relax.TensorType(second_shape, second_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(op(a, b))
        bb.emit_func_output(out)
    return bb.get()


def _built(mod, rendering, tmp_path):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="c" if rendering == "c" else "llvm")
        report = jitbyoc.last_report()
    assert report.regions, str(report)  # the index op (a scatter's `ones` stays with TVM)
    if rendering == "c":
        ex.export_library(str(tmp_path / "model.so"), options=["-O2"])
        ex = tvm.runtime.load_module(str(tmp_path / "model.so"))
    return relax.VirtualMachine(ex, tvm.cpu())


@pytest.mark.parametrize("rendering", ["llvm", pytest.param("c", marks=pytest.mark.skipif(
    shutil.which("g++") is None, reason="C export needs g++"))])
@pytest.mark.parametrize("case", list(CASES))
def test_an_index_op_on_an_axis_empty_at_run_time_neither_traps_nor_reads(case, rendering, tmp_path):
    data_shape, index_shape, op, want_shape, fill = CASES[case]
    vm = _built(_model(data_shape, index_shape, op), rendering, tmp_path)
    data = np.zeros([0 if d is K else d for d in data_shape], "float32")
    indices = np.zeros(index_shape, "int64")
    got = vm["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(indices)).numpy()
    assert got.shape == want_shape
    if fill is not None:
        np.testing.assert_array_equal(got, np.full(want_shape, fill, "float32"))


N = tvm.tirx.Var("n", "int64")
# name: (A's shape, B's shape, op, A and B at run time); n is 0 at run time
PRODUCTS = {
    "matmul (4, 8) @ (8, n)": ((4, 8), (8, N), R.matmul, (4, 0)),
    "linear (3, 8) x (n, 8)^T + sum": ((3, 8), (N, 8),
                                       lambda a, b: R.sum(R.matmul(a, R.permute_dims(b)), axis=[1]), (3,)),
    "batched (2, 3, 4) @ (2, 4, n)": ((2, 3, 4), (2, 4, N), R.matmul, (2, 3, 0)),
    "(300, 8) @ (8, n) + relu": ((300, 8), (8, N), lambda a, b: R.nn.relu(R.matmul(a, b)), (300, 0)),
}


@pytest.mark.parametrize("rendering", ["llvm", pytest.param("c", marks=pytest.mark.skipif(
    shutil.which("g++") is None, reason="C export needs g++"))])
@pytest.mark.parametrize("case", list(PRODUCTS))
def test_a_product_with_no_columns_at_run_time_is_empty(case, rendering, tmp_path):
    """The GEMM engine split N columns into ceil(N / NC) blocks and divided by that count:
    at N = 0, SIGFPE (the LLVM rendering; TVM's build gives the empty result)."""
    a_shape, b_shape, op, want_shape = PRODUCTS[case]
    vm = _built(_model(a_shape, b_shape, op, "float32"), rendering, tmp_path)
    arrays = [np.ones([0 if d is N else d for d in s], "float32") for s in (a_shape, b_shape)]
    got = vm["main"](*[tvm.runtime.tensor(x) for x in arrays]).numpy()
    np.testing.assert_array_equal(got, np.zeros(want_shape, "float32"))
