"""``python -m bench --rpc HOST:PORT [--target T]``: the default suite on a TVM RPC server.

TVM's cross-compilation and RPC flow: for each model, jitbyoc's build and TVM's default
build for the target (``--target``, default this machine), each exported with
``export_library`` (``--cc`` picks the compiler, e.g. a cross compiler for another
architecture), uploaded to the server, loaded there into a Relax VM and timed there with
``time_evaluator`` (median of ``--repeat`` repeats of ``number`` calls, taken in turns:
jitbyoc, TVM, jitbyoc...). The server needs TVM's runtime only: the exported library holds
jitbyoc's code, so jitbyoc need not be installed there. Each remote result is checked
against TVM's default build run here (normwise relative error, as in the local table).

Start a server with ``python -m tvm.exec.rpc_server --host 0.0.0.0 --port 9090`` (needs the
``deploy`` extra: cloudpickle, psutil).
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from pathlib import Path

import tvm
from tvm import relax, rpc

from . import models, report
from . import target as build_target
from .case import Skip
from .peers import as_numpy
from .run import TOLERANCE, machine_info
from .timing import max_errors

log = logging.getLogger("bench")
NUMBER = 5  # calls per time_evaluator repeat


def connect(address: str):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rpc wants HOST:PORT, got {address!r}")
    return rpc.connect(host, int(port))


def _export(mod, offload: bool, path: Path, cc: str | None) -> None:
    build_target.build(mod, offload).export_library(str(path), **({"cc": cc} if cc else {}))


def _remote_vm(remote, path: Path, inputs):
    remote.upload(str(path))
    dev = remote.cpu()
    vm = relax.VirtualMachine(remote.load_module(path.name), dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    return vm, dev, args


def measure(remote, name: str, case, workdir: Path, repeat: int, cc: str | None) -> dict:
    """Model ``name`` on the server: both builds' remote times and their errors against
    a local TVM default run."""
    local = relax.VirtualMachine(build_target.build(case.mod, False, "llvm"), tvm.cpu())
    ref = as_numpy(local["main"](*[tvm.runtime.tensor(a) for a in case.inputs]))
    row, timers = {}, {}
    for who, offload in (("jitbyoc", True), ("tvm", False)):
        # a new name per library: the server dlopens by path (a path loaded before gives the
        # old library; a file rewritten under its mapping, SIGBUS), and never "tvm.so",
        # which the server's Python could import as tvm
        path = workdir / f"{name}_{who}.so"
        _export(case.mod, offload, path, cc)
        vm, dev, args = _remote_vm(remote, path, case.inputs)
        _, row[f"{who}_max_rel_err"] = max_errors(as_numpy(vm["main"](*args)), ref)
        vm.set_input("main", *args)
        timers[who] = vm.time_evaluator("invoke_stateful", dev, number=NUMBER, repeat=1)
    times = {who: [] for who in timers}
    for _ in range(repeat):  # in turns: a slow spell of the remote machine hits both
        for who, timer in timers.items():
            times[who].append(timer("main").mean)
    for who, ts in times.items():
        row[f"{who}_median_s"] = statistics.median(ts)
    row["speedup"] = row["tvm_median_s"] / row["jitbyoc_median_s"]
    row["ok"] = all(row[f"{w}_max_rel_err"] <= TOLERANCE for w in timers)
    return row


def format_rows(rows: list[dict]) -> str:
    head = f"{'model':22s} {'jitbyoc ms':>11s} {'tvm ms':>10s} {'speedup':>8s} {'jit err':>9s} {'tvm err':>9s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:22s} {1e3 * r['jitbyoc_median_s']:11.3f} {1e3 * r['tvm_median_s']:10.3f} "
                     f"{r['speedup']:8.1f} {r['jitbyoc_max_rel_err']:9.1e} {r['tvm_max_rel_err']:9.1e}"
                     + ("" if r["ok"] else "  !"))
    return "\n".join(lines)


def main(args) -> int:
    """Run the selected default-suite models remotely; print and write the table."""
    remote = connect(args.rpc)
    entries = [e for e in models.select(args.model, args.quick, "default")]
    machine = machine_info(args.threads)
    print(f"{report.format_machine(machine)}; remote {args.rpc}", flush=True)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="jitbyoc-rpc-") as tmp:
        for entry in entries:
            case = entry.make()
            if isinstance(case, Skip):
                skipped.append({"model": entry.name, "reason": case.reason})
                continue
            row = measure(remote, entry.name, case, Path(tmp), args.repeat or 5, args.cc)
            rows.append({"model": entry.name, **row})
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    out = args.out or Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote.json").write_text(json.dumps({"machine": machine, "remote": args.rpc, "rows": rows,
                                                 "skipped": skipped}, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1
