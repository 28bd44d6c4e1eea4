"""C export (issue 15): with ``target="c"`` jitbyoc's regions go into the build as C source
(one translation unit: the prelude, each distinct code once, an entry per region), so
``export_library`` compiles the whole model with the user's C compiler. Before, a ``"c"``
build offloaded nothing. Checked against the LLVM path and TVM's own build, compiled as
C++ (TVM's default g++) and as C (gcc)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from tests.conftest import build_model, build_tvm, run

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None,
                                reason="C export needs gcc and g++")
FLAGS = ["-O2", "-ffp-contract=off"]


def _model():
    """conv + relu (one region), then a symbolic-row matmul + softmax and an elementwise
    tail (more regions, a library engine in the LLVM path, a symbolic size)."""
    def body(bb, x, w, m, y):
        h = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
        t = bb.emit(relax.op.nn.softmax(relax.op.matmul(relax.op.reshape(h, (16, 64)), m)))
        return [t, bb.emit(relax.op.tanh(relax.op.add(y, relax.const(0.5, "float32"))))]
    return build_model({"x": ((1, 4, 8, 8), "float32"), "w": ((16, 4, 3, 3), "float32"),
                        "m": ((64, 24), "float32"), "y": (("n", 5), "float32")}, body)


def _inputs(n=3):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype("float32") for s in ((1, 4, 8, 8), (16, 4, 3, 3), (64, 24), (n, 5))]


def _exported(mod, path, compiler="g++"):
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="c")
        report = jitbyoc.last_report()
    ex.export_library(str(path), cc=compiler, options=FLAGS)
    return relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu()), report


@pytest.mark.parametrize("compiler", ["g++", "gcc"])
def test_a_c_build_offloads_and_matches_the_llvm_path_and_tvm(compiler, tmp_path):
    mod, args = _model(), _inputs()
    vm, report = _exported(mod, tmp_path / "model.so", compiler)
    assert len(report.regions) >= 2 and not report.fallbacks, str(report)
    got = run(vm, *args)
    with jitbyoc.enabled():
        llvm_path = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), *args)
    for c, j, t in zip(got, llvm_path, run(build_tvm(mod), *args)):
        np.testing.assert_allclose(c, j, rtol=2e-5, atol=1e-6)  # FMA vs mul+add, through exp
        np.testing.assert_allclose(c, t, rtol=2e-5, atol=1e-6)


def test_the_exported_regions_check_their_arguments_naming_region_and_argument(tmp_path):
    with jitbyoc.enabled():
        ex = tvm.compile(_model(), target="c")
        region = next(r for r in jitbyoc.last_report().regions if any(i.startswith("m:") for i in r.inputs))
    ex.export_library(str(tmp_path / "model.so"), options=FLAGS)
    fn = tvm.runtime.load_module(str(tmp_path / "model.so")).get_function(region.symbol, query_imports=True)
    args = [np.zeros((16, 64), "float32"), np.zeros((65, 24), "float32"), np.zeros((3, 5), "float32"),
            np.zeros((), "float32"), np.zeros((16, 24), "float32"), np.zeros((3, 5), "float32")]
    with pytest.raises(ValueError, match=rf"{region.symbol}.*'m'.*64.*65|{region.symbol}.*'m'.*65.*64"):
        fn(*[tvm.runtime.tensor(a) for a in args])


def test_the_c_source_is_one_unit_with_each_code_once():
    """Two identical layers share one compute function in the C unit (one code, two entries)."""
    from jitbyoc.toolchain.c_entry import emit_c_unit
    from jitbyoc.tvm import partition
    from jitbyoc.tvm.codegen import region_of

    mod = build_model({"a": ((4, 8), "float32"), "b": ((4, 8), "float32")}, lambda bb, a, b: [
        bb.emit(relax.op.nn.relu(a)), bb.emit(relax.op.sigmoid(bb.emit(relax.op.negative(b))))])
    regions = [region_of(f) for f in partition.regions(partition.partition_for_jitbyoc(mod)).values()]
    twice = regions + [regions[0]]
    unit = emit_c_unit(twice)
    assert unit.count("#include <math.h>") == 1
    assert unit.count(f"static int32_t {regions[0].kernel.name}_compute(") == 1


def test_a_batched_product_with_symbolic_rows_exports_right(tmp_path):
    """The C product split its flat row index by the symbolic row count without
    parentheses (``gr / INT64_C(1) * sym0``): every batched product with a symbolic M
    was wrong in the C export."""
    mod = build_model({"q": ((1, 4, "s", 16), "float32"), "k": ((1, 4, 16, "s"), "float32")},
                      lambda bb, q, k: bb.emit(relax.op.matmul(q, k)))
    vm, _ = _exported(mod, tmp_path / "product.so", "gcc")
    rng = np.random.default_rng(1)
    for s in (1, 23):
        args = [rng.standard_normal((1, 4, s, 16)).astype("float32"), rng.standard_normal((1, 4, 16, s)).astype("float32")]
        np.testing.assert_allclose(run(vm, *args), np.matmul(*args), rtol=1e-5, atol=1e-5)


def test_constant_weights_packed_in_panels_export_right(tmp_path):
    """A linear layer's constant weight packed into the engine's panels, and a projection
    split into heads (jitbyoc/tvm/linear.py): the C rendering reads the panels through
    the same layout and matches numpy."""
    rng = np.random.default_rng(5)
    w, bias = rng.standard_normal((128, 40)).astype("float32"), rng.standard_normal(128).astype("float32")
    x = rng.standard_normal((6, 40)).astype("float32")
    projected = x @ w.T + bias

    def linear(bb, v):
        weight = bb.emit(relax.op.permute_dims(relax.const(w)))
        return bb.emit(relax.op.add(bb.emit(relax.op.matmul(v, weight)), relax.const(bias)))

    def heads(bb, v):
        return bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(linear(bb, v), (1, 6, 2, 64))), [0, 2, 1, 3]))

    cases = {"linear": (lambda bb, v: bb.emit(relax.op.nn.relu(linear(bb, v))), np.maximum(projected, 0)),
             "heads": (heads, np.transpose(projected.reshape(1, 6, 2, 64), (0, 2, 1, 3)))}
    for name, (body, want) in cases.items():
        vm, report = _exported(build_model({"x": ((6, 40), "float32")}, body), tmp_path / f"{name}.so")
        assert report.regions and not report.fallbacks, str(report)
        np.testing.assert_allclose(run(vm, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [32, 19])
def test_a_conv_weight_packed_in_channel_blocks_exports_right(k, tmp_path):
    """A conv's constant weight packed into blocks of the engine's output channels
    (jitbyoc/tvm/conv_weights.py; 19 channels: a padded last block): the C rendering
    indexes the same blocks."""
    from jitbyoc.kernels.conv2d import Conv2d

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((k, 5, 3, 3)) * 0.3).astype("float32")
    x = rng.standard_normal((1, 5, 11, 9)).astype("float32")
    mod = build_model({"x": ((1, 5, 11, 9), "float32")},
                      lambda bb, v: bb.emit(relax.op.nn.conv2d(v, relax.const(w), strides=(1, 2), padding=1)))
    (region,) = jitbyoc.inspect(mod)
    assert [type(s).__name__ for s in region.kernel.stages] == ["Conv2d"] and region.kernel.stages[0].packed
    vm, report = _exported(mod, tmp_path / "conv.so")
    assert report.regions and not report.fallbacks, str(report)
    want = Conv2d.reference(x.astype(np.float64), w.astype(np.float64), strides=(1, 2), padding=(1, 1, 1, 1))
    np.testing.assert_allclose(run(vm, x), want, rtol=1e-5, atol=1e-5)


def _wrapping_model():
    """Integer arithmetic at the edges of its type, compared after it, and half-precision
    libm calls (found by a review helper's fuzzer of the C rendering)."""
    def body(bb, i32, i16, u16, h):
        r = relax.op
        one = relax.const(1, "int32")
        return [bb.emit(r.greater(r.add(i32, one), i32)),                      # INT_MAX + 1 wraps
                bb.emit(r.less(r.subtract(i32, one), i32)),                     # INT_MIN - 1 wraps
                bb.emit(r.greater(r.multiply(i32, relax.const(2, "int32")), i32)),
                bb.emit(r.floor_mod(i16, relax.const(3, "int16"))),             # not through float16
                bb.emit(r.floor_mod(u16, relax.const(7, "uint16"))),
                bb.emit(r.multiply(u16, u16)),                                   # 65535 * 65535 in int
                bb.emit(r.negative(i32)),
                bb.emit(r.mod(h, relax.const(0.75, "float16"))),                 # fmod(_Float16): C++
                bb.emit(r.abs(h))]
    return build_model({"i32": ((6,), "int32"), "i16": ((6,), "int16"), "u16": ((6,), "uint16"),
                        "h": ((6,), "float16")}, body)


@pytest.mark.parametrize("compiler", ["g++", "gcc"])
def test_integers_wrap_and_half_libm_calls_compile_in_the_c_rendering(compiler, tmp_path):
    """The C rendering wrapped nothing: ``x + 1 > x`` at INT_MAX was true (signed overflow
    is undefined in C, and gcc -O2 folds the compare), and 65535 * 65535 as uint16 overflowed
    int; int16 floor_mod went through float16 (-10657 mod 3 gave -1); float16 mod and abs
    called fmod/fabs on _Float16, ambiguous overloads for g++, TVM's default compiler."""
    mod = _wrapping_model()
    args = [np.array([2**31 - 1, -2**31, -5, 7, 2**30, 0], "int32"),
            np.array([-10657, -13685, -5483, -9, 100, 7], "int16"),
            np.array([65535, 40000, 3, 0, 255, 7], "uint16"),
            np.array([-2.5, -0.75, 1.5, 3.25, -0.0, 7.0], "float16")]
    vm, report = _exported(mod, tmp_path / "ints.so", compiler)
    assert not report.fallbacks, str(report)
    want = run(build_tvm(mod), *args)
    for got, ref in zip(run(vm, *args), want):
        np.testing.assert_array_equal(got, ref)
    assert want[0].tolist() == [False] + [True] * 5 and want[3][0] == 2  # the edges the test is about
