"""Constants made at build time (jitbyoc/tvm/constants.py): weights packed by the linear
rewrites are written once, only if the rewritten model still uses them, in the
background; reading one before or while it is written gives its value. End-to-end
correctness of the packed weights is in tests/test_linear_rewrites.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm import constants, linear
from tests.conftest import build_model, build_tvm, run
from tests.test_linear_rewrites import fused_qkv

RNG = np.random.default_rng(11)


class _Recorder(ThreadPoolExecutor):
    """A one-thread pool that notes every copy it runs (and may slow each down)."""

    def __init__(self, delay: float = 0.0):
        super().__init__(1)
        self.written: list[int] = []
        self.delay = delay

    def submit(self, fn, dst, src):
        def copy():
            time.sleep(self.delay)
            fn(dst, src)
        self.written.append(dst.nbytes)
        return super().submit(copy)


@pytest.fixture
def recorder(monkeypatch):
    pool = _Recorder()
    monkeypatch.setattr(constants, "_pool", lambda: pool)
    return pool


def _uses(values) -> relax.Function:
    """``main(x) = x + c0 + c1 ...``: a function that holds the constants ``values``."""
    x = relax.Var("x", relax.TensorType(values[0].value.shape, str(values[0].value.dtype)))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        total = x
        for value in values:
            total = bb.emit(relax.op.add(total, value))
        bb.emit_func_output(total)
    return bb.get()["main"]


def _big(shape=(64, 512)) -> np.ndarray:
    value = RNG.standard_normal(shape).astype("float32")
    assert value.nbytes >= constants.DEFER_BYTES
    return value


def test_a_deferred_constant_reads_as_its_value_and_only_used_ones_are_written(recorder):
    a, b = _big(), _big()
    with constants.deferred() as pending:
        made_a = constants.tensor_constant(a.T[::-1])
        constants.tensor_constant(b)  # made, never used
        np.testing.assert_array_equal(constants.constant(made_a), a.T[::-1])  # before it is written
        constants.write_deferred(pending, _uses([made_a]))
    constants.finish_writes()
    assert recorder.written == [a.nbytes]  # b: made, not used, never written
    np.testing.assert_array_equal(made_a.value.numpy(), a.T[::-1])


def test_a_filled_constant_is_filled_on_a_writer_or_when_read_first(recorder):
    """``filled_constant`` (a Winograd weight's transform): deferred like a copy, written
    only if used; read before that, it is filled then and not written again."""
    a = _big()
    fills = []

    def fill(value):
        def run(out):
            fills.append(value.nbytes)
            np.multiply(value, 2, out=out)
        return run

    with constants.deferred() as pending:
        used = constants.filled_constant(a.shape, "float32", fill(a))
        constants.filled_constant(a.shape, "float32", fill(a))  # made, never used
        read = constants.filled_constant(a.shape, "float32", fill(a))
        assert fills == []
        np.testing.assert_array_equal(constants.constant(read), 2 * a)  # filled as it is read
        assert fills == [a.nbytes]
        constants.write_deferred(pending, _uses([used, read]))
    constants.finish_writes()
    assert recorder.written == [a.nbytes] and fills == [a.nbytes] * 2  # read's fill not run twice
    np.testing.assert_array_equal(used.value.numpy(), 2 * a)
    np.testing.assert_array_equal(read.value.numpy(), 2 * a)


def test_reading_a_constant_while_it_is_written_waits_for_it(monkeypatch):
    pool = _Recorder(delay=0.3)
    monkeypatch.setattr(constants, "_pool", lambda: pool)
    value = _big()
    with constants.deferred() as pending:
        made = constants.tensor_constant(value)
        constants.write_deferred(pending, _uses([made]))
    np.testing.assert_array_equal(constants.constant(made), value)  # outside: waits for the copy
    constants.finish_writes()


def test_a_failed_copy_is_raised_by_finish_writes(monkeypatch):
    class Failing(ThreadPoolExecutor):
        def submit(self, fn, dst, src):
            return super().submit(lambda: (_ for _ in ()).throw(MemoryError("no memory for the copy")))

    monkeypatch.setattr(constants, "_pool", lambda: Failing(1))
    with constants.deferred() as pending:
        made = constants.tensor_constant(_big())
        constants.write_deferred(pending, _uses([made]))
    with pytest.raises(MemoryError, match="no memory"):
        constants.finish_writes()
    constants.finish_writes()  # nothing left in flight


def test_small_constants_are_written_at_once(recorder):
    small = np.arange(7, dtype="float32")
    with constants.deferred():
        made = constants.tensor_constant(small)
    np.testing.assert_array_equal(made.value.numpy(), small)
    assert recorder.written == []


def test_a_fused_qkv_sliced_into_heads_writes_each_weight_once(recorder):
    """ViT's chain: the projection's weight packed in panels, then rearranged per head,
    then cut into Q, K and V. Before, each step wrote the whole weight again (three
    writes of it); now only the pieces the built model uses are written, once each."""
    k, m = 160, 9
    mod, w, _ = fused_qkv(k, 2, 64, m)
    x = RNG.standard_normal((1, m, k)).astype("float32")
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert sorted(recorder.written) == [w.nbytes // 3] * 3, recorder.written
    got = run(relax.VirtualMachine(ex, tvm.cpu()), x)
    ref = run(build_tvm(mod), x)
    for i in range(3):
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-5, atol=1e-5)


def test_constants_are_written_before_a_partitioned_module_is_returned(monkeypatch):
    """``partition_for_jitbyoc`` hands back a module whose constants are all written,
    however slow the copies."""
    pool = _Recorder(delay=0.2)
    monkeypatch.setattr(constants, "_pool", lambda: pool)
    w = RNG.standard_normal((256, 96)).astype("float32")
    mod = build_model({"x": ((4, 96), "float32")},
                      lambda bb, x: bb.emit(relax.op.linear(x, relax.const(w))))
    part = jitbyoc.partition_for_jitbyoc(mod)
    assert pool.written and not constants._WRITING
    held = []
    for func in part.functions.values():
        relax.analysis.post_order_visit(func, lambda e: held.append(constants.constant(e)))
    held = [h for h in held if h is not None and h.size == w.size]
    assert held and all(np.array_equal(np.sort(h.ravel()), np.sort(w.ravel())) for h in held)


def test_a_build_compiles_its_regions_while_the_weights_are_written(monkeypatch):
    """In ``tvm.compile``, the copies go on while the regions compile (they read weights
    only through ``constant``); the build waits for them before TVM's own passes.
    Each copy here waits until compiling has begun: a build that waited for the copies
    first would only start compiling after the copy gave up."""
    from jitbyoc.toolchain import driver

    compiling, order = threading.Event(), []

    class WaitsForCompiling(ThreadPoolExecutor):
        def submit(self, fn, dst, src):
            def copy():
                order.append(("copy", compiling.wait(timeout=5)))
                fn(dst, src)
            return super().submit(copy)

    monkeypatch.setattr(constants, "_pool", lambda: WaitsForCompiling(1))
    build_regions = driver.build_regions

    def noting(regions, build):
        compiling.set()
        return build_regions(regions, build)
    monkeypatch.setattr(driver, "build_regions", noting)
    w = RNG.standard_normal((256, 96)).astype("float32")
    mod = build_model({"x": ((4, 96), "float32")},
                      lambda bb, x: bb.emit(relax.op.linear(x, relax.const(w))))
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
    assert order and all(started for _, started in order), order  # every copy ran once compiling began
    assert not constants._WRITING
    x = RNG.standard_normal((4, 96)).astype("float32")
    np.testing.assert_allclose(run(relax.VirtualMachine(ex, tvm.cpu()), x), run(build_tvm(mod), x),
                               rtol=1e-5, atol=1e-5)


def test_a_failed_copy_is_raised_at_the_end_of_the_overlap(monkeypatch):
    class Failing(ThreadPoolExecutor):
        def submit(self, fn, dst, src):
            return super().submit(lambda: (_ for _ in ()).throw(MemoryError("no memory for the copy")))

    monkeypatch.setattr(constants, "_pool", lambda: Failing(1))
    with pytest.raises(MemoryError, match="no memory"):
        with constants.writes_overlap():
            with constants.deferred() as pending:
                made = constants.tensor_constant(_big())
                constants.write_deferred(pending, _uses([made]))
    constants.finish_writes()  # nothing left in flight


def test_a_weight_packed_in_panels_is_copied_once_from_the_weight(monkeypatch):
    """Packing a linear layer's weight into the GEMM engine's panels is one copy, made by
    a writer thread, from the weight itself. Before, the packing was first made
    contiguous in a fresh numpy array (its pages, transparent huge ones, faulted in one by
    one) and then copied again: BERT-base's cold build spent 0.77 s there."""
    sources = []

    class Sources(ThreadPoolExecutor):
        def submit(self, fn, dst, src):
            sources.append((dst, src))
            return super().submit(fn, dst, src)

    monkeypatch.setattr(constants, "_pool", lambda: Sources(1))
    w = _big((96, 512))
    x = relax.Var("x", relax.TensorType((2, 96), "float32"))
    bb = relax.BlockBuilder()
    with constants.deferred() as pending:
        with bb.function("main", [x]):
            y = bb.emit(relax.op.matmul(x, linear.panel_weight(w, bb.emit)))
            bb.emit_func_output(y)
        constants.write_deferred(pending, bb.get()["main"])
    constants.finish_writes()
    ((written, source),) = sources
    assert np.shares_memory(source, w)
    width = linear._panels_of(w)
    np.testing.assert_array_equal(written, w.reshape(96, 512 // width, width).swapaxes(0, 1))


def test_a_bfloat16_constant_is_deferred_and_read_as_its_value(recorder):
    """bfloat16 (ml_dtypes), which numpy's DLPack does not carry, goes through its bits:
    made over untouched memory, read as its value before it is written, then written
    once by a writer thread, as float32 weights are (a bf16 build's weights had each been
    copied twice on the build's own thread: BERT-base's cold build 2.5 -> 2.0 s)."""
    import ml_dtypes

    value = _big().astype(ml_dtypes.bfloat16)
    with constants.deferred() as pending:
        made = constants.tensor_constant(value)
        early = constants.constant(made)
        assert early.dtype == value.dtype
        np.testing.assert_array_equal(early.view(np.uint16), value.view(np.uint16))  # before it is written
        constants.write_deferred(pending, _uses([made]))
    constants.finish_writes()
    assert recorder.written == [value.nbytes]
    assert str(made.value.dtype) == "bfloat16"
    np.testing.assert_array_equal(made.value.numpy().view(np.uint16), value.view(np.uint16))
