"""The thread defaults of :mod:`jitbyoc.threads`, for a library loaded without jitbyoc.

Importing jitbyoc sets ``TVM_NUM_THREADS`` to the physical cores this process may run
on and ``TVM_BIND_THREADS=0`` where they are unset. A library made by ``export_library``
and loaded in a process that never imports jitbyoc got TVM's own defaults instead: half
the cores on x86, which on a VM of one thread a core is half the machine (ResNet-50 QDQ
on 2 cores: 12.2 ms a call against 6.5). So every module of regions carries a
constructor (``llvm.global_ctors``: it runs when the library is loaded, before TVM's pool
starts at its first parallel call) that sets the same defaults where they are unset:
the CPUs in the process's affinity mask, halved when the kernel reports SMT active
(``/sys/devices/system/cpu/smt/active``), as :func:`jitbyoc.threads.physical_cores`
counts them where every core has two threads. Linux only (``sched_getaffinity``); an
explicit ``TVM_NUM_THREADS`` or ``TVM_BIND_THREADS`` always wins.
"""

from __future__ import annotations

from ..render.abi import c_string
from ..render.isa import Machine

CTOR = "jitbyoc_thread_defaults"
MASK_WORDS = 16  # 1024 CPUs: sched_getaffinity's mask, in i64 words


def module_ir(machine: Machine) -> str:
    """The constructor, its strings and declarations; empty for a target that is not
    Linux."""
    if "linux" not in machine.triple:
        return ""
    words = MASK_WORDS
    return "\n".join([
        c_string(f"{CTOR}.threads", "TVM_NUM_THREADS"), c_string(f"{CTOR}.bind", "TVM_BIND_THREADS"),
        c_string(f"{CTOR}.zero", "0"), c_string(f"{CTOR}.digits", "%d"),
        c_string(f"{CTOR}.smt", "/sys/devices/system/cpu/smt/active"),
        f"@llvm.global_ctors = appending global [1 x {{ i32, ptr, ptr }}] "
        f"[{{ i32, ptr, ptr }} {{ i32 65535, ptr @{CTOR}, ptr null }}]",
        "declare ptr @getenv(ptr)", "declare i32 @setenv(ptr, ptr, i32)",
        "declare i32 @sched_getaffinity(i32, i64, ptr)", "declare i32 @open(ptr, i32, ...)",
        "declare i64 @read(i32, ptr, i64)", "declare i32 @close(i32)",
        "declare i32 @snprintf(ptr, i64, ptr, ...)",
        f"declare i64 @llvm.vector.reduce.add.v{words}i64(<{words} x i64>)",
        f"declare <{words} x i64> @llvm.ctpop.v{words}i64(<{words} x i64>)",
        f"""define internal void @{CTOR}() {{
entry:
  %given = call ptr @getenv(ptr @{CTOR}.threads)
  %unset = icmp eq ptr %given, null
  br i1 %unset, label %count, label %bind
count:
  %mask = alloca <{words} x i64>, align 64
  store <{words} x i64> zeroinitializer, ptr %mask
  %got = call i32 @sched_getaffinity(i32 0, i64 {words * 8}, ptr %mask)
  %words = load <{words} x i64>, ptr %mask
  %bits = call <{words} x i64> @llvm.ctpop.v{words}i64(<{words} x i64> %words)
  %cpus = call i64 @llvm.vector.reduce.add.v{words}i64(<{words} x i64> %bits)
  %flag = alloca i8
  store i8 48, ptr %flag
  %fd = call i32 (ptr, i32, ...) @open(ptr @{CTOR}.smt, i32 0)
  %opened = icmp sge i32 %fd, 0
  br i1 %opened, label %smt, label %decide
smt:
  %n = call i64 @read(i32 %fd, ptr %flag, i64 1)
  %closed = call i32 @close(i32 %fd)
  br label %decide
decide:
  %active = load i8, ptr %flag
  %pairs = icmp eq i8 %active, 49
  %half = lshr i64 %cpus, 1
  %cores = select i1 %pairs, i64 %half, i64 %cpus
  %ok = icmp eq i32 %got, 0
  %some = icmp ugt i64 %cores, 0
  %use = and i1 %ok, %some
  br i1 %use, label %set, label %bind
set:
  %text = alloca [24 x i8]
  %count32 = trunc i64 %cores to i32
  %len = call i32 (ptr, i64, ptr, ...) @snprintf(ptr %text, i64 24, ptr @{CTOR}.digits, i32 %count32)
  %r1 = call i32 @setenv(ptr @{CTOR}.threads, ptr %text, i32 0)
  br label %bind
bind:
  %r2 = call i32 @setenv(ptr @{CTOR}.bind, ptr @{CTOR}.zero, i32 0)
  ret void
}}"""])
