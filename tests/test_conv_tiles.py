"""The direct convolution on AMX tiles (jitbyoc.engines.conv_tiles): the input packed once
(a plane per kernel column where the rows are aligned, else the grid), the weight packed
tile by tile at build time, every tap read where it lies, C in the tiles across the
whole window, the epilogue run on each block's sums. bfloat16 within float32's summation
bound of the bfloat16 roundings (against float64), int8 equal to numpy's integer sum and
TVM's build. Built for a Sapphire Rapids target anywhere (the IR is inspected); run where
the machine has AMX."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from hypothesis import given, settings, strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.engines import conv_tiles
from jitbyoc.kernels import conv_panels
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.kernels.layout import Permute
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, call_region
from tests.diff_util import CC
from tests.test_c_renderer import c_and_jit
from tests.test_conv_panels import _bound, _conv_stage, _reference, symbolic_batch
from tests.test_tiles import SAPPHIRE, _conv_model, _run, on_tiles

R = relax.op
BF16 = ml_dtypes.bfloat16
# (input shape, output channels, kernel, stride, padding, dilation, aligned layout): the
# aligned layout in one band and in seven (a batch of two), the grid (7x7, 5x5: a last
# block of one pixel on half the tiles; 9x9, 8x8: 16 columns would waste more than 1.25x
# the grid's 11 and 9), 48 and 16 output channels (a last block on half the tiles), 112
# channels padded to 128, stride 2, dilation 2, a 5x5 window, an odd map
GEOMETRIES = [((1, 128, 14, 14), 64, 3, 1, 1, 1, True), ((2, 96, 28, 28), 32, 3, 1, 1, 1, True),
              ((1, 128, 7, 7), 48, 3, 1, 1, 1, False), ((1, 96, 5, 5), 32, 3, 1, 1, 1, False),
              ((1, 112, 9, 9), 16, 3, 1, 1, 1, False), ((1, 128, 16, 16), 32, 3, 2, 1, 1, False),
              ((1, 96, 12, 12), 32, 3, 1, 2, 2, True), ((1, 96, 10, 10), 32, 5, 1, 2, 1, True),
              ((1, 96, 11, 13), 80, 3, 1, 0, 1, True)]


def _bf16_model(shape, w, stride, pad, dilation, tail=None):
    def body(bb, x):
        y = bb.emit(R.nn.conv2d(x, relax.const(w), strides=stride, padding=pad, dilation=dilation))
        return tail(bb, y) if tail else y
    with isa.compiling_for(machine_for(tvm.target.Target(SAPPHIRE))):  # the machine's choices
        return jitbyoc.lower_precision(build_model({"x": (shape, "float32")}, body))


def _direct_stage(mod):
    """The region's conv, checked to run on the direct engine: its weight packed tile by
    tile and read in place (no permute left), no panels."""
    with isa.compiling_for(machine_for(tvm.target.Target(SAPPHIRE))):
        (region,) = [r for r in jitbyoc.inspect(mod) if any(isinstance(s, Conv2d) for s in r.kernel.stages)]
        (conv,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]  # all for the AMX machine
        assert conv.tap_major and conv.work is None and not any(isinstance(s, Permute) for s in region.kernel.stages)
        assert tuple(conv.inputs[1].shape) == conv_panels.tile_shape(conv.geo, conv.inputs[1].dtype)
        assert f"jitbyoc_lib_tileconv_{conv.inputs[0].dtype}" in region.llvm_ir
    return region, conv


@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation, aligned", GEOMETRIES)
def test_bfloat16_convolutions_run_on_the_direct_engine(shape, k, kernel, stride, pad, dilation, aligned):
    w = np.ones((k, shape[1], kernel, kernel), np.float32)
    _, conv = _direct_stage(_bf16_model(shape, w, stride, pad, dilation))
    assert conv_tiles.layout(conv.geo).dense == aligned


@pytest.mark.parametrize("shape, k, stride, dt", [
    ((1, 128, 14, 14), 64, 1, "int8"), ((1, 512, 7, 7), 64, 1, "int8"), ((1, 128, 40, 40), 32, 2, "bfloat16"),
    ((1, 64, 14, 14), 32, 1, "bfloat16"), ((1, 128, 14, 14), 40, 1, "bfloat16")])
def test_what_stays_on_the_gathered_product(shape, k, stride, dt):
    """int8 with two blocks of 16 quads a tap, or on the grid (a 7x7 map); a strided conv
    on a large map; bf16 with two blocks of 16 pairs a tap (64 channels); 40 output
    channels (not whole tiles of 16): gathered into panels as before, the weight
    tap-major."""
    rng = np.random.default_rng(0)
    if dt == "int8":
        mod = _conv_model(shape, rng.integers(-128, 128, (k, shape[1], 3, 3)).astype("int8"), stride, 1)
    else:
        mod = _bf16_model(shape, rng.standard_normal((k, shape[1], 3, 3)).astype(np.float32), stride, 1, 1)
    _, conv = _conv_stage(mod)
    assert tuple(conv.inputs[1].shape) == (k, 3, 3, shape[1])


@on_tiles
@pytest.mark.parametrize("shape, k, kernel, stride, pad, dilation, aligned", GEOMETRIES)
def test_bfloat16_direct_convolutions_sum_in_float32(shape, k, kernel, stride, pad, dilation, aligned):
    rng = np.random.default_rng(shape[1] * k + kernel)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((k, shape[1], kernel, kernel)).astype(np.float32)
    got = _run(_bf16_model(shape, w, stride, pad, dilation), x)
    np.testing.assert_allclose(got, _reference(x, w, stride, pad, dilation), rtol=0, atol=_bound(x, w))


@on_tiles
def test_the_epilogue_runs_on_each_blocks_sums():
    """bias + residual + relu, stored as float32 and as its bfloat16 cast (a residual
    block's tail: two stores), straight from the blocks' scratch: equal to TVM's build of
    the same module within the bound, the bfloat16 store the float32 one's cast."""
    rng = np.random.default_rng(5)
    shape, k = (2, 128, 14, 14), 128
    w = rng.standard_normal((k, 128, 3, 3)).astype(np.float32)
    bias = rng.standard_normal((1, k, 1, 1)).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)

    def body(bb, v):
        y = bb.emit(R.nn.conv2d(v, relax.const(w), padding=1))
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.add(y, relax.const(bias))), v))))
        return [y, bb.emit(R.astype(y, "bfloat16"))]

    mod = jitbyoc.lower_precision(build_model({"x": (shape, "float32")}, body))
    _direct_stage(mod)
    with jitbyoc.enabled():
        f = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]
    got32, got16 = (t.numpy() for t in f(tvm.runtime.tensor(x)))
    want = np.maximum(_reference(x, w, 1, 1, 1) + bias + x, 0)
    np.testing.assert_allclose(got32, want, rtol=0, atol=_bound(x, w) + 1e-5)
    np.testing.assert_array_equal(got16, got32.astype(BF16))


@on_tiles
@pytest.mark.parametrize("shape, k", [((1, 256, 14, 14), 32), ((2, 320, 9, 11), 48)])
def test_int8_direct_convolutions_are_exact(shape, k):
    """uint8 pixels times int8 weights on the direct engine (256 channels: four blocks of
    16 quads a tap; 320 padded to 384): equal to numpy's integer sum and TVM's build."""
    rng = np.random.default_rng(k)
    x = rng.integers(0, 256, shape).astype("uint8")
    w = rng.integers(-128, 128, (k, shape[1], 3, 3)).astype("int8")
    mod = _conv_model(shape, w, 1, 1)
    _direct_stage(mod)
    got = _run(mod, x)
    np.testing.assert_array_equal(got, Conv2d.reference(x.astype(np.int64), w.astype(np.int64), (1, 1), (1,) * 4))
    want = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, want)


@on_tiles
def test_a_symbolic_batch_of_direct_convolutions():
    symbolic_batch(96, 14, 32, _direct_stage)


@on_tiles
@settings(max_examples=12, deadline=None)
@given(c=st.sampled_from([32, 64, 96, 128, 160]), k=st.sampled_from([16, 32, 48, 64]), size=st.integers(2, 21),
       kernel=st.sampled_from([2, 3, 5]), stride=st.integers(1, 2), pad=st.integers(0, 2),
       dilation=st.integers(1, 2), batch=st.integers(1, 2))
def test_random_bfloat16_convolutions_on_the_direct_engine(c, k, size, kernel, stride, pad, dilation, batch):
    """Any map from two pixels up, windows of 2 to 5 (dilated), strides 1 and 2, padding:
    whichever engine the geometry picks, the bound holds."""
    if size + 2 * pad < dilation * (kernel - 1) + 1:
        return
    rng = np.random.default_rng(c * k + size)
    x = rng.standard_normal((batch, c, size, size)).astype(np.float32)
    w = rng.standard_normal((k, c, kernel, kernel)).astype(np.float32)
    got = _run(_bf16_model(x.shape, w, stride, pad, dilation), x)
    np.testing.assert_allclose(got, _reference(x, w, stride, pad, dilation), rtol=0, atol=_bound(x, w))


@on_tiles
@pytest.mark.skipif(CC is None, reason="no C compiler (cc) on PATH")
def test_c_rendering_reads_the_tile_packed_weight(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 96, 3, 3)).astype(np.float32)
    region, _ = _direct_stage(_bf16_model((1, 96, 9, 9), w, 1, 1, 1))
    c_fn, jit_fn = c_and_jit(region, tmp_path)
    x = rng.standard_normal((1, 96, 9, 9)).astype(np.float32)
    packed = conv_panels.tile_packed(w.transpose(0, 2, 3, 1).astype(BF16))
    args = [x if tuple(b.shape) == x.shape else packed for b in region.kernel.inputs]
    (got,), (want,) = call_region(c_fn, region.kernel, args), call_region(jit_fn, region.kernel, args)
    assert np.abs(got - want).max() <= _bound(x, w)
