"""Reshapes to sizes a ``match_cast`` defines at run time (TVM's ONNX frontend writes
Unsqueeze and Squeeze with their axes as an input this way): jitbyoc takes the reshape
when its region outputs the result, whose shape then shows the sizes; RunCodegen's
erased result type is given back from the call site. Where no argument of the region
shows the sizes, the reshape stays with TVM. Results against TVM's default build.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm.composite_types import restore_call_types
from tests.conftest import build_both

R = relax.op


def fresh_reshape_model(rank: int, after=None):
    """``main(x (3, 4, 5), s (rank,) int64)``: ``x`` reshaped to the sizes in ``s``
    (through tensor_to_shape and match_cast), then ``after(bb, y, x)`` if given."""
    x = relax.Var("x", relax.TensorType([3, 4, 5], "float32"))
    s = relax.Var("s", relax.TensorType([rank], "int64"))
    sizes = [tvm.tirx.Var(f"d{k}", "int64") for k in range(rank)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, s]):
        with bb.dataflow():
            shape = bb.emit(R.tensor_to_shape(s))
            bb.match_cast(shape, relax.ShapeType(sizes))
            y = bb.emit(R.reshape(x, relax.ShapeExpr(sizes)))
            out = bb.emit_output(after(bb, y, x) if after else y)
        bb.emit_func_output(out)
    return bb.get()


def run_both(mod, shape):
    builds = build_both(mod)
    x = np.random.default_rng(len(shape)).standard_normal((3, 4, 5)).astype("float32")
    want, got = builds.run(x, np.array(shape, "int64"))
    return builds.report, got, want


@pytest.mark.parametrize("shape", [(1, 3, 4, 5), (3, 1, 4, 5, 1), (60,), (1, 60, 1, 1, 1, 1)])
def test_reshape_to_run_time_sizes_is_offloaded(shape):
    report, got, want = run_both(fresh_reshape_model(len(shape)), shape)
    assert [f.op for f in report.fallbacks] == ["relax.tensor_to_shape"], str(report)
    assert got.shape == shape
    np.testing.assert_array_equal(got, want)


def test_reshape_followed_by_elementwise_in_the_same_region():
    """The result, after an add, is still the region's output: its shape shows the sizes."""
    mod = fresh_reshape_model(2, lambda bb, y, x: bb.emit(R.add(y, relax.const(1.0, "float32"))))
    report, got, want = run_both(mod, (12, 5))
    assert [f.op for f in report.fallbacks] == ["relax.tensor_to_shape"], str(report)
    np.testing.assert_array_equal(got, want)


def test_sizes_no_region_argument_shows_stay_with_tvm():
    """Summed to a scalar: no argument of a region holding the reshape shows the sizes,
    so its lowering fails, the reshape stays with TVM, and the sum is still offloaded."""
    mod = fresh_reshape_model(2, lambda bb, y, x: bb.emit(R.sum(R.multiply(y, y))))
    report, got, want = run_both(mod, (6, 10))
    assert sorted(f.op for f in report.fallbacks) == ["relax.reshape", "relax.tensor_to_shape"], str(report)
    assert "cannot be read at run time" in next(f.reason for f in report.fallbacks if f.op == "relax.reshape")
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_region_whose_result_alone_shows_the_sizes_and_feeds_another_region_builds():
    """The reshape's region outputs ``y + 1`` (its shape shows the sizes), which a sort
    TVM keeps and then another region read: TVM's RunCodegen failed the build on such a
    region ("The type is not populated"). The reshape now stays with TVM."""
    def after(bb, y, x):
        y1 = bb.emit(R.add(y, relax.const(1.0, "float32")))
        return bb.emit(R.multiply(y1, bb.emit(R.sort(y1, axis=0))))

    report, got, want = run_both(fresh_reshape_model(2, after), (12, 5))
    assert "relax.reshape" in [f.op for f in report.fallbacks] and report.offloaded_ops == 2, str(report)
    np.testing.assert_array_equal(got, want)


def test_two_regions_with_one_code_get_their_own_result_types():
    """Two reshapes of one code (same input type) to different run-time sizes: each
    region call gets back its own result type."""
    x = relax.Var("x", relax.TensorType([3, 4, 5], "float32"))
    s, t = (relax.Var(n, relax.TensorType([2], "int64")) for n in "st")
    a, b, c, d = (tvm.tirx.Var(n, "int64") for n in "abcd")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, s, t]):
        with bb.dataflow():
            bb.match_cast(bb.emit(R.tensor_to_shape(s)), relax.ShapeType([a, b]))
            y = bb.emit(R.reshape(x, relax.ShapeExpr([a, b])))
            bb.match_cast(bb.emit(R.tensor_to_shape(t)), relax.ShapeType([c, d]))
            z = bb.emit(R.reshape(x, relax.ShapeExpr([c, d])))
            out = bb.emit_output(relax.Tuple([y, z]))
        bb.emit_func_output(out)
    builds = build_both(bb.get())
    xs = np.arange(60, dtype="float32").reshape(3, 4, 5)
    want, got = builds.run(xs, np.array([6, 10], "int64"), np.array([20, 3], "int64"))
    assert [g.shape for g in got] == [(6, 10), (20, 3)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_manual_partition_and_codegen_with_restored_types():
    """partition_for_jitbyoc, then RunCodegen by hand: the erased result type comes back
    with restore_call_types, and the module builds and runs as TVM's."""
    mod = fresh_reshape_model(3)
    part = jitbyoc.partition_for_jitbyoc(mod)
    out = restore_call_types(part, relax.transform.RunCodegen()(part))
    with jitbyoc.disabled():  # TVM's own pipeline on the codegen'd module
        vm = relax.VirtualMachine(tvm.compile(out, target="llvm"), tvm.cpu())
    x = np.arange(60, dtype="float32").reshape(3, 4, 5)
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array([4, 5, 3], "int64"))).numpy()
    np.testing.assert_array_equal(got, x.reshape(4, 5, 3))


def test_a_refusal_for_one_models_context_does_not_follow_the_op_to_another_model():
    """A region refused for where it sits (its result alone shows the sizes and feeds
    another region) says nothing about the same reshape elsewhere: it was remembered by
    call signature process-wide, so a later model whose reshape region is fine left the
    reshape with TVM too. A rebuild of the first model still gives the reason."""
    def feeds_another_region(bb, y, x):
        y1 = bb.emit(R.add(y, relax.const(1.0, "float32")))
        return bb.emit(R.multiply(y1, bb.emit(R.sort(y1, axis=0))))

    first = fresh_reshape_model(2, feeds_another_region)
    report, got, want = run_both(first, (12, 5))
    assert "relax.reshape" in [f.op for f in report.fallbacks], str(report)
    np.testing.assert_array_equal(got, want)

    report, got, want = run_both(fresh_reshape_model(2, lambda bb, y, x: bb.emit(R.add(y, relax.const(1.0, "float32")))),
                                 (12, 5))
    assert [f.op for f in report.fallbacks] == ["relax.tensor_to_shape"], str(report)
    np.testing.assert_array_equal(got, want)

    reasons = {f.op: f.reason for f in jitbyoc.report(first).fallbacks}
    assert "no argument of the region shows" in reasons["relax.reshape"], reasons
