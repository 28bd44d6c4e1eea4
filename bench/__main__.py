"""``python -m bench``: jitbyoc against TVM's default build (and torch/onnxruntime if installed).

Nothing here imports TVM at module level: ``--threads`` must set ``TVM_NUM_THREADS``
before TVM starts its thread pool.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_REPEAT_CAP = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the smoke suite (under 2 minutes)")
    p.add_argument("--suite", default="default", metavar="NAME",
                   help="'default' (small models, jitbyoc vs TVM default) or 'zoo' (real "
                   "architectures at full size vs onnxruntime and torch); see --list")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="run only this model (repeatable); see --list")
    p.add_argument("--list", action="store_true", help="list the suites and models and exit")
    p.add_argument("--repeat", type=int, metavar="N", help="timed runs per candidate; zoo "
                   "suite: rounds of timed blocks (default: per model, few for heavy models)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed rounds first")
    p.add_argument("--threads", type=int, metavar="N",
                   help="TVM_NUM_THREADS, torch, onnxruntime and openvino threads")
    p.add_argument("--out", type=Path, metavar="DIR", help="where results.json/.csv and the "
                   f"plot go (default {DEFAULT_OUT}, {DEFAULT_OUT / 'zoo'} for the zoo suite)")
    p.add_argument("--no-peers", action="store_true", help="skip torch, onnxruntime and openvino")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8", "fp16"), default="fp32", help="zoo "
                   "suite: what jitbyoc's products run in; bf16 builds jitbyoc.lower_precision(mod, "
                   "'bf16'), int8 the model's int8 QDQ copy (onnxruntime's quantize_static) "
                   "against onnxruntime and OpenVINO on that copy; fp16 the model's float16 copy "
                   "(onnxruntime's convert_float_to_float16, float32 inputs and outputs) against "
                   "onnxruntime and OpenVINO on that copy; all report accuracy against the fp32 "
                   "model (default fp32)")
    p.add_argument("--activations", choices=("float32", "bf16"), default="float32", help="with "
                   "--precision bf16: jitbyoc.lower_precision's activations; bf16 stores a value "
                   "that a product reads rounded once, in bfloat16, and widens it for elementwise "
                   "work (OpenVINO's bf16 default keeps activations so); default float32")
    p.add_argument("--keep-cache", action="store_true", help="use jitbyoc's own disk cache "
                   "(default: an empty temporary one, so cold builds are cold)")
    p.add_argument("--target", metavar="TARGET", help="build for this TVM target: JSON "
                   "('{\"kind\": \"llvm\", \"mcpu\": \"haswell\"}'), or a CPU name (haswell); "
                   "default llvm, this machine")
    p.add_argument("--rpc", metavar="HOST:PORT", help="run the default suite's models on a TVM "
                   "RPC server (bench/remote.py) instead of here")
    p.add_argument("--cc", metavar="COMPILER", help="with --rpc: the compiler export_library links "
                   "with (a cross compiler for another architecture)")
    p.add_argument("--busy-cpu", type=int, metavar="CPU", help="keep a busy process pinned to "
                   "this CPU while the suite runs (a loaded machine: how each runtime's thread "
                   "pool copes with a core it must share)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (tracebacks)")
    return p.parse_args(argv)


def run_suite(args, entries, tqdm) -> tuple[list[dict], list[dict]]:
    from .run import measure

    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="jitbyoc-bench-") as workdir:
        bar = tqdm(entries, desc="bench", unit="model", file=sys.stderr)
        for entry in bar:
            bar.set_postfix_str(entry.name)
            repeat = args.repeat or entry.repeat
            if args.quick and not args.repeat:
                repeat = min(repeat, QUICK_REPEAT_CAP)
            got = measure(entry, repeat, args.warmup, workdir, args.threads, not args.no_peers)
            if isinstance(got, dict):
                rows.append(got)
            else:
                log.warning("skipped %s: %s", entry.name, got.reason)
                skipped.append({"model": entry.name, "reason": got.reason})
    return rows, skipped


def write_outputs(args, rows, skipped, machine, seconds) -> list[Path]:
    from . import report
    from .run import TOLERANCE, columns

    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"quick": args.quick, "models": args.model, "repeat": args.repeat,
                "warmup": args.warmup, "threads": args.threads, "peers": not args.no_peers,
                "jitbyoc_disk_cache": "user's" if args.keep_cache else "empty temporary",
                "tolerance": TOLERANCE, "timer": "time.perf_counter around one call; tvm and "
                "jitbyoc alternating, then the peers alternating; after warm-up rounds"}
    payload = {"machine": machine, "settings": settings, "total_seconds": seconds,
               "columns": columns(), "rows": rows, "skipped": skipped}
    paths = [args.out / "results.json", args.out / "results.csv"]
    report.write_json(paths[0], payload)
    report.write_csv(paths[1], rows, columns())
    plot = args.out / "speedup.png"
    if rows and report.plot_speedups(plot, rows, report.format_machine(machine)):
        paths.append(plot)
    return paths


def list_models(models) -> str:
    """Every suite and its models: name, tags (quick, tvm) and description."""
    lines = []
    for suite in models.SUITES:
        cmd = "python -m bench" + ("" if suite == "default" else f" --suite {suite}")
        lines.append(f"suite {suite} ({cmd}):")
        for e in (e for e in models.ZOO.values() if e.suite == suite):
            tags = ["quick" if e.quick else ""]
            if suite == "zoo":  # the default suite always builds TVM default
                tags.append("tvm" if e.tvm_default else "")
            lines.append(f"  {e.name:24s} {' '.join(f'{t:5s}' for t in tags)} {e.description}")
    if any(e.suite == "zoo" for e in models.ZOO.values()):
        lines.append("(quick: in --quick; tvm: the zoo suite also builds and times TVM default)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.busy_cpu is not None:
            stack.enter_context(busy_cpu(args.busy_cpu))
        from .run import cold_cache

        stack.enter_context(cold_cache(args.keep_cache))
        return bench(args)


@contextlib.contextmanager
def busy_cpu(cpu: int):
    """A process spinning on ``cpu`` (and only there) until the block ends (yielded)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise SystemExit(f"--busy-cpu {cpu}: this process may run on CPUs {allowed} only")
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    spin = subprocess.Popen([sys.executable, "-c", code])
    os.environ["JITBYOC_BENCH_BUSY_CPU"] = str(cpu)  # for the machine record
    try:
        yield spin
    finally:
        spin.kill()
        spin.wait()
        os.environ.pop("JITBYOC_BENCH_BUSY_CPU", None)


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:  # jitbyoc logs every build at INFO; the table says it all
        logging.getLogger("jitbyoc").setLevel(logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def bench(args: argparse.Namespace) -> int:
    """Run the suite ``args`` describe; print the table and write the files."""
    configure_logging(args.verbose)
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM creates its pool
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        log.error("the harness needs tqdm and matplotlib: pip install 'jitbyoc[bench]'")
        return 2
    from . import models, peers, report, run
    from . import target as build_target

    build_target.set_target(args.target)
    if args.rpc:
        from . import remote

        return remote.main(args)

    if args.list:
        print(list_models(models))
        return 0
    try:
        entries = models.select(args.model, args.quick, args.suite)
    except KeyError as err:
        log.error("%s", err.args[0])
        return 2
    zoo = bool(entries) and entries[0].suite == "zoo"
    if args.precision != "fp32" and not zoo:
        log.error("--precision %s needs --suite zoo (the default suite's weights are inputs, "
                  "which lower_precision and the float16 converter leave float32, and "
                  "quantize_static would quantize as activations)", args.precision)
        return 2
    args.out = args.out or (DEFAULT_OUT / "zoo" if zoo else DEFAULT_OUT)
    if zoo:  # every runtime gets TVM's thread count, explicitly (its pool is not started
        # yet: it starts at the first parallel call; importing jitbyoc set the default)
        args.threads = args.threads or int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count())
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    peers.set_torch_threads(args.threads)
    if zoo:
        from . import zoo_run

        with logging_redirect_tqdm():
            return zoo_run.main(args, entries, tqdm)
    machine = run.machine_info(args.threads)
    print(report.format_machine(machine), flush=True)
    start = time.perf_counter()
    with logging_redirect_tqdm():
        run.warm_process()
        rows, skipped = run_suite(args, entries, tqdm)
    seconds = time.perf_counter() - start
    print(report.format_table(rows, skipped))
    paths = write_outputs(args, rows, skipped, machine, seconds)
    print(f"{len(rows)} models measured, {len(skipped)} skipped in {seconds:.1f} s; "
          f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
