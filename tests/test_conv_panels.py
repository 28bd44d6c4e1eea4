"""Convolutions on AMX tiles gathered straight into the product's panels
(jitbyoc.kernels.conv_panels): the weight packed tap-major at build time, no gathered
matrix and no permute left in the region; int8 results equal to TVM's build and numpy's
(integer sums are exact), bfloat16 within float32's summation bound of the bfloat16
roundings. Built for a Sapphire Rapids target anywhere (the IR is inspected); run where
the machine has AMX."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from hypothesis import given, settings, strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.kernels.layout import Permute
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, call_region
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit
from tests.test_tiles import SAPPHIRE, _conv_model, _run, on_tiles

R = relax.op
BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24
# (input shape, output channels, kernel, stride, padding, dilation): both ways of gathering
# (more pixels than channels: inside the product's blocks; fewer: whole panels first),
# strides, dilation, a 5x5, an odd map, a batch, a strided 1x1, channels padded to whole
# units (a stem's 3); channel counts the direct engine leaves here (tests/test_conv_tiles.py)
GEOMETRIES = [((1, 48, 20, 20), 64, 3, 1, 1, 1), ((1, 32, 6, 6), 96, 3, 1, 1, 1),
              ((2, 16, 15, 13), 24, 3, 2, 1, 1), ((1, 24, 12, 12), 40, 3, 1, 2, 2),
              ((1, 8, 17, 17), 16, 5, 1, 2, 1), ((2, 48, 7, 7), 128, 3, 1, 1, 1),
              ((1, 32, 14, 14), 48, 1, 2, 0, 1), ((1, 3, 29, 29), 16, 7, 2, 3, 1), ((1, 5, 9, 9), 70, 3, 1, 1, 1)]


def _bf16_model(shape, w, stride, pad, dilation):
    with isa.compiling_for(machine_for(tvm.target.Target(SAPPHIRE))):
        return jitbyoc.lower_precision(build_model({"x": (shape, "float32")}, lambda bb, x: bb.emit(
        R.nn.conv2d(x, relax.const(w), strides=stride, padding=pad, dilation=dilation))))


def _conv_stage(mod):
    """The region's conv, checked to read its weight tap-major with no permute beside it."""
    with isa.compiling_for(machine_for(tvm.target.Target(SAPPHIRE))):
        (region,) = [r for r in jitbyoc.inspect(mod) if any(isinstance(s, Conv2d) for s in r.kernel.stages)]
        region.llvm_ir  # noqa: B018  rendered for the AMX machine, not the host
    (conv,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    assert conv.tap_major and not any(isinstance(s, Permute) for s in region.kernel.stages)
    return region, conv


def _reference(x, w, stride, pad, dilation):
    """The convolution of the bfloat16 roundings, summed in float64."""
    x, w = (v.astype(BF16).astype(np.float64) for v in (x, w))
    return Conv2d.reference(x, w, (stride,) * 2, (pad,) * 4, (dilation,) * 2)


def _bound(x, w):
    """Twice float32's summation bound for K products of the bfloat16 roundings."""
    k = w[0].size
    a, b = (np.abs(v.astype(BF16).astype(np.float64)).max() for v in (x, w))
    return 2 * k * U / (1 - k * U) * k * a * b + 1e-6


@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation", GEOMETRIES)
def test_a_bfloat16_convolution_reads_its_weight_tap_major(shape, k, kernel, stride, pad, dilation):
    rng = np.random.default_rng(shape[1] * k)
    w = rng.standard_normal((k, shape[1], kernel, kernel)).astype(np.float32)
    region, conv = _conv_stage(_bf16_model(shape, w, stride, pad, dilation))
    units = -(-shape[1] // 2) * 2  # channels padded to whole bfloat16 pairs
    want = (k, shape[1], 1, 1) if kernel == 1 and units == shape[1] else (k, kernel, kernel, units)
    assert tuple(conv.inputs[1].shape) == want
    pixels = conv.geo.oh * conv.geo.ow
    assert (conv.work is not None) == (k > pixels)  # whole panels only where split along channels
    assert "jitbyoc_lib_tiles_bfloat16" in region.llvm_ir


@on_tiles
@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation", GEOMETRIES)
def test_bfloat16_convolutions_gathered_into_panels_sum_in_float32(shape, k, kernel, stride, pad, dilation):
    rng = np.random.default_rng(shape[1] + k)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((k, shape[1], kernel, kernel)).astype(np.float32)
    got = _run(_bf16_model(shape, w, stride, pad, dilation), x)
    np.testing.assert_allclose(got, _reference(x, w, stride, pad, dilation), rtol=0, atol=_bound(x, w))


@on_tiles
@pytest.mark.parametrize("shape, k, kernel, stride, pad", [
    ((1, 64, 20, 20), 64, 3, 1, 1), ((1, 32, 7, 7), 96, 3, 1, 1), ((2, 48, 15, 13), 24, 3, 2, 1),
    ((1, 16, 17, 17), 16, 5, 1, 2), ((1, 64, 14, 14), 48, 1, 2, 0), ((1, 16, 13, 13), 32, 3, 1, 1),
    ((1, 3, 29, 29), 64, 3, 2, 0), ((1, 3, 23, 23), 64, 7, 2, 3), ((2, 1, 12, 12), 8, 3, 1, 1), ((1, 2, 9, 9), 40, 3, 1, 1)])
def test_int8_convolutions_gathered_into_panels_are_exact(shape, k, kernel, stride, pad):
    """uint8 pixels times int8 weights (on tiles with whole quads of channels, SqueezeNet's
    16 by 3x3 among them, or fewer than a quad padded to one: the stems of SqueezeNet and
    ResNet-50): equal to TVM's build and to numpy's integer sum."""
    rng = np.random.default_rng(k * kernel)
    x = rng.integers(0, 256, shape).astype("uint8")
    w = rng.integers(-128, 128, (k, shape[1], kernel, kernel)).astype("int8")
    mod = _conv_model(shape, w, stride, pad)
    _conv_stage(mod)
    got = _run(mod, x)
    want = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, want)
    exact = Conv2d.reference(x.astype(np.int64), w.astype(np.int64), (stride,) * 2, (pad,) * 4)
    np.testing.assert_array_equal(got, exact)


@on_tiles
@settings(max_examples=12, deadline=None)
@given(c=st.sampled_from([2, 3, 4, 5, 6, 32]), k=st.integers(1, 70), size=st.integers(1, 19), kernel=st.sampled_from([2, 3]),
       stride=st.integers(1, 3), pad=st.integers(0, 2), batch=st.integers(1, 2))
def test_random_bfloat16_convolutions_on_panels(c, k, size, kernel, stride, pad, batch):
    """Maps of one pixel to a few panels, channel counts from one unit up (whole or
    padded; one channel stays float32: precision.MIN_CHANNELS), any stride."""
    if size + 2 * pad < kernel:
        return
    rng = np.random.default_rng(c * k + size)
    x = rng.standard_normal((batch, c, size, size)).astype(np.float32)
    w = rng.standard_normal((k, c, kernel, kernel)).astype(np.float32)
    got = _run(_bf16_model(x.shape, w, stride, pad, 1), x)
    np.testing.assert_allclose(got, _reference(x, w, stride, pad, 1), rtol=0, atol=_bound(x, w))


@on_tiles
@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
@pytest.mark.parametrize("kernel, stride, pad", [(3, 1, 1), (1, 2, 0)])
def test_c_rendering_of_a_tap_major_convolution(tmp_path, kernel, stride, pad):
    """The C nest reads the tap-major weight (a strided 1x1's as it lies): the same sums
    as the tiles, within the bound."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 16, kernel, kernel)).astype(np.float32)
    region, conv = _conv_stage(_bf16_model((1, 16, 9, 9), w, stride, pad, 1))
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    packed = w.transpose(0, 2, 3, 1).astype(BF16)  # for a 1x1 the same elements as OIHW
    args = [x if tuple(b.shape) == x.shape else packed.reshape(b.shape) for b in region.kernel.inputs]
    (got,), (want,) = call_region(c_fn, region.kernel, args), call_region(jit_fn, region.kernel, args)
    assert np.abs(got - want).max() <= _bound(x, w)


@on_tiles
@pytest.mark.parametrize("c, size, k", [(16, 12, 16), (32, 5, 96)])
def test_a_symbolic_batch_of_tap_major_convolutions(c, size, k):
    """One build for every batch size, gathered in the product's blocks (16 channels on
    12x12) or as whole panels per image (96 on 5x5)."""
    symbolic_batch(c, size, k, _conv_stage)


def symbolic_batch(c, size, k, check):
    """A conv of ``c`` channels on ``size x size`` to ``k`` built once for a symbolic batch
    (its region's conv checked by ``check``), run on batches of 1 and 3."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, c, size, size], "float32"))
    rng = np.random.default_rng(c)
    w = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(R.nn.conv2d(x, relax.const(w), padding=1)))
        bb.emit_func_output(out)
    mod = jitbyoc.lower_precision(bb.get())
    check(mod)
    with jitbyoc.enabled():
        f = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]
    for batch in (1, 3):
        xs = rng.standard_normal((batch, c, size, size)).astype(np.float32)
        got = f(tvm.runtime.tensor(xs)).numpy()
        np.testing.assert_allclose(got, _reference(xs, w, 1, 1, 1), rtol=0, atol=_bound(xs, w))


@pytest.mark.parametrize("shape, k, kernel, stride, units", [
    ((1, 3, 29, 29), 64, 7, 2, True), ((1, 8, 17, 17), 16, 3, 1, True), ((1, 64, 20, 20), 64, 3, 1, False),
    ((1, 32, 14, 14), 48, 1, 2, False)])
def test_a_stem_gathers_from_unit_planes(shape, k, kernel, stride, units):
    """A convolution of one or two units a tap (a stem's 3 channels, 8 int8 channels)
    packs its input into zero-padded unit planes once and gathers from them; one of many
    units a tap, or of a single tap, gathers from the channels themselves."""
    rng = np.random.default_rng(1)
    w = rng.integers(-128, 128, (k, shape[1], kernel, kernel)).astype("int8")
    _, conv = _conv_stage(_conv_model(shape, w, stride, kernel // 2))
    assert (conv.units is not None) == units
    if units:
        assert "_units" in conv.units.name and conv.units.dtype == "int32"


@on_tiles
@settings(max_examples=16, deadline=None)
@given(c=st.integers(1, 8), k=st.integers(1, 40), size=st.integers(1, 21), kernel=st.sampled_from([2, 3, 5, 7]),
       stride=st.integers(1, 4), pad=st.integers(0, 3), batch=st.integers(1, 2))
def test_random_int8_stems_on_unit_planes_are_exact(c, k, size, kernel, stride, pad, batch):
    """Stems of one or two quads a tap, any stride the planes read as wide vectors,
    padding wider than the window's reach, maps of one pixel up: numpy's integer sum."""
    if size + 2 * pad < kernel:
        return
    rng = np.random.default_rng(c * k + size)
    x = rng.integers(0, 256, (batch, c, size, size)).astype("uint8")
    w = rng.integers(-128, 128, (k, c, kernel, kernel)).astype("int8")
    got = _run(_conv_model(x.shape, w, stride, pad), x)
    exact = Conv2d.reference(x.astype(np.int64), w.astype(np.int64), (stride,) * 2, (pad,) * 4)
    np.testing.assert_array_equal(got, exact)


@on_tiles
def test_a_symbolic_batch_of_stems_on_unit_planes():
    """A stem's unit planes per image of a batch known at run time only: each image's
    planes, and its slack, where its gather reads them."""
    rng = np.random.default_rng(4)
    w = rng.integers(-128, 128, (16, 3, 7, 7)).astype("int8")
    mod = build_model({"x": (("n", 3, 23, 23), "uint8")}, lambda bb, x: bb.emit(
        R.nn.conv2d(x, relax.const(w), strides=2, padding=3, out_dtype="int32")))
    (region,) = jitbyoc.inspect(mod)
    (conv,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    assert conv.units is not None and isinstance(conv.units.shape[0], str)
    for n in (1, 3):
        x = rng.integers(0, 256, (n, 3, 23, 23)).astype("uint8")
        exact = Conv2d.reference(x.astype(np.int64), w.astype(np.int64), (2, 2), (3,) * 4)
        np.testing.assert_array_equal(_run(mod, x), exact)
