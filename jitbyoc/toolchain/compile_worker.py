"""A compile worker: LLVM IR text in, host assembly out, over stdin/stdout.

Run as a script (``python path/to/compile_worker.py``), never imported as part of the
package: it needs only llvmlite, so it starts in a fraction of a second without TVM.
llvmlite serializes every LLVM call behind one process-wide lock, so regions can only be
compiled in parallel in separate processes; :mod:`jitbyoc.toolchain.compile_pool` runs these.

Protocol: each message is an 8-byte little-endian length and a pickle. Requests are
``(ir_text, pipeline, triple, cpu, features)`` (``pipeline`` a plain tuple of
:class:`jitbyoc.render.optimization.Pipeline`);
replies ``(True, asm)`` or ``(False, error)``. The compile steps are those of
:func:`jitbyoc.toolchain.jit.compile_to_assembly`.
"""

import pickle
import struct
import sys
from contextlib import contextmanager

import llvmlite.binding as llvm


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    return pickle.loads(stream.read(struct.unpack("<Q", head)[0]))


def message(obj) -> bytes:
    data = pickle.dumps(obj)
    return struct.pack("<Q", len(data)) + data


def _write(stream, obj) -> None:
    stream.write(message(obj))
    stream.flush()


def make_machine(llvm, triple: str, cpu: str, features: str):
    """The target machine jitbyoc compiles for (the same in process and in workers)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if triple.split("-")[0] != llvm.get_process_triple().split("-")[0]:
        llvm.initialize_all_targets()  # cross compiling: AArch64 from x86-64, say
        llvm.initialize_all_asmprinters()
    target = llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=tuned(triple, features), opt=3, reloc="pic",
                                        codemodel="default")


X86 = ("x86_64", "i386", "i686")


def tuned(triple: str, features: str) -> str:
    """``features`` with x86's ``prefer-256-bit`` tuning off. LLVM's models of Intel's
    AVX-512 CPUs (Ice Lake, Rocket Lake, Sapphire Rapids) prefer 256-bit vectors, for
    Skylake-X's clock drops on 512-bit work; that width is what the loop vectorizer then
    picks, while jitbyoc's own kernels are written in 512-bit vectors (:data:`jitbyoc.
    render.isa.VECTOR_BITS`). A vectorized region loop ran on ymm beside zmm kernels:
    BERT-base in bf16 0.96x the time with the tuning off, ViT-B/16 0.96x, float32 models
    level (Sapphire Rapids, 2 threads, alternating processes). A target's feature list
    spells the tuning out (``+prefer-256-bit`` for ``-mcpu=sapphirerapids``); it is
    replaced. Zen 4's model never had it."""
    if triple.split("-")[0] not in X86:
        return features
    kept = [f for f in features.split(",") if f and f[1:] != "prefer-256-bit"]
    return ",".join(kept + ["-prefer-256-bit"])


# speed_level 0: only these passes (no loop passes, no inlining, no CSE), in one half to
# two thirds of O1's time: enough for code written as it should end up (the GEMM engine:
# explicit vectors, rotated loops; the args engine's table walk), not for the conv
# engines (ResNet-18 1.8 % slower) or region glue (an elementwise region 11 % slower).
LEAN_PASSES = ("sroa", "instruction_combine", "simplify_cfg")


def _dispose_pass_manager(llvm, mpm) -> None:
    """Free a module pass manager's native object. llvmlite (0.45-0.50) never does:
    ``ModulePassManager(ObjectRef, NewPassManager)`` inherits ``ObjectRef``'s empty
    ``_dispose``, so close() and ``__del__`` leave the whole pipeline allocated, 40-45 KB
    per compile at O1 (300 small regions in process: 17 MB of heap)."""
    if not mpm.closed:
        llvm.newpassmanagers.NewPassManager._dispose(mpm)
        mpm.detach()  # disposed: a fixed llvmlite's close() must not free it again


@contextmanager
def optimized_module(llvm, tm, ir_text: str, pipeline: tuple):
    """The module parsed, verified and optimized with ``pipeline`` for ``tm``'s CPU, for
    the ``with`` block; then it is freed with everything made for it.

    Each module gets its own LLVM context: the global one keeps every type, constant and
    metadata string any module ever used (~5 KB per distinct region: 1.6 MB of heap over
    300 small regions). And a fresh pass builder: llvmlite's run registers a local
    ``StandardInstrumentations``' callbacks with the builder, left dangling after it."""
    speed_level, vectorize, _ = pipeline  # a jitbyoc.render.optimization.Pipeline
    context = llvm.create_context()
    try:
        mod = llvm.parse_assembly(ir_text, context=context)
        try:
            mod.verify()
            pto = llvm.create_pipeline_tuning_options(speed_level=max(1, speed_level))
            pto.loop_vectorization = pto.slp_vectorization = vectorize
            pto.loop_unrolling = pto.loop_interleaving = False
            pb = llvm.create_pass_builder(tm, pto)
            if speed_level == 0:
                mpm = llvm.create_new_module_pass_manager()
                for name in LEAN_PASSES:
                    getattr(mpm, f"add_{name}_pass")()
            else:
                mpm = pb.getModulePassManager()
            try:
                mpm.run(mod, pb)
            finally:
                _dispose_pass_manager(llvm, mpm)
                pb.close()
                pto.close()
            yield mod
        finally:
            mod.close()
    finally:
        context.close()


_LSR = [True]  # LLVM's -disable-lsr is a process-wide option: set it only when it changes


def compile_to_assembly(llvm, tm, ir_text: str, pipeline: tuple) -> str:
    lsr = pipeline[2]
    with optimized_module(llvm, tm, ir_text, pipeline) as mod:
        if _LSR[0] != lsr:
            llvm.set_option("", f"-disable-lsr={'false' if lsr else 'true'}")
            _LSR[0] = lsr
        return tm.emit_assembly(mod)


def main() -> None:
    machines = {}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        req = _read(inp)
        if req is None:
            return
        ir_text, pipeline, machine = req[0], req[1], tuple(req[2:])  # (triple, cpu, features)
        try:
            if machine not in machines:
                machines[machine] = make_machine(llvm, *machine)
            reply = (True, compile_to_assembly(llvm, machines[machine], ir_text, pipeline))
        except Exception as err:  # reported to the parent, which compiles in process instead
            reply = (False, f"{type(err).__name__}: {err}")
        _write(out, reply)


if __name__ == "__main__":
    main()
