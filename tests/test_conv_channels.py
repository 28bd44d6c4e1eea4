"""The convolution vectorized over output channels (jitbyoc.engines.conv_channels): small
maps with long reductions, 1x1 and k x k, on packed constant weights; against numpy and
TVM's default build, on the host's ISA and AVX2."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import tvm
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.engines import conv_channel_plan, gemm_tiles
from jitbyoc.engines.conv_channel_plan import ChannelPlan
from jitbyoc.engines.conv_plan import Layout, choose_plan
from jitbyoc.kernels import conv2d
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, build_tvm, run
from tests.test_kernel_conv import error_bound, ref_attrs
from tests.test_linear_rewrites import _target

RNG = np.random.default_rng(5)

CASES = [  # (x shape, w shape, attrs), run with channel vectors whatever they cost (_always)
    ((1, 64, 7, 7), (64, 64, 3, 3), {"padding": 1}),
    ((1, 64, 14, 14), (72, 64, 3, 3), {"strides": 2, "padding": 1}),  # 72: a padded last vector
    ((1, 256, 7, 7), (88, 256, 1, 1), {}),  # 1x1 read in place; the last block overlaps
    ((1, 128, 14, 14), (64, 128, 1, 1), {"strides": 2}),  # strided 1x1: packed first
    ((2, 160, 5, 9), (64, 160, 3, 3), {"padding": (1, 2, 1, 0)}),  # two images, uneven pads
    ((1, 128, 7, 7), (96, 128, 3, 3), {"padding": 2, "dilation": 2}),
    ((1, 256, 12), (64, 256, 3), {"padding": 1}),  # conv1d
]
GROUPED = [  # grouped: padded planes, a tile R pixels of one row (ChannelPlan.stride)
    ((1, 64, 14, 14), (64, 16, 3, 3), {"padding": 1, "groups": 4}),  # RegNetY's width-16 groups
    ((1, 96, 13, 11), (96, 32, 3, 3), {"strides": 2, "padding": 1, "groups": 3}),  # 2+ vectors a group
    ((2, 64, 9, 10), (64, 16, 3, 3), {"strides": 2, "padding": (1, 2, 0, 1), "groups": 4}),  # uneven
    ((1, 64, 11, 11), (64, 16, 3, 3), {"padding": 2, "dilation": 2, "groups": 4}),
    ((1, 64, 20, 20), (64, 16, 3, 3), {"padding": 1, "groups": 4}),  # stride 1: bands of rows
    ((1, 64, 9, 9), (64, 32, 3, 3), {"strides": (2, 1), "padding": 1, "groups": 2}),
]
CASES += GROUPED


def _model(x_shape, w, bias, attrs, weight_input=False):
    """``2 * relu(conv(x, W) + b) + x2``: an epilogue that is wrong if a band's runs twice."""
    op = relax.op.nn.conv1d if len(x_shape) == 3 else relax.op.nn.conv2d
    out_shape = _reference(np.zeros(x_shape), np.zeros(w.shape), attrs).shape
    inputs = {"x": (x_shape, w.dtype), "r": (out_shape, w.dtype)}
    if weight_input:
        inputs["w"] = (w.shape, w.dtype)

    def body(bb, x, r, *weight):
        y = bb.emit(op(x, weight[0] if weight else relax.const(w, str(w.dtype)), **attrs))
        y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, relax.const(bias, str(w.dtype))))))
        return bb.emit(relax.op.add(bb.emit(relax.op.multiply(y, relax.const(2.0, str(w.dtype)))), r))

    return build_model(inputs, body), out_shape


def _reference(x, w, attrs):
    return Conv2d.reference(x.astype(np.float64), w.astype(np.float64), **ref_attrs(x.shape, attrs))


AMX = ("amx-tile", "amx-int8", "amx-bf16")


def _vector_target(cpu):
    """``_target(cpu)``, but this machine (None) without AMX where it has it: there these
    products run on tiles (test_units_on_a_machine_with_amx_stay_products_on_tiles)."""
    if cpu or not isa.host().has("amx-tile"):
        return _target(cpu)
    return tvm.target.Target({"kind": "llvm", "mcpu": "native", "mattr": [f"-{f}" for f in AMX]})


def _stage(mod, target) -> Conv2d:
    with isa.compiling_for(machine_for(target)):
        (region,) = jitbyoc.inspect(mod)
    (stage,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    return stage


def _check(mod, target, x, w, bias, res, attrs):
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), *[x, res])
    conv = _reference(x, w, attrs)
    ref = 2 * np.maximum(conv + bias.reshape((-1,) + (1,) * (conv.ndim - 2)), 0) + res
    bound = 2 * error_bound(x, w, attrs, w.dtype) + 4 * np.finfo(w.dtype).eps * np.abs(ref)
    assert np.all(np.abs(got - ref) <= bound), f"max err {np.abs(got - ref).max()} vs numpy"
    tvm_out = run(build_tvm(mod), x, res)
    assert np.all(np.abs(got - tvm_out) <= bound), f"max err {np.abs(got - tvm_out).max()} vs TVM"


def _operands(x_shape, w_shape, attrs, dt="float32"):
    w = (RNG.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dt)
    bias = RNG.standard_normal(w_shape[0]).astype(dt)
    x = RNG.standard_normal(x_shape).astype(dt)
    mod, out_shape = _model(x_shape, w, bias.reshape((1, -1) + (1,) * (len(x_shape) - 2)), attrs)
    return mod, x, w, bias, RNG.standard_normal(out_shape).astype(dt)


def _always(monkeypatch):
    """Channel vectors for every conv they fit, whatever the other paths would cost
    (choices made uncached: none remembered from before, none kept after)."""
    monkeypatch.setattr(conv_channel_plan, "_choose", conv_channel_plan._choose.__wrapped__)
    monkeypatch.setattr(conv_channel_plan, "CHEAPER", collections.defaultdict(lambda: float("inf")))
    monkeypatch.setattr(conv_channel_plan, "gemm_cost", lambda geo, dt: float("inf"))
    monkeypatch.setattr(conv_channel_plan, "grouped_on_channels", lambda geo, dt: True)


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_small_maps_vectorize_over_output_channels(monkeypatch, cpu, case):
    """The region reads the weight packed in blocks of one vector of channels and runs
    the channel engine; results match numpy and TVM, each band's epilogue applied once."""
    _always(monkeypatch)
    x_shape, w_shape, attrs = CASES[case]
    target = _target(cpu)
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs)
    stage = _stage(mod, target)
    assert isinstance(stage.plan, ChannelPlan) and stage.packed, stage.plan
    lanes = stage.plan.lanes
    assert tuple(stage.inputs[1].shape) == (-(-w_shape[0] // lanes), *w_shape[1:], lanes)
    assert (stage.plan.stride != (0, 0)) == (attrs.get("groups", 1) > 1)
    _check(mod, target, x, w, bias, res, attrs)


@pytest.mark.parametrize("shape, stride, groups, expected", [
    ((320, 14), 1, 20, True), ((784, 14), 2, 49, True), ((784, 7), 1, 49, True), ((64, 112), 2, 4, True),
    ((144, 28), 1, 9, False), ((256, 56), 1, 4, False),  # wider than a vector, unit stride: pixel engine
    ((96, 14), 1, 24, False),  # groups of 4 channels: not whole vectors
])
def test_grouped_convs_choose_channel_vectors_where_measured_faster(shape, stride, groups, expected):
    """Measured on Zen 4 (see conv_channel_plan.grouped_on_channels): strided grouped 3x3
    convs, and those on maps at most a vector wide, on padded planes."""
    c, h = shape
    oh = (h - 1) // stride + 1
    geo = conv2d.ConvGeometry(1, c, h, h, c, 3, 3, (stride, stride), (1, 1), (1, 1, 1, 1), groups, oh, oh)
    with isa.compiling_for(machine_for(_target(None))):
        plan = conv2d.engine_plan(geo, "float32")
        units = [conv2d.engine_plan(geo, dt) for dt in ("bfloat16", "uint8")]  # measured slower there
    assert isinstance(plan, ChannelPlan) == expected, plan
    assert not any(isinstance(p, ChannelPlan) for p in units)
    if expected:
        assert plan.stride == (stride, stride) and plan.layout.planes == 1


def test_float64(monkeypatch):
    _always(monkeypatch)
    x_shape, w_shape, attrs = CASES[0]
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs, "float64")
    assert isinstance(_stage(mod, _target(None)).plan, ChannelPlan)
    _check(mod, "llvm", x, w, bias, res, attrs)


@pytest.mark.parametrize("case", [0, 2, 3])
def test_a_weight_that_is_an_input_runs_on_the_other_engines(monkeypatch, case):
    """Without a constant weight to pack, a k x k conv runs the pixel engine's fallback
    plan (in the same workspace) and a 1x1 the GEMM engine."""
    _always(monkeypatch)
    x_shape, w_shape, attrs = CASES[case]
    w = RNG.standard_normal(w_shape).astype("float32") / 8
    bias = RNG.standard_normal(w_shape[0]).astype("float32")
    mod, out_shape = _model(x_shape, w, bias.reshape(1, -1, 1, 1), attrs, weight_input=True)
    stage = _stage(mod, _target(None))
    assert isinstance(stage.plan, ChannelPlan) and not stage.packed
    x, res = RNG.standard_normal(x_shape).astype("float32"), RNG.standard_normal(out_shape).astype("float32")
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x, res, w)
    np.testing.assert_allclose(got, run(build_tvm(mod), x, res, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, channels, expected", [
    ((1, 512, 7, 7), 2048, True),  # 49 pixels fill 49 of 64 GEMM lanes
    ((1, 512, 13, 13), 64, True),  # the GEMM's 3 chunks on 2 cores
    ((1, 128, 28, 28), 512, False),  # a short reduction: the transposed store does not pay
    ((1, 64, 56, 56), 256, False),  # under MIN_REDUCTION
    ((1, 512, 7, 7), 32, False),  # under MIN_VECTORS
    ((1, 48, 1, 1), 1152, True),  # squeeze-and-excitation: 1 pixel, one lane of the GEMM's 16
    ((1, 1152, 1, 1), 48, True),  # ... and its squeeze, under MIN_VECTORS
    ((1, 20, 3, 3), 8, True),  # 9 pixels, 8 channels
    ((1, 20, 4, 4), 480, False),  # 16 pixels fill a vector: a short reduction does not pay
])
def test_pointwise_convs_choose_by_the_estimates(shape, channels, expected):
    """Measured on Zen 4 (see conv_channel_plan.choose): channel vectors where they won."""
    geo = conv2d.ConvGeometry(1, shape[1], shape[2], shape[3], channels, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0), 1,
                              shape[2], shape[3])
    with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))):
        assert isinstance(conv2d.engine_plan(geo, "float32"), ChannelPlan) == expected


@pytest.mark.parametrize("c, h, k, expected", [
    (480, 13, 64, False), (512, 13, 112, False), (384, 13, 64, False),  # Inception v1, SqueezeNet
    (768, 7, 128, False),  # DenseNet-121's bottlenecks
    (512, 13, 160, True), (832, 6, 384, True),  # Inception v1's
    (2048, 7, 512, True), (512, 7, 2048, True),  # ResNet-50's
])
def test_bfloat16_pointwise_convs_pay_for_packing_their_pairs(c, h, k, expected):
    """A bfloat16 1x1 packs its input into pairs (float32 reads it in place): charged 1.2
    cycles an element (conv_channel_plan.POINTWISE_PACK_CYCLES), the channel engine keeps
    only the 1x1s where it measured faster than the GEMM engine (Zen 4, 2 threads:
    0.68-0.95x the time where it now gives way, 0.77-0.95x where it stays); float32's
    choices of the same shapes stay on channel vectors."""
    geo = conv2d.ConvGeometry(1, c, h, h, k, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0), 1, h, h)
    with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))):
        assert isinstance(conv2d.engine_plan(geo, "bfloat16"), ChannelPlan) == expected
        assert isinstance(conv2d.engine_plan(geo, "float32"), ChannelPlan)


@pytest.mark.parametrize("c, h, k, kh, stride, pad, intel", [
    (128, 56, 128, 3, 2, 1, True), (128, 28, 160, 3, 2, 1, True), (96, 54, 256, 5, 2, 0, True),  # strided
    (3, 224, 64, 7, 2, 3, False), (3, 224, 96, 11, 4, 2, False),  # stems: 3 input channels
])
def test_strided_convs_choose_channel_vectors_on_two_fma_pipes(c, h, k, kh, stride, pad, intel):
    """On Intel's two-pipe cores the channel engine takes what costs no more than the
    pixel engine (conv_channel_plan.CHEAPER: measured 0.66-0.81x the time on these three
    strided convs, 1.25-1.36x on the stems); Zen 4 keeps its 0.9 margin and the pixel
    engine for all five."""
    o = (h + 2 * pad - kh) // stride + 1
    geo = conv2d.ConvGeometry(1, c, h, h, k, kh, kh, (stride, stride), (1, 1), (pad,) * 4, 1, o, o)
    chosen = {}
    for cpu in ("znver4", "emeraldrapids"):
        with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))):
            chosen[cpu] = isinstance(conv2d.engine_plan(geo, "float32"), ChannelPlan)
    assert chosen == {"znver4": False, "emeraldrapids": intel}


SQUEEZE_EXCITE = [  # maps of fewer pixels than a vector has lanes, short reductions, few channels
    ((1, 48, 1, 1), (1152, 48, 1, 1), {}),  # EfficientNet-B0's excitation
    ((1, 1152, 1, 1), (48, 1152, 1, 1), {}),  # ... and its squeeze
    ((1, 64, 1, 1), (8, 64, 1, 1), {}),  # RegNetY's first: 8 channels, half a vector
    ((2, 20, 1, 1), (36, 20, 1, 1), {}),  # two images; 36 channels: a padded last vector
    ((1, 24, 1, 3), (40, 24, 1, 1), {}),  # 3 pixels (fewer than AVX2 float64 lanes)
    ((1, 6, 1, 5), (17, 6, 1, 1), {"strides": (1, 2)}),  # strided: packed first
]


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("case", range(len(SQUEEZE_EXCITE)))
def test_squeeze_excite_products_on_channel_vectors(monkeypatch, cpu, dt, case):
    """1x1 convolutions of maps smaller than a vector (squeeze-and-excitation blocks),
    whatever their reduction and channel count, fit the channel engine (the estimates
    then choose it for 1x1 maps: the GEMM engine's vectors of pixels held one pixel of
    16, and EfficientNet's 48->1152 took 29 us, 7.5 on channel vectors) and match numpy
    and TVM."""
    _always(monkeypatch)
    x_shape, w_shape, attrs = SQUEEZE_EXCITE[case]
    target = _target(cpu)
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs, dt)
    stage = _stage(mod, target)
    assert isinstance(stage.plan, ChannelPlan) and stage.packed, stage.plan
    _check(mod, target, x, w, bias, res, attrs)


@settings(max_examples=12, deadline=None)
@given(st.integers(8, 40), st.integers(1, 9), st.integers(1, 9), st.integers(1, 70), st.sampled_from([1, 3]),
       st.integers(1, 2), st.integers(1, 16), st.integers(1, 4), st.integers(1, 9), st.sampled_from([None, "haswell"]),
       st.sampled_from([(1, 1), (2, 1), (3, 96), (8, 96)]))
@example(8, 3, 2, 1, 1, 1, 3, 1, 1, None, (8, 96))  # bands of 4 and 2 pixels, tiles of 3: the last starts a band early
def test_forced_tiles_cover_every_output_once(c, h, w, k, ksize, stride, r, v, rows, cpu, blocking):
    """Any tile (R pixels x V vectors), band height, group of tiles and block of input
    channels the engine can be handed: tiles and channel blocks clamped at the ends of
    bands and channels recompute, never store twice what another task owns, and every
    output is written (a block of 1 KiB of weights holds one or two input channels)."""
    attrs = {"strides": stride, "padding": ksize // 2}
    x_shape, w_shape = (1, c * 4, h, w), (k, c * 4, ksize, ksize)
    mod, x, wt, bias, res = _operands(x_shape, w_shape, attrs)
    target = _target(cpu)

    def forced(geo, dt):
        lanes = isa.vector_bits() // 32
        rows_ = min(geo.oh, max(rows, -(-min(r, geo.oh * geo.ow) // geo.ow)))
        fallback = None if geo.pointwise else choose_plan(geo, dt)
        vv = min(v, -(-geo.k // lanes), (isa.vector_registers() - 2) // (min(r, geo.oh * geo.ow) + 1))
        return ChannelPlan(Layout(geo, True), lanes, min(r, geo.oh * geo.ow, rows_ * geo.ow), max(1, vv),
                           fallback, rows_, *blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conv_channel_plan, "choose", forced)
        assert isinstance(_stage(mod, target).plan, ChannelPlan)
        _check(mod, target, x, wt, bias, res, attrs)


@pytest.mark.parametrize("case", [0, 2, 4])
def test_blocks_of_input_channels_keep_the_sums_in_order(monkeypatch, case):
    """Tiles computed in groups, a block of input channels at a time, give the bits of
    one tile after another over all channels (the order of the sums is kept): groups of
    2 tiles and blocks of 1 KiB of weights (one or two channels) against groups of one
    tile and a block larger than any layer."""
    _always(monkeypatch)
    x_shape, w_shape, attrs = CASES[case]
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs)
    plan = _stage(mod, _target(None)).plan
    outs = []
    for group, kib in ((1, 1 << 20), (2, 1)):
        blocked = dataclasses.replace(plan, group=group, block_kib=kib)
        monkeypatch.setattr(conv_channel_plan, "choose", lambda geo, dt, p=blocked: p)
        with jitbyoc.enabled():
            outs.append(run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x, res))
    np.testing.assert_array_equal(outs[1], outs[0])
    _check(mod, "llvm", x, w, bias, res, attrs)


@pytest.mark.parametrize("case", [0, 2])
def test_c_export_reads_the_same_packed_weight(monkeypatch, case, tmp_path):
    """With target "c" the region's C nest indexes the weight in the channel engine's
    blocks of one vector (88 channels: a padded last block)."""
    from tests.test_c_export import _exported

    _always(monkeypatch)
    x_shape, w_shape, attrs = CASES[case]
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs)
    stage = _stage(mod, _target(None))
    assert isinstance(stage.plan, ChannelPlan) and stage.packed
    vm, report = _exported(mod, tmp_path / "conv.so")
    assert report.regions and not report.fallbacks, str(report)
    conv = _reference(x, w, attrs)
    want = 2 * np.maximum(conv + bias.reshape(-1, 1, 1), 0) + res
    np.testing.assert_allclose(run(vm, x, res), want, rtol=1e-4, atol=1e-4)


def test_c_export_of_bfloat16_pairs_reads_the_same_packed_weight(monkeypatch, tmp_path):
    """With target "c" a bf16 region on channel vectors indexes its weight in blocks of
    one vector of pairs, widening exactly: within the bf16 bound of TVM's build."""
    from tests.test_c_export import _exported

    _always(monkeypatch)
    vectors = machine_for(_vector_target(None))  # target "c" builds for this machine
    monkeypatch.setattr(isa, "host", lambda: vectors)
    x_shape, w_shape, attrs = BF16_CASES[1]
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs)
    mod = jitbyoc.lower_precision(mod)
    stage = _stage(mod, _target(None))
    assert isinstance(stage.plan, ChannelPlan) and stage.packed and stage.inputs[0].dtype == "bfloat16"
    vm, report = _exported(mod, tmp_path / "conv.so")
    assert report.regions and not report.fallbacks, str(report)
    ref = run(build_tvm(mod), x, res)
    assert np.abs(run(vm, x, res) - ref).max() <= _bf16_bound(x, w, ref)


@pytest.mark.parametrize("w_shape, attrs", [((64, 96, 3, 3), {"padding": 1}), ((80, 256, 1, 1), {})])
def test_a_symbolic_batch(monkeypatch, w_shape, attrs):
    """Images are tasks counted at run time: 1 and 3 images of one build."""
    from tests.test_kernel_conv import check

    _always(monkeypatch)
    w = (RNG.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype("float32")
    mod = build_model({"x": (("n", w_shape[1], 7, 7), "float32")},
                      lambda bb, x: bb.emit(relax.op.nn.conv2d(x, relax.const(w), **attrs)))
    stage = _stage(mod, _target(None))
    assert isinstance(stage.plan, ChannelPlan) and stage.packed
    with jitbyoc.enabled():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for n in (1, 3):
        x = RNG.standard_normal((n, w_shape[1], 7, 7)).astype("float32")
        check(run(vm, x), x, w, attrs)


def _bf16_bound(x, w, ref):
    """The bf16 convolution's bound (twice float32's summation bound for the bfloat16
    roundings) through :func:`_model`'s epilogue ``2 * relu(conv + b) + r``."""
    from tests.test_bfloat16 import _conv_bound

    return 2 * _conv_bound(x, w, 1) + 4 * 2.0 ** -24 * np.abs(ref).max()


BF16_CASES = [*(CASES[i] for i in (0, 1, 2, 3, 4, 5)),  # 1x1s: their units packed, never read in place
              ((1, 66, 7, 7), (72, 66, 3, 3), {"padding": 1}),  # 33 pairs, 72 channels: a padded last vector
              *GROUPED[:3]]


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("case", range(len(BF16_CASES)))
def test_bfloat16_pairs_on_channel_vectors(monkeypatch, cpu, case):
    """``jitbyoc.lower_precision``'s convolutions of small maps run on channel vectors of
    bfloat16 pairs (``vdpbf16ps``, or its exact two-FMA form on AVX2), the weight packed
    in blocks of one vector of pairs: the same bits as the pixel engine, which sums in the
    same order (channel pair, then tap; a 1x1 otherwise runs on the GEMM engine), and
    within the bf16 bound of TVM's build."""
    _always(monkeypatch)
    x_shape, w_shape, attrs = BF16_CASES[case]
    target = _vector_target(cpu)
    mod, x, w, bias, res = _operands(x_shape, w_shape, attrs)
    with isa.compiling_for(machine_for(target)):
        mod = jitbyoc.lower_precision(mod)
    stage = _stage(mod, target)
    assert isinstance(stage.plan, ChannelPlan) and stage.packed and stage.inputs[0].dtype == "bfloat16"
    lanes = stage.plan.lanes
    assert tuple(stage.inputs[1].shape) == (-(-w_shape[0] // lanes), -(-w_shape[1] // 2), *w_shape[2:], lanes, 2)
    outs = []
    for choose in (conv_channel_plan.choose, lambda geo, dt: None):  # then the pixel engine
        monkeypatch.setattr(conv_channel_plan, "choose", choose)
        with jitbyoc.enabled():
            outs.append(run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x, res))
    if w_shape[2:] != (1, 1):
        np.testing.assert_array_equal(outs[0], outs[1])
    assert not stage.plan.direct
    ref = run(build_tvm(mod), x, res)
    assert np.abs(outs[0] - ref).max() <= _bf16_bound(x, w, ref)


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 128, 7, 7), (64, 128, 3, 3), {"padding": 1}),
    ((1, 64, 14, 14), (72, 64, 3, 3), {"strides": 2, "padding": 1}),  # 72: a padded last vector
    ((2, 36, 5, 9), (64, 36, 3, 3), {"padding": (1, 2, 1, 0)}),  # two images, 9 quads
    *GROUPED[:4],
])
def test_int8_quads_on_channel_vectors(monkeypatch, cpu, x_shape, w_shape, attrs):
    """uint8 x int8 convolutions of small maps on channel vectors of quads (``vpdpbusd``,
    or exact int32 steps on AVX2), not gathered into columns: exact, as TVM's build."""
    _always(monkeypatch)
    target = _vector_target(cpu)
    w = RNG.integers(-128, 128, w_shape).astype("int8")
    x = RNG.integers(0, 256, x_shape).astype("uint8")
    mod = build_model({"x": (x_shape, "uint8")}, lambda bb, x: bb.emit(
        relax.op.nn.conv2d(x, relax.const(w), **attrs, out_dtype="int32")))
    stage = _stage(mod, target)
    assert isinstance(stage.plan, ChannelPlan) and stage.packed
    assert tuple(stage.inputs[1].shape) == (-(-w_shape[0] // stage.plan.lanes), w_shape[1] // 4, *w_shape[2:],
                                            stage.plan.lanes, 4)
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x)
    np.testing.assert_array_equal(got, run(build_tvm(mod), x))


@pytest.mark.parametrize("dt", ["bfloat16", "uint8"])
def test_units_on_a_machine_with_amx_stay_products_on_tiles(dt):
    """With AMX a small map's bf16 or int8 convolution is one product on tiles
    (ConvGeometry.columns), not channel vectors; without, channel vectors (an int8 one
    had been gathered into columns there too)."""
    for cpu, tiles in (("sapphirerapids", True), ("znver4", False)):
        with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))):
            geo = conv2d.ConvGeometry(1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1, 7, 7,
                                      dt == "uint8", gemm_tiles.has_tiles(dt))
            assert geo.tiles == tiles and (geo.columns or not tiles)
            assert isinstance(conv2d.engine_plan(geo, dt), ChannelPlan) != tiles


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "uint8"])
def test_vectors_are_one_register_of_the_machine(dt):
    """A tile's vectors of channels are one register of sums: 8 lanes with AVX2 (the
    register count of the tile assumes it), 16 with AVX-512, whatever the product."""
    geo = conv2d.ConvGeometry(1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1, 7, 7)
    for cpu, lanes in (("haswell", 8), ("znver4", 16)):
        with isa.compiling_for(machine_for(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))):
            assert conv_channel_plan.choose(geo, dt).lanes == lanes


@pytest.mark.parametrize("pointwise", [1, 0])
def test_a_groups_first_pass_reads_the_next_blocks_weights_ahead(pointwise):
    """Each tile of a group's first pass prefetches a share of the next block's weights
    into L2 (the first tile of a block waited for them from memory: 3x3 512 on 7x7 with
    cold weights 0.91x the time with it); the existing tests cover that values do not
    change (blocks of 1 KiB: a prefetch per step, past the weight's end too)."""
    import re

    from jitbyoc.engines import ir_text
    from jitbyoc.engines.conv_channels import ChannelEngine
    from tests.test_gemm_prefetch import READ_INTO_L2

    text = ir_text(ChannelEngine("float32", 16, 7, 2, 1 - pointwise, pointwise), isa.current().triple, "")
    assert re.search(READ_INTO_L2, text)


def test_a_weight_block_and_a_groups_sums_fit_the_first_level_cache():
    """A block of input channels' weights is read by every tile of a group from L1 (96
    KiB blocks came from L2: ResNet-50 1.03x the time of 16 KiB on Zen 5); the group's
    saved sums (the most accumulators a tile holds in 32 registers, 28, of 64 bytes)
    share that cache with it."""
    most_held = max(r * v for r in range(1, conv_channel_plan.MAX_R + 1)
                    for v in range(1, conv_channel_plan.MAX_V + 1) if r * v + v + 2 <= 32)
    sums = conv_channel_plan.TILE_GROUP * most_held * 64
    assert conv_channel_plan.WEIGHT_BLOCK_KIB * 1024 + sums <= conv_channel_plan.L1_BYTES
