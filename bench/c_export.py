"""``python -m bench.c_export``: the C export's speed next to the LLVM path and TVM's own C.

For each model of the small suite (default: mlp, conv_block, resnet18, transformer_block):

* jitbyoc, LLVM: ``tvm.compile(mod, target="llvm")`` with jitbyoc, in process;
* jitbyoc, C: ``target="c"`` with jitbyoc, ``export_library`` with ``--cc`` and ``--flags``,
  loaded back;
* TVM, C: the same export of TVM's own ``target="c"`` build (jitbyoc off).

Every candidate is timed in blocks of warm calls taking turns (:func:`bench.timing.time_blocks`);
medians of all calls. The C rendering is portable C99 (no intrinsics, no explicit vectors:
what the compiler vectorizes of it, it does), so the gap to the LLVM path is the price of
portability; the export's flags decide how much the compiler may use of the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

DEFAULT_MODELS = ["mlp", "conv_block", "resnet18", "transformer_block"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.c_export", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="small-suite model (repeatable)")
    p.add_argument("--cc", default="g++", help="the compiler export_library runs (default g++, TVM's)")
    p.add_argument("--flags", default="-O3 -march=native -ffp-contract=off",
                   help="its options (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of timed blocks")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    return p.parse_args(argv)


def _exported(mod, offload: bool, path: Path, cc: str, flags: list[str]):
    import tvm
    from tvm import relax

    from .target import build

    build(mod, offload, "c").export_library(str(path), cc=cc, options=flags)
    return relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())


def measure(name: str, args, workdir: Path) -> dict:
    import tvm
    from tvm import relax

    from .models import ZOO
    from .peers import as_numpy
    from .target import build
    from .timing import max_errors, time_blocks

    case = ZOO[name].make()
    llvm_vm = relax.VirtualMachine(build(case.mod, True, "llvm"), tvm.cpu())
    flags = args.flags.split()
    vms = {"jitbyoc_llvm": llvm_vm,
           "jitbyoc_c": _exported(case.mod, True, workdir / f"{name}_jitbyoc.so", args.cc, flags),
           "tvm_c": _exported(case.mod, False, workdir / f"{name}_tvm.so", args.cc, flags)}
    inputs = [tvm.runtime.tensor(a) for a in case.inputs]
    fns = {who: (lambda vm=vm: vm["main"](*inputs)) for who, vm in vms.items()}
    ref = as_numpy(fns["jitbyoc_llvm"]())
    row = {"model": name, "c_max_rel_err": max_errors(as_numpy(fns["jitbyoc_c"]()), ref)[1]}
    for who, samples in time_blocks(fns, args.rounds).items():
        row[f"{who}_ms"] = 1e3 * statistics.median(samples)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from .report import format_machine
    from .run import machine_info

    print(format_machine(machine_info(args.threads)))
    print(f"export: {args.cc} {args.flags}")
    head = f"{'model':20s} {'jitbyoc llvm ms':>16s} {'jitbyoc C ms':>13s} {'TVM C ms':>10s} " \
           f"{'C / llvm':>9s} {'TVM C / jitbyoc C':>18s} {'C err':>8s}"
    print(head + "\n" + "-" * len(head))
    with tempfile.TemporaryDirectory(prefix="jitbyoc-c-export-") as tmp:
        for name in args.model or DEFAULT_MODELS:
            r = measure(name, args, Path(tmp))
            print(f"{name:20s} {r['jitbyoc_llvm_ms']:16.3f} {r['jitbyoc_c_ms']:13.3f} {r['tvm_c_ms']:10.3f} "
                  f"{r['jitbyoc_c_ms'] / r['jitbyoc_llvm_ms']:9.2f} {r['tvm_c_ms'] / r['jitbyoc_c_ms']:18.1f} "
                  f"{r['c_max_rel_err']:8.1e}", flush=True)


if __name__ == "__main__":
    main()
