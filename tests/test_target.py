"""Build targets: jitbyoc compiles for this machine only, so a target naming another
architecture, CPU or feature set is left to TVM whole, with the reason in the report
(before, such builds got this machine's AVX-512 code: SIGILL elsewhere)."""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.tvm.target import host_mismatch
from tests.conftest import build_model, build_tvm, run

HOST_CPU = llvm.get_host_cpu_name()


def _model():
    return build_model({"a": ((4, 16), "float32"), "b": ((16,), "float32")},
                       lambda bb, a, b: bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(a, b)))))


def _target(**attrs):
    return tvm.target.Target({"kind": "llvm", **attrs})


@pytest.mark.parametrize("attrs,mentions", [
    (dict(mcpu="x86-64"), "mcpu=x86-64"),
    (dict(mcpu="haswell"), "mcpu=haswell"),
    (dict(mattr=["-avx512f"]), "-avx512f"),
    (dict(mattr=["+amx-tile"]), "+amx-tile"),
    (dict(mtriple="aarch64-linux-gnu"), "aarch64-linux-gnu"),
])
def test_a_foreign_target_is_named_as_the_reason(attrs, mentions):
    if HOST_CPU == attrs.get("mcpu"):
        pytest.skip("this machine is that CPU")
    why = host_mismatch(_target(**attrs))
    assert why is not None and mentions in why


@pytest.mark.parametrize("attrs", [{}, dict(mcpu=HOST_CPU), dict(mattr=["+avx2"] if "avx2" in
                                   llvm.get_host_cpu_features().flatten() else [])])
def test_this_machine_is_no_mismatch(attrs):
    assert host_mismatch(_target(**attrs)) is None
    assert host_mismatch(None) is None


def test_a_build_for_another_cpu_is_left_to_tvm_and_runs_right():
    mod = _model()
    a, b = np.linspace(-1, 1, 64, dtype="float32").reshape(4, 16), np.ones(16, "float32") * 0.25
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=_target(mcpu="x86-64"))
    rep = jitbyoc.last_report()
    assert rep.regions == [] and rep.fallbacks
    assert all("mcpu=x86-64" in f.reason for f in rep.fallbacks), rep
    got = run(relax.VirtualMachine(ex, tvm.cpu()), a, b)
    np.testing.assert_array_equal(got, run(build_tvm(mod), a, b))


def test_a_build_for_this_cpu_by_name_is_offloaded():
    with jitbyoc.enabled():
        tvm.compile(_model(), target=_target(mcpu=HOST_CPU))
    assert len(jitbyoc.last_report().regions) == 1
