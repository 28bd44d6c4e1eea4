"""Build targets: jitbyoc compiles for the machine the TVM target names (its triple, CPU
and features), and its kernels follow that machine's vector ISA. Before, every build got
this machine's AVX-512 code (SIGILL elsewhere), and an AArch64 build an x86-64 object.

The ISA checks disassemble jitbyoc's objects in ``export_library``'s tar: no zmm register
in an AVX2 build, no ymm or zmm in a baseline x86-64 one, AArch64 ELF objects for an
AArch64 triple. x86 builds for other CPUs run here (this CPU runs their code) and are
checked against TVM's own build. The AArch64 export is not executed: that needs an AArch64
TVM runtime under qemu-aarch64, which this test environment does not have.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile

import llvmlite.binding as llvm
import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from jitbyoc.render.optimization import GLUE
from jitbyoc.toolchain import cache, cpu_check, jit
from jitbyoc.render import isa
from jitbyoc.tvm.target import machine_for
from tests.conftest import build_model, build_tvm, run

HOST = isa.host()
EM_X86_64, EM_AARCH64 = 62, 183


def _target(**attrs):
    return tvm.target.Target({"kind": "llvm", **attrs})


def _model():
    """A conv, a 3x3/2 max pool, a matrix product and a softmax (library engines, vector
    kernels and region glue)."""
    def body(bb, x, w, m):
        h = bb.emit(relax.op.nn.max_pool2d(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)), 3, 2, 1))
        return bb.emit(relax.op.nn.softmax(relax.op.matmul(relax.op.reshape(h, (16, 36)), m)))
    return build_model({"x": ((1, 8, 12, 12), "float32"), "w": ((16, 8, 3, 3), "float32"),
                        "m": ((36, 40), "float32")}, body)


def _inputs():
    rng = np.random.default_rng(0)
    x, w, m = (rng.standard_normal(s).astype("float32") for s in ((1, 8, 12, 12), (16, 8, 3, 3), (36, 40)))
    return [x, w, m * np.float32(0.05)]  # logits of a few units: softmax does not amplify rounding


@pytest.mark.parametrize("attrs,arch,bits,registers", [
    (dict(mcpu="haswell"), "x86_64", 256, 16),
    (dict(mcpu="x86-64"), "x86_64", 128, 16),
    (dict(mcpu="x86-64", mattr=["+avx2", "+fma"]), "x86_64", 256, 16),
    (dict(mcpu="skylake-avx512"), "x86_64", 512, 32),
    (dict(mtriple="aarch64-linux-gnu"), "aarch64", 128, 32),
    (dict(mtriple="aarch64-linux-gnu", mcpu="neoverse-n1"), "aarch64", 128, 32),
])
def test_the_machine_follows_the_target(attrs, arch, bits, registers):
    m = machine_for(_target(**attrs))
    assert m.arch == arch and m.cpu == attrs.get("mcpu", "generic")
    assert (isa.vector_bits(m), isa.vector_registers(m)) == (bits, registers)
    if "haswell" in attrs.values():
        assert m.has("avx2") and m.has("fma") and not m.has("avx512f")


@pytest.mark.parametrize("attrs", [{}, dict(mcpu="native"), dict(mcpu="host"), dict(mtriple=HOST.triple)])
def test_plain_llvm_means_this_machine(attrs):
    assert machine_for(_target(**attrs)) == HOST
    assert machine_for(None) == HOST


@pytest.mark.parametrize("cpu", ["native", "host"])
def test_this_machine_less_a_feature_keeps_every_other_feature_it_has(cpu):
    """``mcpu=native`` with ``mattr`` starts from the host's features, not from LLVM's model
    of the CPU it names: a Xeon with AMX under KVM is "rocketlake", whose model has neither
    AMX nor AVX512_BF16, and taking AMX away took AVX512_BF16 with it."""
    host = {f[1:] for f in HOST.features.split(",") if f.startswith("+")}
    gone = "sha" if "sha" in host else "aes"  # features no other feature implies
    m = machine_for(_target(mcpu=cpu, mattr=[f"-{gone}"]))
    assert not m.has(gone) and m.cpu == HOST.cpu
    kept = {f for f in host if m.has(f)}
    assert kept == host - {gone}, sorted(host - kept)


def test_the_peak_yardstick_of_a_target_without_fma_multiplies_and_adds():
    """jitbyoc.peak's loop on SSE-only x86-64: a multiply and an add per lane, not llvm.fma's
    libm call per lane (which measured 1.6 GFLOP/s, and % of peak read 30 times too high)."""
    from jitbyoc import peak
    from jitbyoc.toolchain import jit

    generic = machine_for(_target(mcpu="x86-64"))
    with isa.compiling_for(generic):
        module = llvm.parse_assembly(peak._peak_ir(peak.lanes()))
        asm = jit.target_machine(generic).emit_assembly(module)
    assert "fma" not in asm and "call" not in asm
    assert "mulps" in asm and "addps" in asm


def test_another_architecture_is_left_to_tvm_with_the_reason():
    why = machine_for(_target(mtriple="riscv64-unknown-linux-gnu"))
    assert isinstance(why, str) and "riscv64" in why


def test_the_machine_is_part_of_every_cache_key():
    haswell = machine_for(_target(mcpu="haswell"))
    with isa.compiling_for(haswell):
        other = cache.key("same material")
    assert cache.key("same material") != other


def test_a_conv_plan_follows_the_register_file_of_the_build_that_asks():
    """The plan was remembered per geometry only: after an AVX-512 build, a build for
    AVX2 in the same process got the AVX-512 register block (spills, half speed)."""
    from jitbyoc.engines import conv_plan
    from jitbyoc.kernels.conv2d import ConvGeometry

    geo = ConvGeometry(n=4, c=32, h=32, w=32, k=64, kh=3, kw=3, stride=(1, 1), dilation=(1, 1),
                       pad=(1, 1, 1, 1), groups=1, oh=32, ow=32)
    with isa.compiling_for(machine_for(_target(mcpu="znver4"))):
        wide = conv_plan.choose_plan(geo, "float32")
    with isa.compiling_for(machine_for(_target(mcpu="haswell"))):
        plan = conv_plan.choose_plan(geo, "float32")
        per_vector = plan.lanes * 32 // isa.vector_bits()
        assert (plan.j + 1) * plan.v * per_vector <= isa.vector_registers() - 1, (wide, plan)


_SCALAR_LOOP = """
define void @scale(ptr noalias %a, ptr noalias %b, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %next, %loop ]
  %pa = getelementptr float, ptr %a, i64 %i
  %x = load float, ptr %pa
  %y = fmul float %x, 2.0
  %pb = getelementptr float, ptr %b, i64 %i
  store float %y, ptr %pb
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %n
  br i1 %more, label %loop, label %done
done:
  ret void
}
"""


@pytest.mark.parametrize("cpu", ["sapphirerapids", "icelake-server", "znver4"])
def test_the_loop_vectorizer_fills_512_bit_registers_on_avx512_cpus(cpu):
    """LLVM's Intel AVX-512 models prefer 256-bit vectors (ymm), which the loop vectorizer
    then picks beside jitbyoc's 512-bit kernels; the tuning is turned off for every x86
    build (fails with it on: ymm only for Sapphire Rapids and Ice Lake)."""
    asm = jit.compile_to_assembly(_SCALAR_LOOP, GLUE, machine_for(_target(mcpu=cpu)))
    assert "zmm" in asm


def _elf_machine(path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


def _jitbyoc_objects(ex, tmp_path):
    ex.export_library(str(tmp_path / "lib.tar"))
    with tarfile.open(tmp_path / "lib.tar") as tf:
        tf.extractall(tmp_path, filter="data")
    objs = [p for p in tmp_path.glob("*.o") if b"jitbyoc_lib_" in p.read_bytes()]
    assert objs, "no jitbyoc object in the export"
    return objs


def _registers(obj) -> dict:
    text = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    return {r: text.count(f"%{r}") for r in ("xmm", "ymm", "zmm")}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.parametrize("attrs,allowed", [
    ({}, {"xmm", "ymm", "zmm"} if HOST.has("avx512f") else {"xmm", "ymm"}),
    (dict(mcpu="haswell"), {"xmm", "ymm"}),
    (dict(mcpu="x86-64"), {"xmm"}),
    (dict(mcpu="x86-64", mattr=["+avx2", "+fma"]), {"xmm", "ymm"}),
    (dict(mcpu="znver4", mattr=["-avx512f"]), {"xmm", "ymm"}),  # a feature taken from the CPU
])
def test_exported_x86_objects_use_only_their_targets_registers(attrs, allowed, tmp_path):
    with jitbyoc.enabled():
        ex = tvm.compile(_model(), target=_target(**attrs))
    assert len(jitbyoc.last_report().regions) >= 1
    for obj in _jitbyoc_objects(ex, tmp_path):
        assert _elf_machine(obj) == EM_X86_64
        used = _registers(obj)
        assert {r for r, n in used.items() if n} <= allowed, (attrs, used)
        widest = max(allowed, key=lambda r: "xyz".index(r[0]))
        assert used[widest] > 0, (attrs, used)  # the target's widest vectors are used
        if attrs.get("mcpu") == "x86-64" and not attrs.get("mattr"):  # no FMA: never libm's fma per element
            assert b"fmaf" not in obj.read_bytes() and b"fma\0" not in obj.read_bytes()


def test_an_aarch64_export_holds_aarch64_objects(tmp_path):
    with jitbyoc.enabled():
        ex = tvm.compile(_model(), target=_target(mtriple="aarch64-linux-gnu"))
    rep = jitbyoc.last_report()
    assert len(rep.regions) >= 1 and not rep.fallbacks, str(rep)
    for obj in _jitbyoc_objects(ex, tmp_path):
        assert _elf_machine(obj) == EM_AARCH64


@pytest.mark.parametrize("attrs", [dict(mcpu="haswell"), dict(mcpu="x86-64"),
                                   dict(mcpu="x86-64", mattr=["+avx2", "+fma"])])
def test_builds_for_other_x86_cpus_run_right_here(attrs):
    if not HOST.has("avx2"):
        pytest.skip("this CPU cannot run AVX2 code")
    mod, args = _model(), _inputs()
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=_target(**attrs))
    assert len(jitbyoc.last_report().regions) >= 1
    got = run(relax.VirtualMachine(ex, tvm.cpu()), *args)
    np.testing.assert_allclose(got, run(build_tvm(mod), *args), rtol=1e-5, atol=1e-6)


LACKED = next((f for f in sorted(cpu_check.CPUID) if not HOST.has(f)), None)
CALL_EXPORTED = """
import sys, numpy as np, tvm
from tvm import relax
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
try:
    vm["main"](tvm.runtime.tensor(np.ones((4, 16), "float32")))
except Exception as err:
    print(type(err).__name__, err)
assert "jitbyoc" not in sys.modules
"""


def _build_needing(feature: str):
    mod = build_model({"a": ((4, 16), "float32")}, lambda bb, a: bb.emit(relax.op.nn.relu(a)))
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=_target(mcpu=HOST.cpu, mattr=[f"+{feature}"]))
    assert len(jitbyoc.last_report().regions) == 1
    return ex


@pytest.mark.skipif(LACKED is None, reason="this CPU has every feature jitbyoc checks")
def test_code_for_features_this_cpu_lacks_raises_naming_them():
    vm = relax.VirtualMachine(_build_needing(LACKED), tvm.cpu())
    with pytest.raises(RuntimeError, match=rf"compiled for {HOST.cpu}.* lacks: .*\b{LACKED}\b"):
        vm["main"](tvm.runtime.tensor(np.ones((4, 16), "float32")))


@pytest.mark.skipif(LACKED is None or shutil.which("gcc") is None,
                    reason="needs a CPU lacking a checked feature and gcc for export_library")
def test_an_exported_library_loaded_without_jitbyoc_checks_too(tmp_path):
    lib = tmp_path / "model.so"
    _build_needing(LACKED).export_library(str(lib))
    done = subprocess.run([sys.executable, "-c", CALL_EXPORTED, str(lib)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]  # no SIGILL: an error, caught
    assert "RuntimeError" in done.stdout and LACKED in done.stdout, done.stdout


def test_a_build_for_this_machine_passes_the_check_and_runs():
    # this machine named as a TVM user names it: its CPU, and its features spelled out (a
    # VM may hide some of its CPU model's: an Emerald Rapids under KVM without AMX or
    # AVX512_BF16, where mcpu alone names code this CPU cannot run and the check refuses it)
    mod = build_model({"a": ((4, 16), "float32")}, lambda bb, a: bb.emit(relax.op.nn.relu(a)))
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=_target(mcpu=HOST.cpu, mattr=HOST.features.split(",")))
    x = np.linspace(-1, 1, 64, dtype="float32").reshape(4, 16)
    np.testing.assert_array_equal(run(relax.VirtualMachine(ex, tvm.cpu()), x), np.maximum(x, 0))
    assert set(cpu_check.required(HOST)) <= {f for f in cpu_check.CPUID if HOST.has(f)}
