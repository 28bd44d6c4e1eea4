"""Depthwise convolutions (jitbyoc/kernels/depthwise_llvm.py): against TVM's default build
and the float64 numpy reference, over strides 1-4 (5 takes the general engine), dilation,
uneven padding, widths spanning several vector blocks, float64, fused epilogues and a
symbolic batch (tolerance: tests/test_kernel_conv.check)."""

import re

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels import depthwise_llvm
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_both, build_model
from tests.spatial_util import build, grid_model, random_inputs, run
from tests.test_kernel_conv import cases, check, conv

# (x shape, w shape, attrs): groups = channels in every case
DEPTHWISE = [
    ((1, 16, 14, 14), (16, 1, 3, 3), dict(padding=(1, 1, 1, 1), groups=16)),
    ((2, 5, 7, 7), (5, 1, 5, 5), dict(padding=(2, 2, 2, 2), groups=5)),
    ((1, 3, 37, 35), (3, 1, 3, 3), dict(strides=(2, 2), padding=(1, 1, 1, 1), groups=3)),
    ((1, 4, 23, 40), (4, 1, 3, 3), dict(strides=(3, 3), padding=(0, 2, 1, 0), groups=4)),
    ((1, 2, 19, 33), (2, 1, 2, 4), dict(strides=(4, 4), padding=(1, 3, 0, 1), groups=2)),
    ((1, 3, 21, 21), (3, 1, 3, 3), dict(strides=(5, 5), groups=3)),  # general engine
    ((1, 6, 17, 18), (6, 1, 3, 3), dict(dilation=(2, 3), padding=(2, 3, 2, 3), groups=6)),
    ((1, 7, 9, 70), (7, 1, 7, 7), dict(padding=(3, 3, 3, 3), groups=7)),  # ConvNeXt-style 7x7
    ((1, 2, 3, 3), (2, 1, 5, 5), dict(padding=(2, 2, 2, 2), groups=2)),  # window > image
    ((1, 2, 6, 6), (2, 1, 3, 3), dict(padding=(4, 4, 4, 4), groups=2)),  # all-padding rows
    ((3, 8, 1, 29), (8, 1, 1, 5), dict(strides=(1, 2), padding=(0, 2, 0, 2), groups=8)),
]


def test_which_convolutions_take_the_depthwise_path():
    from jitbyoc.kernels.conv2d import ConvGeometry
    geo = ConvGeometry(1, 8, 9, 9, 8, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 8, 9, 9)
    assert depthwise_llvm.fits(geo, "float32") and depthwise_llvm.fits(geo, "float64")
    assert not depthwise_llvm.fits(geo, "int32")
    multiplier = ConvGeometry(1, 8, 9, 9, 16, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 8, 9, 9)
    assert not depthwise_llvm.fits(multiplier, "float32")
    wide_stride = ConvGeometry(1, 8, 9, 9, 8, 3, 3, (1, 5), (1, 1), (0, 0, 0, 0), 8, 7, 2)
    assert not depthwise_llvm.fits(wide_stride, "float32")


def test_byte_depthwise_takes_the_depthwise_path_while_float32_holds_its_sums():
    """uint8 x int8 (a quantized model's) sums run in float32, exact below 2**24: kernels
    up to 22 x 22 (484 taps of 255 * 128 at most); 23 x 23 stays with the engine."""
    from jitbyoc.kernels.conv2d import ConvGeometry
    for k, taken in ((3, True), (5, True), (22, True), (23, False)):
        geo = ConvGeometry(1, 8, 30, 30, 8, k, k, (1, 1), (1, 1), (0, 0, 0, 0), 8, 31 - k, 31 - k)
        assert depthwise_llvm.fits(geo, "uint8") is taken and depthwise_llvm.fits(geo, "int8") is taken


# the grid's shapes, and kernels at and past the exact bound (their extreme sums below)
BYTE_DEPTHWISE = DEPTHWISE + [((1, 2, 24, 25), (2, 1, 22, 22), dict(padding=(1, 1, 1, 1), groups=2)),
                              ((1, 2, 24, 25), (2, 1, 23, 23), dict(groups=2))]


@pytest.mark.parametrize("xdt,wdt", [("uint8", "int8"), ("int8", "uint8")])
def test_byte_depthwise_equals_tvm_bit_for_bit(xdt, wdt):
    """int32 sums of byte products, as a quantized model's depthwise layers make them:
    equal to TVM's to the bit, with random bytes and with the extremes (every product
    255 * -128 or -128 * 255: the largest sums), and no conv engine called."""
    params = {f"{n}{k}": (shape, dt) for k, (xs, ws, _) in enumerate(BYTE_DEPTHWISE)
              for n, shape, dt in (("x", xs, xdt), ("w", ws, wdt))}

    def body(bb, *args):
        return [bb.emit(relax.op.nn.conv2d(x, w, out_dtype="int32", **attrs))
                for (x, w), (_, _, attrs) in zip(zip(args[::2], args[1::2]), BYTE_DEPTHWISE)]

    mod = build_model(params, body)
    engine = [r for r in jitbyoc.inspect(mod) if any("conv" in e for e in r.engines)]
    assert len(engine) == 2, "only the stride-5 and the 23 x 23 convolutions take the engine"
    builds = build_both(mod)
    rng = np.random.default_rng(11)
    lo, hi = ((int(np.iinfo(d).min), int(np.iinfo(d).max)) for d in (xdt, wdt))
    random = [rng.integers(*(lo if n[0] == "x" else hi), size=shape, endpoint=True).astype(dt)
              for n, (shape, dt) in params.items()]
    extreme = [np.full(shape, (lo[1] if xdt == "uint8" else lo[0]) if n[0] == "x" else
                       (hi[0] if wdt == "int8" else hi[1]), dt) for n, (shape, dt) in params.items()]
    for arrays in (random, extreme):
        want, got = builds.run(*arrays)
        for k, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"case {k}: {BYTE_DEPTHWISE[k]}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_depthwise_grid_matches_tvm_and_numpy(dtype):
    cs = cases(DEPTHWISE, dtype)
    mod = grid_model(cs, conv)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    for k, (_, attrs) in enumerate(cs):
        check(got[k], args[2 * k], args[2 * k + 1], attrs, [ref[k]])


def test_depthwise_with_a_fused_epilogue_and_a_symbolic_batch():
    def body(bb, x, w, bias):
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1, groups=12))
        return bb.emit(relax.op.clip(bb.emit(relax.op.add(y, bias)), 0.0, 6.0))  # ReLU6

    mod = build_model({"x": (("n", 12, 20, 19), "float32"), "w": ((12, 1, 3, 3), "float32"),
                       "b": ((1, 12, 1, 1), "float32")}, body)
    (region,) = jitbyoc.inspect(mod)
    assert not any("conv" in e for e in region.engines), "the general conv engine was called"
    builds = build_both(mod)
    rng = np.random.default_rng(5)
    for n in (1, 3):
        x, w, b = (rng.standard_normal(s).astype("float32") for s in ((n, 12, 20, 19), (12, 1, 3, 3), (1, 12, 1, 1)))
        want, got = builds.run(x, w, b)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_depthwise_convs(data):
    c = data.draw(st.integers(1, 6))
    kh, kw = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    sh, sw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    dh, dw = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    pad = tuple(data.draw(st.integers(0, 3)) for _ in range(4))
    h = data.draw(st.integers(max(1, dh * (kh - 1) + 1 - pad[0] - pad[2]), 20))
    w = data.draw(st.integers(max(1, dw * (kw - 1) + 1 - pad[1] - pad[3]), 40))
    cs = cases([((1, c, h, w), (c, 1, kh, kw), dict(strides=(sh, sw), dilation=(dh, dw), padding=pad, groups=c))])
    mod = grid_model(cs, conv)
    args = random_inputs(cs)
    got, ref = run(build(mod, True), args), run(build(mod, False), args)
    check(got[0], *args, cs[0][1], [ref[0]])


@pytest.mark.parametrize("k, row_major", [(3, True), (5, False)])
def test_small_windows_compute_a_plane_row_by_row(k, row_major):
    """Up to ``ROW_MAJOR_TAPS`` taps a plane is computed row by row, every column block of
    a row before the next (one ``oh`` loop a plane); larger windows column block by column
    block (one ``oh`` loop per block: their weights take the registers). Three blocks of
    16 columns here on AVX-512."""
    assert (k * k <= depthwise_llvm.ROW_MAJOR_TAPS) is row_major
    w = np.ones((8, 1, k, k), np.float32)
    mod = build_model({"x": ((1, 8, 12, 40), "float32")}, lambda bb, x: bb.emit(
        relax.op.nn.conv2d(x, relax.const(w), padding=k // 2, groups=8)))
    with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))):
        (region,) = jitbyoc.inspect(mod)
        text = region.llvm_ir
    assert len(re.findall(r"^oh\.body(\.\d+)?:", text, re.M)) == (1 if row_major else 3)
