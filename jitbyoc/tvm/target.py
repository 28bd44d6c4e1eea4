"""Which machine a build compiles for: what its TVM target names.

Plain ``"llvm"`` (no ``mcpu`` or ``mattr``, no triple of another architecture), or
``mcpu=native`` or ``mcpu=host`` (LLVM's tools' name; TVM's codegen rejects it and
falls back to ``generic``), means this machine, with every feature it has (TVM's own code for plain ``"llvm"`` is baseline
x86-64; jitbyoc's is not: that is what a user building on the machine that runs the model
wants). Otherwise the target decides, as it does for TVM's LLVM codegen: the triple (the
host's when not given), the CPU (``generic`` when not given) and the complete feature set
LLVM derives from CPU and ``mattr`` (TVM's ``llvm_get_cpu_features``, so jitbyoc and TVM
agree on what the target has). Kernels then follow that machine's vector ISA
(:mod:`jitbyoc.render.isa`): AVX-512, AVX2, SSE-only x86-64, AArch64 NEON. Another
architecture leaves the build to TVM whole, with the reason in the offload report.
"""

from __future__ import annotations

from tvm.target import Target, codegen

from ..render import isa
from ..render.isa import Machine

ARCHES = ("x86_64", "aarch64")  # what jitbyoc's kernels are written and tested for
# CPU names meaning "the CPU this runs on": LLVM has no processor called "host" (passed
# on, it printed "'host' is not a recognized processor" per region and built SSE2 code)
HOST_CPU_NAMES = ("native", "host")


def _names_a_machine(target) -> bool:
    """Whether ``target`` says more than "this machine": a CPU, features, or another
    architecture (TVM fills in its own default triple, of this architecture, everywhere)."""
    attrs = target.attrs
    arch = str(attrs.get("mtriple") or isa.host().triple).split("-")[0]
    cpu = str(attrs.get("mcpu") or "")
    return bool(cpu and cpu not in HOST_CPU_NAMES or attrs.get("mattr") or arch != isa.host().arch)


def machine_for(target) -> Machine | str:
    """The machine ``target`` (a ``tvm.target.Target`` of kind llvm, or None) names, or
    why jitbyoc cannot compile for it."""
    host = isa.host()
    if target is None or not _names_a_machine(target):
        return host
    attrs = target.attrs
    triple = str(attrs.get("mtriple") or "") or host.triple
    arch = triple.split("-")[0]
    if arch not in ARCHES:
        return f"target triple {triple}: jitbyoc compiles for {', '.join(ARCHES)} only"
    cpu = str(attrs.get("mcpu") or "") or "generic"
    mattr = [str(f) for f in attrs.get("mattr") or ()]
    if cpu in HOST_CPU_NAMES:  # the host's own features, then mattr's changes: LLVM's
        # model of the CPU it names may have fewer (a Xeon with AMX under KVM is "rocketlake")
        cpu, mattr = host.cpu, [*host.features.split(","), *mattr]
    spec = {"kind": "llvm", "mcpu": cpu, **({"mtriple": triple} if attrs.get("mtriple") else {})}
    has = _features({**spec, "mattr": mattr} if mattr else spec)
    # what the CPU has by default but the target's mattr took away must be switched off
    # by name: LLVM starts from the CPU's own features (znver4 with -avx512f, listed as
    # its other features only, still made zmm code)
    lacks = _features(spec) - has if mattr else set()
    return Machine(triple, cpu, ",".join([f"+{f}" for f in sorted(has)] + [f"-{f}" for f in sorted(lacks)]))


def _features(spec: dict) -> set[str]:
    """Every feature LLVM derives for a target (TVM's ``llvm_get_cpu_features``)."""
    return {str(f) for f in codegen.llvm_get_cpu_features(Target(spec))}
