"""``python -m bench.isa_ratio``: another vector ISA's build against this machine's, in one process.

Each model of the small suite is built four times: jitbyoc and TVM default, each for this
machine (``llvm``) and for ``--other`` (default ``haswell``: AVX2, no AVX-512). The four
builds take turns in blocks of warm calls (:func:`bench.timing.time_blocks`) in this one
process. Per model it prints each ISA's speedup over TVM default built for the same
target, and their ratio (issue 15: the AVX2 build should keep >= 0.8 of the AVX-512
build's speedup wherever the work is not compute-bound).

Why one process: this VM's speed flips between two levels for minutes at a time, so two
``python -m bench --target`` runs taken minutes apart compared phases, not ISAs. onnx_mlp
read 0.49 that way and 0.84 here.
"""

from __future__ import annotations

import argparse
import os
import statistics


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.isa_ratio", description=__doc__.splitlines()[0])
    p.add_argument("--other", default="haswell", help="the CPU the other build targets (default haswell)")
    p.add_argument("--model", action="append", help="models of the small suite (default: all)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of timed blocks")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    return p.parse_args(argv)


def measure(case, other: str, rounds: int) -> dict[str, float]:
    """Median seconds per call of the four builds of ``case``."""
    import tvm

    import jitbyoc

    from .run import vm_runner
    from .timing import time_blocks

    runs = {}
    for label, target in (("here", "llvm"), ("other", {"kind": "llvm", "mcpu": other})):
        for name, switch in (("jit", jitbyoc.enabled), ("tvm", jitbyoc.disabled)):
            with switch():
                runs[f"{label}/{name}"] = vm_runner(tvm.compile(case.mod, target=tvm.target.Target(target)),
                                                    case.inputs)
    return {k: statistics.median(v) for k, v in time_blocks(runs, rounds).items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from .case import Skip
    from .models import select
    from .run import machine_info

    info = machine_info(args.threads)
    print(f"CPU {info['cpu_model']} ({info['cpu']}), {args.threads} threads, load {info['loadavg']}; "
          f"other build: mcpu={args.other}")
    print(f"{'model':22s} {'jit here ms':>11s} {'jit other':>9s} {'speedup here':>12s} {'speedup other':>13s} "
          f"{'other/here':>10s}")
    for entry in select(args.model, False):
        case = entry.make()
        if isinstance(case, Skip):
            print(f"{entry.name:22s} skipped: {case.reason}")
            continue
        t = measure(case, args.other, args.rounds)
        here, other = t["here/tvm"] / t["here/jit"], t["other/tvm"] / t["other/jit"]
        print(f"{entry.name:22s} {t['here/jit'] * 1e3:11.3f} {t['other/jit'] * 1e3:9.3f} {here:12.1f} "
              f"{other:13.1f} {other / here:10.2f}", flush=True)


if __name__ == "__main__":
    main()
