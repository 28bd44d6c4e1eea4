"""Measure one model: build it both ways, check jitbyoc against TVM, time everything.

Builds: TVM default is ``jitbyoc.disable(); tvm.compile(mod, target="llvm")``; jitbyoc is
the same call inside ``with jitbyoc.enabled()``. "Cold" is the first build of the model in
this process, "warm" the second (jitbyoc may hit its own caches; TVM has none). Before the
suite, :func:`warm_process` builds an unrelated tiny model both ways, so one-time process
costs (LLVM initialization, lazy imports) are not charged to the first model. The CLI
points jitbyoc's disk cache at an empty temporary directory unless ``--keep-cache``, so a
cold build is not served by an earlier process; ``cold_cache_hits`` counts regions that
were served from a cache anyway (0 means truly cold).
"""

from __future__ import annotations

import collections
import logging
import os
import platform
import sys
import tempfile
from contextlib import contextmanager

import numpy as np
import tvm
from tvm import relax

import jitbyoc

from . import peers as peers_mod
from . import target as build_target
from .models import Case, Entry, Skip, from_forward
from .timing import Stats, max_errors, speedup, time_alternating, time_blocks, timed

log = logging.getLogger(__name__)
TOLERANCE = 1e-3  # max normwise relative error of jitbyoc vs TVM before a row is flagged
# jitbyoc_alone: jitbyoc timed in a loop of its own, as the peers are (warm caches, no
# TVM-default run in between): the fair figure to set against torch and onnxruntime
CANDIDATES = ("tvm", "jitbyoc", "jitbyoc_alone") + peers_mod.NAMES


@contextmanager
def cold_cache(keep: bool):
    """jitbyoc's disk cache in an empty temporary directory for the block, unless ``keep``."""
    old = os.environ.get("JITBYOC_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="jitbyoc-bench-cache-") as path:
        if not keep:
            os.environ["JITBYOC_CACHE_DIR"] = path  # read by jitbyoc at build time
        try:
            yield
        finally:
            if not keep and old is None:
                os.environ.pop("JITBYOC_CACHE_DIR")
            elif not keep:
                os.environ["JITBYOC_CACHE_DIR"] = old


def columns() -> list[str]:
    """Every key of a result row, in table/CSV order (missing values are None)."""
    cols = ["model", "description", "model_ops", "offloaded_ops", "total_ops", "offload_share",
            "regions",
            "cold_cache_hits", "left_to_tvm", "build_cold_tvm_s", "build_cold_jitbyoc_s",
            "build_warm_tvm_s", "build_warm_jitbyoc_s", "repeat"]
    for who in CANDIDATES:
        cols += [f"{who}_median_s", f"{who}_min_s", f"{who}_max_s"]
    cols += ["speedup", "max_abs_err", "max_rel_err", "ok"]
    for who in peers_mod.NAMES:
        cols += [f"{who}_vs_tvm", f"{who}_max_abs_err", f"{who}_max_rel_err"]
    return cols + ["notes"]


def compile_both(mod: tvm.IRModule) -> dict:
    """Cold then warm builds, TVM default and jitbyoc; the executables and the report."""
    def tvm_build():
        jitbyoc.disable()
        return tvm.compile(mod, target=build_target.current())

    def jit_build():
        with jitbyoc.enabled():
            return tvm.compile(mod, target=build_target.current()), jitbyoc.last_report()

    ex_tvm, cold_tvm = timed(tvm_build)
    (ex_jit, report), cold_jit = timed(jit_build)  # report of the cold build
    _, warm_tvm = timed(tvm_build)
    _, warm_jit = timed(jit_build)
    return {"ex_tvm": ex_tvm, "ex_jit": ex_jit, "report": report,
            "build_cold_tvm_s": cold_tvm, "build_cold_jitbyoc_s": cold_jit,
            "build_warm_tvm_s": warm_tvm, "build_warm_jitbyoc_s": warm_jit}


def vm_runner(ex, inputs: list[np.ndarray]):
    """A zero-argument callable running ``main`` on its own copy of ``inputs``."""
    fn = relax.VirtualMachine(ex, tvm.cpu())["main"]
    args = [tvm.runtime.tensor(np.array(a)) for a in inputs]
    return lambda: fn(*args)


def count_ops(mod: tvm.IRModule) -> int:
    """Calls of Relax operators in ``mod``'s Relax functions: a check on the report's count."""
    calls = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, lambda e: calls.append(1) if isinstance(
                e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return len(calls)


def offload_fields(report) -> dict:
    left = collections.Counter(f.op.removeprefix("relax.") for f in report.fallbacks)
    return {"offloaded_ops": report.offloaded_ops, "total_ops": report.total_ops,
            "offload_share": report.offloaded_share, "regions": len(report.regions),
            # regions of the cold build served from jitbyoc's compile cache (0 = truly cold)
            "cold_cache_hits": sum(1 for r in report.regions if "hit" in getattr(r, "cache", "")),
            "left_to_tvm": " ".join(f"{op}x{n}" for op, n in sorted(left.items())) or None}


def failure(entry: Entry, stage: str, err: Exception) -> Skip:
    """A Skip saying which stage failed and how (the traceback goes to the debug log)."""
    log.warning("%s: %s failed", entry.name, stage, exc_info=log.isEnabledFor(logging.DEBUG))
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    # the first line, plus LLVM's "error:" line when the first only says "parsing error"
    detail = " | ".join(lines[:1] + [ln for ln in lines[1:] if "error:" in ln][:1])
    return Skip(f"{stage} failed: {type(err).__name__}: {detail[:240]}")


def prepare(entry: Entry) -> tuple[Case, dict, dict] | Skip:
    """Make the model, build it both ways, run each build once and compare the outputs.

    Returns the case, the builds (see :func:`compile_both`) and the check (``runners``,
    ``ref`` outputs of TVM default, ``max_abs_err``, ``max_rel_err``), or a Skip.
    """
    try:
        case = entry.make()
    except Exception as err:
        return failure(entry, "making the model", err)
    if isinstance(case, Skip):
        return case
    try:
        built = compile_both(case.mod)
    except Exception as err:
        return failure(entry, "build", err)
    runners = {"tvm": vm_runner(built["ex_tvm"], case.inputs),
               "jitbyoc": vm_runner(built["ex_jit"], case.inputs)}
    try:  # these first calls are not timed: time_alternating warms up again anyway
        ref = peers_mod.as_numpy(runners["tvm"]())
        abs_err, rel_err = max_errors(peers_mod.as_numpy(runners["jitbyoc"]()), ref)
    except Exception as err:
        return failure(entry, "run", err)
    built["model_ops"] = count_ops(case.mod)
    return case, built, {"runners": runners, "ref": ref, "max_abs_err": abs_err,
                         "max_rel_err": rel_err}


def make_row(entry: Entry, repeat: int, built: dict, check: dict, stats: dict[str, Stats],
             peers: list, notes: list[str]) -> dict:
    """One flat result row (keys: :func:`columns`)."""
    row = dict.fromkeys(columns())
    rel_err = check["max_rel_err"]
    row.update(model=entry.name, description=entry.description, repeat=repeat,
               max_abs_err=check["max_abs_err"], max_rel_err=rel_err,
               ok=bool(rel_err <= TOLERANCE), speedup=speedup(stats["tvm"], stats["jitbyoc"]),
               **offload_fields(built["report"]))
    row.update({k: v for k, v in built.items() if k.startswith("build_")})
    row["model_ops"] = built["model_ops"]
    if row["total_ops"] != row["model_ops"]:
        notes.append(f"jitbyoc's report counts {row['total_ops']} ops, the model has "
                     f"{row['model_ops']}")
    for who, st in stats.items():
        row.update({f"{who}_median_s": st.median, f"{who}_min_s": st.min, f"{who}_max_s": st.max})
    for p in peers:
        p_abs, p_rel = max_errors(p.outputs, check["ref"])
        row.update({f"{p.name}_vs_tvm": speedup(stats["tvm"], stats[p.name]),
                    f"{p.name}_max_abs_err": p_abs, f"{p.name}_max_rel_err": p_rel})
    if not row["ok"]:
        notes.insert(0, f"MISMATCH: jitbyoc rel err {rel_err:.2e} > {TOLERANCE:g}")
        log.warning("%s: %s", entry.name, notes[0])
    row["notes"] = "; ".join(notes) or None
    return row


PEER_ROUNDS = 3  # rounds of blocks for jitbyoc alone and the peers (each ~0.1 s of calls)


def measure(entry: Entry, repeat: int, warmup: int, workdir: str,
            threads: int | None, with_peers: bool = True) -> dict | Skip:
    """Build, check and time one model; a result row, or a :class:`Skip` saying why not.

    Parameters
    ----------
    entry : Entry
        The zoo entry.
    repeat, warmup : int
        Timed and untimed alternating rounds (see :func:`bench.timing.time_alternating`).
    workdir : str
        Where peers may write files (the ONNX export).
    threads : int or None
        onnxruntime's intra-op threads (TVM and torch are set process-wide).
    with_peers : bool
        Also run torch and onnxruntime when installed.
    """
    got = prepare(entry)
    if isinstance(got, Skip):
        return got
    case, built, check = got
    peers, notes = peers_mod.make_peers(case, workdir, entry.name, threads) if with_peers \
        else ([], ["peers off (--no-peers)"])
    samples = time_alternating(check["runners"], repeat, warmup)
    if peers:  # separately: their thread pools spin after a call and would slow the next slot
        # each in blocks of warm calls of its own, taking turns (never call by call)
        samples.update(time_blocks({"jitbyoc_alone": check["runners"]["jitbyoc"],
                                    **{p.name: p.run for p in peers}}, PEER_ROUNDS))
    stats = {k: Stats.of(v) for k, v in samples.items()}
    return make_row(entry, repeat, built, check, stats, peers, notes)


def warm_process() -> None:
    """Build and run an unrelated tiny model both ways (see the module docstring)."""
    x = np.linspace(-1, 1, 15, dtype="float32").reshape(3, 5)
    case: Case = from_forward(lambda o, a: o.abs(o.neg(a)), {"warm": x})
    built = compile_both(case.mod)
    for ex in (built["ex_tvm"], built["ex_jit"]):
        vm_runner(ex, case.inputs)()


def machine_info(threads: int | None) -> dict:
    """The machine and software the numbers were taken on."""
    import llvmlite
    import llvmlite.binding as llvm

    info = {"cpu": llvm.get_host_cpu_name(), "cpu_model": _cpu_model(), "cpu_bf16": _bf16_flags(),
            "cpu_int8": _int8_flags(),
            "cores": os.cpu_count(), "threads": threads,
            "TVM_NUM_THREADS": os.environ.get("TVM_NUM_THREADS"),
            "TVM_BIND_THREADS": os.environ.get("TVM_BIND_THREADS"),
            "busy_cpu": os.environ.get("JITBYOC_BENCH_BUSY_CPU"),
            "loadavg": loadavg(), "platform": platform.platform(),
            "python": sys.version.split()[0],
            "tvm": tvm.__version__, "llvmlite": llvmlite.__version__, "numpy": np.__version__,
            "jitbyoc": jitbyoc.__version__, "target": build_target.describe()}
    info.update({p: peers_mod.version(p) for p in ("torch", "onnx", "onnxruntime", "openvino")})
    return info


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(key)), None)
    except OSError:
        return None


def _cpu_model() -> str | None:
    return _cpuinfo("model name") or platform.processor() or None


def _bf16_flags() -> list[str]:
    """The CPU's bfloat16 instructions (``avx512_bf16``, ``amx_bf16``; Linux only)."""
    return sorted(set((_cpuinfo("flags") or "").split()) & {"avx512_bf16", "amx_bf16"})


def _int8_flags() -> list[str]:
    """The CPU's int8 dot-product instructions (``avx512_vnni``, ``avx_vnni``, ``amx_int8``;
    Linux only)."""
    return sorted(set((_cpuinfo("flags") or "").split()) & {"avx512_vnni", "avx_vnni", "amx_int8"})


def loadavg() -> list[float] | None:
    """1/5/15-minute load: other work on the machine shows up here (and in the noise)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
