"""Constant convolution weights packed at build time into blocks of the engine's output
channels (jitbyoc/tvm/conv_weights.py, kernels/fold_permutes.py: fold_conv_weights).
Each case checks what the packing changes in the region (its weight input, its stages,
the engine variant) and the result against numpy and TVM's default build, on this
machine's ISA and on AVX2 (a different register block, so a different J)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.kernels.conv2d import Conv2d
from jitbyoc.render import isa
from jitbyoc.tvm.conv_weights import pack
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, build_tvm, run
from tests.test_kernel_conv import check
from tests.test_linear_rewrites import _target

RNG = np.random.default_rng(11)
F32 = "float32"


def _conv_model(x_shape, w, attrs, weight=None):
    """``conv(x, W)`` with ``W`` the constant ``w`` (or the expression ``weight``)."""
    op = relax.op.nn.conv1d if len(x_shape) == 3 else relax.op.nn.conv2d

    def body(bb, x):
        wv = relax.const(w) if weight is None else bb.emit(weight)
        return bb.emit(op(x, wv, **attrs))

    return build_model({"x": (x_shape, F32)}, body)


def _conv_stage(mod, machine) -> Conv2d:
    with isa.compiling_for(machine):
        (region,) = jitbyoc.inspect(mod)
    (stage,) = [s for s in region.kernel.stages if isinstance(s, Conv2d)]
    assert [type(s).__name__ for s in region.kernel.stages] == ["Conv2d"], region.kernel.stages
    return stage


CASES = [  # (x shape, w shape, attrs): 3x3 and 7x7/2 stems, groups, conv1d, a batch of 2
    ((1, 8, 20, 20), (32, 8, 3, 3), dict(padding=1)),
    ((2, 3, 29, 29), (48, 3, 7, 7), dict(strides=2, padding=3)),
    ((1, 8, 13, 13), (64, 4, 3, 3), dict(padding=1, groups=2)),
    ((1, 6, 40), (32, 6, 5), dict(padding=2)),
    ((1, 8, 7, 7), (19, 8, 3, 3), dict(padding=1)),  # 19 channels: a padded last block
    ((2, 8, 20, 20), (23, 8, 3, 3), dict(padding=1)),
    ((1, 32, 7, 7), (64, 32, 3, 3), dict(padding=1)),  # small maps: half-width vectors, J = 3
    ((1, 6, 9, 9), (10, 3, 3, 3), dict(padding=1, groups=2)),  # grouped and ragged: OIHW
]


@pytest.mark.parametrize("cpu", [None, "haswell"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_constant_weight_is_packed_in_blocks_of_the_engines_channels(cpu, case):
    """The region takes ``P`` (ceil(K/J), Cin/groups, KH[, KW], J) for the J its plan
    computes together and runs no permute (nor slice) stage whenever J divides each
    group's output channels or there is one group (the last block padded with zeros);
    else it reads OIHW as before."""
    x_shape, w_shape, attrs = CASES[case]
    target = _target(cpu)
    w = (RNG.standard_normal(w_shape) * 0.3).astype(F32)
    mod = _conv_model(x_shape, w, attrs)
    stage = _conv_stage(mod, machine_for(target))
    j, kg = stage.plan.j, stage.geo.kg
    # J = 1 (a plan of single channels: the two-FMA-pipe model's on 19 channels at 7x7)
    # packs nothing: P (K, Cin, KH, KW, 1) is OIHW's bytes, and its unit-axis permute
    # folds away before the region sees it
    assert stage.packed == (kg % j == 0 or stage.geo.groups == 1) or j == 1
    if stage.packed:
        assert tuple(stage.inputs[1].shape) == (-(-w_shape[0] // j), *w_shape[1:], j)
    x = RNG.standard_normal(x_shape).astype(F32)
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), x)
    check(got, x, w, attrs, others=[run(build_tvm(mod), x)])


def test_pack_puts_a_taps_block_of_weights_together():
    w = np.arange(1, 5 * 2 * 3 * 3 + 1).reshape(5, 2, 3, 3)
    p = pack(w, 2)
    assert p.shape == (3, 2, 3, 3, 2)
    assert p[1, 0, 2, 1, 0] == w[2, 0, 2, 1] and p[1, 0, 2, 1, 1] == w[3, 0, 2, 1]
    assert p[2, 1, 0, 2, 0] == w[4, 1, 0, 2] and not p[2, ..., 1].any()  # padding channel


def test_a_weight_packed_for_another_block_stays_a_permute_and_is_right():
    """A weight packed for a J the plan does not use (built for another machine, or by
    hand) is not read in place: the permute stays a stage and the conv reads its OIHW
    result."""
    x_shape, w_shape, attrs = (1, 8, 12, 12), (32, 8, 3, 3), dict(padding=1)
    w = (RNG.standard_normal(w_shape) * 0.3).astype(F32)
    packed = relax.const(np.ascontiguousarray(pack(w, 2)))
    weight = relax.op.reshape(relax.op.permute_dims(packed, [0, 4, 1, 2, 3]), w_shape)
    mod = _conv_model(x_shape, w, attrs, weight=weight)
    with isa.compiling_for(machine_for(_target(None))):
        (region,) = jitbyoc.inspect(mod)
    stages = [type(s).__name__ for s in region.kernel.stages]
    conv = region.kernel.stages[-1]
    assert conv.plan.j != 2 and not conv.packed and "Permute" in stages, stages
    x = RNG.standard_normal(x_shape).astype(F32)
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    check(got, x, w, attrs)


def test_a_weight_that_is_an_input_is_read_as_oihw():
    def body(bb, x, w):
        return bb.emit(relax.op.nn.conv2d(x, w, padding=1))

    mod = build_model({"x": ((1, 8, 12, 12), F32), "w": ((32, 8, 3, 3), F32)}, body)
    (region,) = jitbyoc.inspect(mod)
    (stage,) = region.kernel.stages
    assert not stage.packed and tuple(stage.inputs[1].shape) == (32, 8, 3, 3)


def test_models_that_differ_only_in_weights_share_code():
    x_shape, w_shape, attrs = (1, 8, 12, 12), (32, 8, 3, 3), dict(padding=1)
    names = {jitbyoc.inspect(_conv_model(x_shape, RNG.standard_normal(w_shape).astype(F32), attrs))[0].kernel.name
             for _ in range(2)}
    assert len(names) == 1, names


def test_a_symbolic_batch_reads_the_packed_weight():
    w = (RNG.standard_normal((32, 8, 3, 3)) * 0.3).astype(F32)
    mod = build_model({"x": (("n", 8, 12, 12), F32)},
                      lambda bb, x: bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1)))
    (region,) = jitbyoc.inspect(mod)
    assert [type(s).__name__ for s in region.kernel.stages] == ["Conv2d"] and region.kernel.stages[0].packed
    with jitbyoc.enabled():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for n in (1, 3):
        x = RNG.standard_normal((n, 8, 12, 12)).astype(F32)
        check(run(vm, x), x, w, dict(padding=1))


def test_a_failing_pack_keeps_the_other_rewrites(monkeypatch, caplog):
    """Packing is an optimization: if it fails, the warning says so and batch norm is
    still folded into the conv, which reads its OIHW weight."""
    from jitbyoc.tvm import conv_weights
    from tests.test_inference_rewrites import _conv_bn, _region_ops

    def broken(*_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(conv_weights, "packed_conv", broken)
    mod = build_model({"x": ((1, 5, 15, 13), F32)}, lambda bb, x: _conv_bn(bb, x, 16))
    with caplog.at_level("WARNING", logger="jitbyoc"):
        symbols = _region_ops(mod)
    assert not any("batch_norm" in s or "permute_dims" in s for s in symbols), symbols
    assert "packing the convolution weights" in caplog.text and "boom" in caplog.text
    x = RNG.standard_normal((1, 5, 15, 13)).astype(F32)
    with jitbyoc.enabled():
        got = run(relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), x)
    ref = run(build_tvm(mod), x)
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * float(np.max(np.abs(ref)))
