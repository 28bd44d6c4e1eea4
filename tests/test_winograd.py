"""3x3 stride-1 float32 convolutions by Winograd's F(4x4, 3x3) (jitbyoc/kernels/winograd.py;
the weight's transform at build time in jitbyoc/tvm/conv_weights.py: winograd_conv).

Results against float64 numpy within the module's stated bound (``winograd.error_bound``),
and against TVM's default build within that bound plus the direct convolution's; which
convolutions take the path; its numpy reference (the algorithm itself in float64) against
direct convolution; AVX2, the C export, batches and a symbolic batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from hypothesis import assume, given, settings, strategies as st
from tvm import relax

import jitbyoc
from jitbyoc.kernels import winograd
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.kernels.slicing import Slice
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, build_tvm, run
from tests.test_kernel_conv import error_bound as direct_bound

F32 = "float32"
RNG = np.random.default_rng(23)


def _model(x_shape, w, padding=(1, 1, 1, 1), residual=False):
    """``relu(conv(x, W) + b [+ r])`` with ``W`` and ``b`` constants (``r`` an input)."""
    bias = RNG.standard_normal((1, w.shape[0], 1, 1)).astype(F32)

    def body(bb, x, *r):
        y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=padding)), relax.const(bias)))
        if r:
            y = bb.emit(relax.op.add(y, r[0]))
        return bb.emit(relax.op.nn.relu(y))

    params = {"x": (x_shape, F32)}
    if residual:
        n, _, h, wd = x_shape
        params["r"] = ((n, w.shape[0], h + padding[0] + padding[2] - 2, wd + padding[1] + padding[3] - 2), F32)
    return build_model(params, body), bias


def _expected(x, w, bias, padding, r=None, tf=winograd.F43):
    """float64 ``conv + b (+ r)`` before the relu, and the bound for jitbyoc's result."""
    y = Conv2d.reference(x.astype(np.float64), w.astype(np.float64), padding=padding) + bias
    if r is not None:
        y = y + r
    u = 2.0 ** -24
    rounding = 3 * u * np.abs(y)  # the bias add, the residual add, the relu is exact
    return y, winograd.error_bound(x, w, padding, tf) + rounding + np.finfo(F32).tiny


def _stage(mod, target="llvm") -> Conv2d:
    with isa.compiling_for(machine_for(tvm.target.Target(target))):
        (region,) = jitbyoc.inspect(mod)
    (stage,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    assert not any(isinstance(s, Slice) for s in region.kernel.stages)  # the weight read in place
    return stage


def _check(x_shape, k, padding=(1, 1, 1, 1), target="llvm", residual=False, tf=None):
    """``tf``: the transform expected, by default the one the map's size picks."""
    w = (RNG.standard_normal((k, x_shape[1], 3, 3)) / np.sqrt(9 * x_shape[1])).astype(F32)
    mod, bias = _model(x_shape, w, padding, residual)
    stage = _stage(mod, target)
    tf = tf or (winograd.F23 if _small(stage.geo) else winograd.F43)
    assert stage.winograd and tuple(stage.inputs[1].shape) == (tf.points ** 2 + 9, k, x_shape[1])
    x = RNG.standard_normal(x_shape).astype(F32)
    args = [x]
    if residual:
        args.append(RNG.standard_normal([int(d) for d in mod["main"].params[1].ty.shape]).astype(F32))
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(target)), tvm.cpu()), *args)
    want, bound = _expected(x, w, bias, padding, args[1] if residual else None, tf)
    err = np.abs(got - np.maximum(want, 0))
    assert np.all(err <= bound), f"max err {err.max()}, at most {bound.flat[np.argmax(err)]} there"
    tvm_got = run(build_tvm(mod), *args)
    both = bound + direct_bound(x, w, dict(padding=padding))
    assert np.all(np.abs(got - tvm_got) <= both), f"max err {np.abs(got - tvm_got).max()} vs TVM"


def _small(geo) -> bool:
    """Whether F(4x4) would cut the map into at most 16 tiles (maps up to 16x16)."""
    return -(-geo.oh // 4) * -(-geo.ow // 4) <= 16


CASES = [  # (x shape, output channels, padding)
    ((1, 16, 9, 13), 16, (1, 1, 1, 1)),
    ((1, 17, 23, 11), 19, (1, 1, 1, 1)),  # ragged tiles, channels off multiples of 16
    ((1, 32, 12, 12), 48, (0, 0, 0, 0)),  # no padding: a 10x10 output
    ((1, 24, 10, 9), 16, (2, 2, 2, 2)),
    ((1, 16, 11, 14), 32, (1, 0, 2, 1)),  # asymmetric
    ((2, 16, 8, 30), 16, (1, 1, 1, 1)),  # a batch; 30 columns: 8 tiles, two vectors of 4 on AVX2
    ((1, 64, 56, 56), 64, (1, 1, 1, 1)),  # ResNet-50's first stage
    ((1, 32, 17, 15), 16, (1, 1, 1, 1)),  # 5 x 4 = 20 tiles of F(4x4), past 16: F(4x4) runs
    ((1, 128, 14, 14), 32, (1, 1, 1, 1)),  # DenseNet's growth layers
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_winograd_matches_float64_within_its_bound_and_tvm(case):
    x_shape, k, padding = CASES[case]
    _check(x_shape, k, padding)


@pytest.mark.parametrize("case", [0, 1, 5])
def test_winograd_with_avx2(case):
    x_shape, k, padding = CASES[case]
    _check(x_shape, k, padding, target={"kind": "llvm", "mcpu": "haswell"})


@pytest.mark.parametrize("case", [0, 1, 3, 4, 5, 7])
@pytest.mark.parametrize("cpu", [None, "haswell"])
def test_f2x2_when_set(monkeypatch, case, cpu):
    """``JITBYOC_WINOGRAD=2``: F(2x2, 3x3), within its own (smaller) bound."""
    monkeypatch.setenv("JITBYOC_WINOGRAD", "2")
    x_shape, k, padding = CASES[case]
    _check(x_shape, k, padding, target={"kind": "llvm", "mcpu": cpu} if cpu else "llvm", tf=winograd.F23)


def test_f2x2_is_the_more_accurate():
    """F(2x2, 3x3)'s bound is below F(4x4, 3x3)'s, a seventh of it in the median (its
    coefficients are 0, 1/2 and 1)."""
    x, w = RNG.standard_normal((1, 32, 16, 16)), RNG.standard_normal((32, 32, 3, 3))
    ratio = winograd.error_bound(x, w, tf=winograd.F23) / winograd.error_bound(x, w, tf=winograd.F43)
    assert ratio.max() < 0.5 and np.median(ratio) < 1 / 5


def _geo(oh, ow):
    return SimpleNamespace(oh=oh, ow=ow)  # what the choice reads of a ConvGeometry


@pytest.mark.parametrize("oh, ow, small", [(14, 14, True), (16, 16, True), (8, 8, True), (13, 13, True),
                                           (17, 16, False), (8, 40, False), (28, 28, False), (56, 56, False)])
def test_maps_of_at_most_16_tiles_run_f2x2_by_default(monkeypatch, oh, ow, small):
    """By default F(2x2) where F(4x4) would cut the map into at most 16 tiles (one vector of
    tiles per product: winograd.SMALL_MAP_TILES); ``JITBYOC_WINOGRAD=4`` keeps F(4x4) there."""
    monkeypatch.delenv("JITBYOC_WINOGRAD", raising=False)
    assert winograd.chosen(_geo(oh, ow)) is (winograd.F23 if small else winograd.F43)
    monkeypatch.setenv("JITBYOC_WINOGRAD", "4")
    assert winograd.chosen(_geo(oh, ow)) is winograd.F43


def test_a_14x14_map_runs_f2x2_in_a_build():
    """The packed weight holds F(2x2)'s 16 rows of U on a 14x14 map, within F(2x2)'s bound."""
    _check((1, 32, 14, 14), 32, tf=winograd.F23)


def test_an_unknown_setting_is_the_default(monkeypatch, caplog):
    monkeypatch.setenv("JITBYOC_WINOGRAD", "3")
    assert winograd.chosen(_geo(28, 28)) is winograd.F43 and winograd.chosen(_geo(14, 14)) is winograd.F23
    assert "JITBYOC_WINOGRAD" in caplog.text


def test_a_residual_add_runs_in_the_output_pass():
    _check((1, 16, 16, 16), 32, residual=True)


def test_a_symbolic_batch():
    w = (RNG.standard_normal((16, 16, 3, 3)) * 0.1).astype(F32)

    def body(bb, x):
        return bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))

    mod = build_model({"x": (("n", 16, 12, 12), F32)}, body)
    assert _stage(mod).winograd
    with jitbyoc.enabled():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for n in (1, 3):
        x = RNG.standard_normal((n, 16, 12, 12)).astype(F32)
        got = run(vm, x)
        want = Conv2d.reference(x.astype(np.float64), w.astype(np.float64), padding=(1, 1, 1, 1))
        assert np.all(np.abs(got - want) <= winograd.error_bound(x, w))


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 16, 16, 16), (16, 16, 3, 3), dict(padding=1, strides=2)),
    ((1, 16, 16, 16), (16, 16, 3, 3), dict(padding=2, dilation=2)),
    ((1, 8, 16, 16), (16, 8, 3, 3), dict(padding=1)),  # too few input channels
    ((1, 64, 7, 7), (64, 64, 3, 3), dict(padding=1)),  # a 7x7 map: 2x2 tiles, 64 % used
    ((1, 16, 16, 16), (16, 16, 5, 5), dict(padding=2)),
    ((1, 16, 16, 16), (16, 8, 3, 3), dict(padding=1, groups=2)),
])
def test_other_convolutions_run_direct(x_shape, w_shape, attrs):
    w = RNG.standard_normal(w_shape).astype(F32)
    mod = build_model({"x": (x_shape, F32)}, lambda bb, x: bb.emit(relax.op.nn.conv2d(x, relax.const(w), **attrs)))
    with isa.compiling_for(machine_for(tvm.target.Target("llvm"))):
        (region,) = jitbyoc.inspect(mod)
    assert not any(getattr(s, "winograd", False) for s in region.kernel.stages)


def test_off_with_the_environment_setting(monkeypatch):
    monkeypatch.setenv("JITBYOC_WINOGRAD", "0")
    w = RNG.standard_normal((16, 16, 3, 3)).astype(F32)
    mod, _ = _model((1, 16, 12, 12), w)
    with isa.compiling_for(machine_for(tvm.target.Target("llvm"))):
        (region,) = jitbyoc.inspect(mod)
    (stage,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    assert not stage.winograd


def test_the_c_export_computes_the_same_convolution(tmp_path):
    """``target="c"`` renders the direct loop nest on the OIHW half of the packed weight."""
    w = (RNG.standard_normal((16, 16, 3, 3)) * 0.2).astype(F32)
    mod, bias = _model((1, 16, 12, 12), w)
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="c")
        assert not jitbyoc.last_report().fallbacks
    ex.export_library(str(tmp_path / "m.so"), options=["-O2"])
    x = RNG.standard_normal((1, 16, 12, 12)).astype(F32)
    got = run(relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "m.so")), tvm.cpu()), x)
    want, _ = _expected(x, w, bias, (1, 1, 1, 1))
    bound = direct_bound(x, w, dict(padding=1)) + 2 * 2.0 ** -24 * np.abs(want)
    assert np.all(np.abs(got - np.maximum(want, 0)) <= bound)


def test_the_transforms_compute_the_convolution():
    """The float64 algorithm (``winograd.reference``) equals direct convolution to float64's
    rounding, for random sizes: the matrices BT, G and AT are right."""
    x = RNG.standard_normal((2, 5, 11, 14))
    w = RNG.standard_normal((3, 5, 3, 3))
    for padding in ((1, 1, 1, 1), (0, 2, 1, 0)):
        want = Conv2d.reference(x, w, padding=padding)
        for tf in (winograd.F43, winograd.F23):
            np.testing.assert_allclose(winograd.reference(x, w, padding, tf), want, rtol=0, atol=1e-12)


SPIN_PROBE = """
import resource, time
import numpy as np
from jitbyoc.kernels import winograd
w = np.random.default_rng(0).standard_normal((256, 256, 3, 3)).astype(np.float32)
winograd.transformed_weight(w, winograd.F43)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
start = cpu()
time.sleep(0.3)
print(cpu() - start)
"""


def test_the_weight_transform_leaves_no_blas_threads_spinning():
    """The build's weight transform keeps numpy's OpenBLAS on one thread: threaded, its
    threads spun on for ~0.1 s after the call (103 ms of CPU while the process slept),
    taking a core from the model's first calls and from the compile workers."""
    threadpoolctl = pytest.importorskip("threadpoolctl")  # the bench extra's: which BLAS numpy runs
    blas = [i["internal_api"] for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    if "openblas" not in blas:
        pytest.skip(f"numpy's BLAS is {blas}, not OpenBLAS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "OMP_"))}
    done = subprocess.run([sys.executable, "-c", SPIN_PROBE], env=env, capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[1])
    assert float(done.stdout) < 0.03, f"{float(done.stdout) * 1e3:.1f} ms of CPU while the process slept"


@settings(max_examples=12, deadline=None)
@given(c=st.integers(16, 40), k=st.integers(16, 40), h=st.integers(6, 21), w=st.integers(6, 37),
       pads=st.tuples(*[st.integers(0, 2)] * 4))
def test_random_shapes(c, k, h, w, pads):
    assume(min(h + pads[0] + pads[2], w + pads[1] + pads[3]) - 2 >= winograd.MIN_MAP)
    _check((1, c, h, w), k, pads)
