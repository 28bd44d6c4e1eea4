"""A CPU check in front of every region: code built for features the running CPU lacks
raises a clear error on its first call instead of dying with SIGILL.

Each region's trampoline (:mod:`jitbyoc.toolchain.runtime`) calls ``jitbyoc_cpu_check``
until it has passed once. The check reads ``cpuid`` (and ``xgetbv``: the OS must save
AVX / AVX-512 registers too) for the x86 features the build's machine was given
(:class:`~jitbyoc.render.isa.Machine`) and, if any is missing, raises
``RuntimeError: jitbyoc: this code was compiled for <cpu> (...) but this CPU lacks:
avx512f, ...`` through TVM's FFI. It is IR inside the module, so an exported library
loaded without jitbyoc checks too. AArch64 builds are not checked: NEON is part of the
architecture, and jitbyoc's AArch64 kernels use nothing beyond it.
"""

from __future__ import annotations

from ..engines.gemm_tiles import ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
from ..render.abi import c_string
from ..render.isa import Machine

# LLVM feature -> (cpuid leaf, subleaf, register 0..3 = eax, ebx, ecx, edx, bit)
CPUID = {
    "sse3": (1, 0, 2, 0), "pclmul": (1, 0, 2, 1), "ssse3": (1, 0, 2, 9), "fma": (1, 0, 2, 12),
    "cx16": (1, 0, 2, 13), "sse4.1": (1, 0, 2, 19), "sse4.2": (1, 0, 2, 20), "movbe": (1, 0, 2, 22),
    "popcnt": (1, 0, 2, 23), "aes": (1, 0, 2, 25), "xsave": (1, 0, 2, 26), "avx": (1, 0, 2, 28),
    "f16c": (1, 0, 2, 29), "rdrnd": (1, 0, 2, 30),
    "bmi": (7, 0, 1, 3), "avx2": (7, 0, 1, 5), "bmi2": (7, 0, 1, 8), "avx512f": (7, 0, 1, 16),
    "avx512dq": (7, 0, 1, 17), "adx": (7, 0, 1, 19), "avx512ifma": (7, 0, 1, 21),
    "avx512cd": (7, 0, 1, 28), "sha": (7, 0, 1, 29), "avx512bw": (7, 0, 1, 30), "avx512vl": (7, 0, 1, 31),
    "avx512vbmi": (7, 0, 2, 1), "avx512vbmi2": (7, 0, 2, 6), "gfni": (7, 0, 2, 8), "vaes": (7, 0, 2, 9),
    "vpclmulqdq": (7, 0, 2, 10), "avx512vnni": (7, 0, 2, 11), "avx512bitalg": (7, 0, 2, 12),
    "avx512vpopcntdq": (7, 0, 2, 14), "avx512fp16": (7, 0, 3, 23), "avxvnni": (7, 1, 0, 4),
    "avx512bf16": (7, 1, 0, 5), "lzcnt": (0x80000001, 0, 2, 5), "sse4a": (0x80000001, 0, 2, 6),
    "amx-bf16": (7, 0, 3, 22), "amx-tile": (7, 0, 3, 24), "amx-int8": (7, 0, 3, 25),
}
# what the OS must enable in XCR0 for the registers those features use
XCR0 = {"avx": 0x6, "avx512f": 0xE6, "amx": 0x60000}
CHECK, STATE = "jitbyoc_cpu_check", "jitbyoc_cpu_state"


def required(machine: Machine) -> list[str]:
    """The checked features ``machine``'s code may use (empty for other architectures)."""
    if machine.arch != "x86_64":
        return []
    return sorted(f for f in CPUID if machine.has(f))


def _cpuid(leaves: set) -> list[str]:
    """cpuid of every leaf used, each leaf zero when above the CPU's highest (basic or
    extended) leaf."""
    lines = []
    for base in (0, 0x80000000):
        lines.append(f'  %top{base:x} = call {{i32, i32, i32, i32}} asm sideeffect "cpuid", '
                     f'"={{ax}},={{bx}},={{cx}},={{dx}},{{ax}},{{cx}}"(i32 {base}, i32 0)')
        lines.append(f"  %max{base:x} = extractvalue {{i32, i32, i32, i32}} %top{base:x}, 0")
    for leaf, sub in sorted(leaves):
        top = "max80000000" if leaf >= 0x80000000 else "max0"
        n = f"{leaf:x}_{sub}"
        lines += [f'  %raw{n} = call {{i32, i32, i32, i32}} asm sideeffect "cpuid", '
                  f'"={{ax}},={{bx}},={{cx}},={{dx}},{{ax}},{{cx}}"(i32 {leaf}, i32 {sub})',
                  f"  %has{n} = icmp uge i32 %{top}, {leaf}"]
        for r in range(4):
            lines += [f"  %r{n}_{r}0 = extractvalue {{i32, i32, i32, i32}} %raw{n}, {r}",
                      f"  %r{n}_{r} = select i1 %has{n}, i32 %r{n}_{r}0, i32 0"]
    return lines


def _xcr0() -> list[str]:
    """XCR0 (0 when the OS has not enabled xgetbv: then no AVX state is saved)."""
    return ["  %osx = and i32 %r1_0_2, 134217728", "  %osxsave = icmp ne i32 %osx, 0",
            "  br i1 %osxsave, label %xget, label %xdone", "xget:",
            '  %xcr = call {i32, i32} asm sideeffect "xgetbv", "={ax},={dx},{cx}"(i32 0)',
            "  %xcr0v = extractvalue {i32, i32} %xcr, 0", "  br label %xdone", "xdone:",
            "  %xcr0 = phi i32 [ 0, %entry ], [ %xcr0v, %xget ]"]


def _os_mask(feature: str) -> int:
    """The XCR0 bits the OS must set for ``feature``'s registers (0: none beyond SSE)."""
    if feature.startswith("avx512"):
        return XCR0["avx512f"]
    if feature.startswith("amx"):
        return XCR0["amx"]
    return XCR0["avx"] if feature in ("avx", "avx2", "fma", "f16c", "vaes", "vpclmulqdq", "avxvnni") else 0


def _feature_slot(i: int, feature: str, linux: bool) -> list[str]:
    """Store into message part ``i + 1`` the feature's name if missing, else "". On
    Linux, AMX's tiles count as present once the OS has granted them
    (:data:`jitbyoc.engines.gemm_tiles.ARCH_PRCTL`)."""
    leaf, sub, reg, bit = CPUID[feature]
    lines = [f"  %b{i} = and i32 %r{leaf:x}_{sub}_{reg}, {1 << bit}", f"  %ok{i} = icmp ne i32 %b{i}, 0"]
    mask = _os_mask(feature)
    if mask:
        lines += [f"  %x{i} = and i32 %xcr0, {mask}", f"  %os{i} = icmp eq i32 %x{i}, {mask}",
                  f"  %all{i} = and i1 %ok{i}, %os{i}"]
    good = f"%all{i}" if mask else f"%ok{i}"
    if feature == "amx-tile" and linux:  # asking where the CPU has no tiles fails harmlessly
        lines += [f"  %perm{i} = call i64 (i64, ...) @syscall(i64 {ARCH_PRCTL}, i64 {ARCH_REQ_XCOMP_PERM}, "
                  f"i64 {XFEATURE_XTILEDATA})", f"  %granted{i} = icmp eq i64 %perm{i}, 0",
                  f"  %tiles{i} = and i1 {good}, %granted{i}"]
        good = f"%tiles{i}"
    return lines + [f"  %part{i} = select i1 {good}, ptr @jitbyoc.cpu.none, ptr @jitbyoc.cpu.f{i}",
                    f"  %slot{i} = getelementptr ptr, ptr %parts, i32 {i + 1}",
                    f"  store ptr %part{i}, ptr %slot{i}",
                    f"  %miss{i} = select i1 {good}, i32 0, i32 1"]


def module_ir(machine: Machine) -> str:
    """``i32 jitbyoc_cpu_check()`` (0, or -1 with the error raised) and its state for
    ``machine`` ("" when nothing is checked)."""
    features = required(machine)
    if not features:
        return ""
    n, linux = len(features), "linux" in machine.triple
    head = f"jitbyoc: this code was compiled for {machine.cpu} ({machine.triple}) but this CPU lacks: "
    tail = "(build it for this machine: target llvm, or mcpu=native)"
    lines = [c_string("jitbyoc.cpu.head", head), c_string("jitbyoc.cpu.tail", tail),
             c_string("jitbyoc.cpu.kind", "RuntimeError"), c_string("jitbyoc.cpu.none", "")]
    lines += [c_string(f"jitbyoc.cpu.f{i}", f"{f} ") for i, f in enumerate(features)]
    lines += [f"@{STATE} = internal global i32 0, align 4",
              "declare void @TVMFFIErrorSetRaisedFromCStrParts(ptr, ptr, i32)",
              *(["declare i64 @syscall(i64, ...)"] if linux else []),
              f"define internal i32 @{CHECK}() {{", "entry:", f"  %parts = alloca [{n + 2} x ptr], align 8"]
    lines += _cpuid({CPUID[f][:2] for f in features} | {(1, 0)}) + _xcr0()
    for i, f in enumerate(features):
        lines += _feature_slot(i, f, linux)
    lines += ["  %missing0 = add i32 0, 0"]
    lines += [f"  %missing{i + 1} = add i32 %missing{i}, %miss{i}" for i in range(n)]
    lines += [f"  %bad = icmp ne i32 %missing{n}, 0", "  br i1 %bad, label %fail, label %pass", "pass:",
              f"  store atomic i32 1, ptr @{STATE} monotonic, align 4", "  ret i32 0", "fail:",
              "  store ptr @jitbyoc.cpu.head, ptr %parts",
              f"  %last = getelementptr ptr, ptr %parts, i32 {n + 1}", "  store ptr @jitbyoc.cpu.tail, ptr %last",
              f"  call void @TVMFFIErrorSetRaisedFromCStrParts(ptr @jitbyoc.cpu.kind, ptr %parts, i32 {n + 2})",
              "  ret i32 -1", "}"]
    return "\n".join(lines)


def guard(entry_call: str) -> list[str]:
    """A trampoline body (after ``entry:``) that runs the check until it has passed once,
    then ``entry_call`` (an instruction assigning ``%r``)."""
    return [f"  %state = load atomic i32, ptr @{STATE} monotonic, align 4",
            "  %checked = icmp eq i32 %state, 1", "  br i1 %checked, label %run, label %check", "check:",
            f"  %c = call i32 @{CHECK}()", "  %fine = icmp eq i32 %c, 0",
            "  br i1 %fine, label %run, label %refuse", "refuse:", "  ret i32 -1", "run:", entry_call, "  ret i32 %r"]
