"""Measure the zoo suite: jitbyoc against onnxruntime, OpenVINO, torch eager and (small
models) TVM.

Per model: the frontend import, jitbyoc's cold build (and TVM's default build where the
entry allows it), one run of each to check jitbyoc against a reference (TVM default if
built, else onnxruntime, else torch), then the timing. Every candidate is timed in blocks
of warm calls that take turns (:func:`bench.timing.time_blocks`: jitbyoc, onnxruntime,
OpenVINO, torch, TVM, then the reverse order, ... ``rounds`` times), never call by call: a
thread pool keeps spinning after a call returns and would slow the next candidate. The
figure is the median of all timed calls. FLOPs come from the Relax module
(:mod:`bench.flops`), the peak from :func:`bench.kernels_matmul.machine_peak`, measured
once at the run's thread count.

``precision="bf16"`` (``--precision bf16``): jitbyoc (and TVM's default build, its exact
reference) build ``jitbyoc.lower_precision(mod, "bf16")``; the peers are onnxruntime
(fp32) and OpenVINO at its default precision and at f32 (torch eager runs fp32 only).
Every row also has each candidate's accuracy against the fp32 model, jitbyoc's fp32
build (:mod:`bench.accuracy`). The fastest peer is the fastest that runs at jitbyoc's
precision.

``precision="int8"`` (``--precision int8``): jitbyoc (and TVM's default build) build the
model's int8 QDQ copy (:mod:`bench.qdq`) imported by TVM's ONNX frontend; the peers are
onnxruntime and OpenVINO on that same file (``onnxruntime_int8``, ``openvino_int8``) and,
for reference, OpenVINO at its default precision and at f32 on the fp32 file. The peers'
accuracy against the fp32 model is in the row as jitbyoc's is. jitbyoc's output is
compared with TVM's build of the same QDQ module but not judged (no tolerance): rounding
flips of the int8 steps cascade through a deep model, and no bound has been measured.

``precision="fp16"`` (``--precision fp16``): the same with the model's float16 copy
(:mod:`bench.fp16`, float32 inputs and outputs): onnxruntime and OpenVINO (its default
precision, read back) on that file (``onnxruntime_fp16``, ``openvino_fp16``), OpenVINO at
its default precision and at f32 on the fp32 file for reference. jitbyoc is compared with
TVM's build of the same module but not judged: TVM's build sums float16 products in
float16, jitbyoc in float32, so their difference is mostly TVM's rounding.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import tempfile
import time
from pathlib import Path

from . import peers as peers_mod
from .accuracy import accuracy_fields
from .case import Skip
from .flops import count_flops
from .models import Entry
from .run import TOLERANCE, count_ops, failure, loadavg, offload_fields, vm_runner
from .timing import Stats, max_errors, time_blocks
from .zoo_build import prepare

log = logging.getLogger(__name__)
# the order of the blocks, after jitbyoc; jitbyoc_fp32 (bf16, int8, fp16 only) is jitbyoc's
# own fp32 build of the fp32 model, the reference of the narrow build's speed-up
PEERS = ("jitbyoc_fp32", "onnxruntime", "onnxruntime_int8", "openvino_int8", "onnxruntime_fp16",
         "openvino_fp16", "openvino", "openvino_f32", "torch", "tvm")
# the peers of each --precision (TVM default builds the module jitbyoc builds); at int8
# and fp16 OpenVINO on the fp32 file (default precision, f32) is a reference column
PEER_NAMES = {"fp32": ("onnxruntime", "openvino", "openvino_f32", "torch"),
              "bf16": ("onnxruntime", "openvino", "openvino_f32"),
              "int8": ("onnxruntime_int8", "openvino_int8", "openvino", "openvino_f32"),
              "fp16": ("onnxruntime_fp16", "openvino_fp16", "openvino", "openvino_f32")}
# what jitbyoc's output is checked against, the first that ran: only TVM's build runs the
# same bf16 (int8, fp16) module; the peers' outputs are the accuracy columns' business
REFERENCES = {"fp32": ("tvm", "onnxruntime", "torch"), "bf16": ("tvm",), "int8": ("tvm",),
              "fp16": ("tvm",)}
# max normwise rel err against it. At bf16 the fp32 sums' tiny differences of order flip
# some operands' rounding to bfloat16, and the flips cascade through a deep model
# (ShuffleNet: 1.6e-3 from TVM's build of the same module, both ~4e-3 from fp32): one
# bfloat16 ulp of the largest output is allowed. int8: None, reported but not judged
# (a flipped int8 step cascades too, and a softmax quantized in steps of 1/255 makes one
# step a large share of its largest output; no bound has been measured yet). fp16: None
# too (TVM's build sums float16 products in float16, jitbyoc in float32)
TOLERANCES = {"fp32": TOLERANCE, "bf16": 2.0 ** -7, "int8": None, "fp16": None}
# the dot-product loop "% peak" takes narrow products at (kernels_matmul.dot_machine_peak)
NARROW_PRODUCTS = {"bf16": "bfloat16", "int8": "uint8"}
BLOCK_SECONDS, SETTLE_SECONDS = 0.3, 0.1


def columns() -> list[str]:
    """Every key of a zoo result row, in CSV order (missing values are None)."""
    cols = ["model", "description", "precision", "activations", "reference", "tvm_default", "gflop",
            "lowered_gflop", "model_ops", "offloaded_ops", "total_ops", "offload_share",
            "regions", "cold_cache_hits", "left_to_tvm", "import_s", "lower_s", "quantize_s",
            "qdq_import_s", "qdq_file", "fp16_convert_s", "fp16_import_s", "fp16_file",
            "build_cold_jitbyoc_s", "build_tvm_s", "rounds", "loadavg"]
    for who in ("jitbyoc",) + PEERS:
        cols += [f"{who}_median_s", f"{who}_min_s", f"{who}_max_s", f"{who}_n", f"{who}_gflops",
                 f"{who}_precision"]
    cols += ["jitbyoc_peak_pct", "fastest_peer", "ratio_fastest"]
    cols += [f"ratio_{p}" for p in PEERS]
    cols += ["max_abs_err", "max_rel_err", "ok"]
    cols += [f"{p}_max_rel_err" for p in PEERS]
    for who in ("jitbyoc",) + PEERS:  # against the fp32 model (bench.accuracy)
        cols += [f"{who}_cos_err", f"{who}_top1"]
    return cols + ["notes"]


def check(outputs: dict, notes: list[str], references: tuple[str, ...],
          tolerance: float | None = TOLERANCE) -> dict:
    """jitbyoc's and the peers' errors against the first of ``references`` that ran.

    ``outputs`` holds each candidate's outputs (one run); TVM's default build is the
    reference when it was built, else onnxruntime, else torch (fp32; :data:`REFERENCES`).
    With ``tolerance`` None the errors are reported and ``ok`` stays None.
    """
    ref_name = next((n for n in references if n in outputs), None)
    got = {"reference": ref_name, "max_abs_err": None, "max_rel_err": None, "ok": None}
    if ref_name is None:
        notes.append(f"no reference to check against ({' or '.join(references)} not run)")
        return got
    ref = outputs[ref_name]
    got["max_abs_err"], got["max_rel_err"] = max_errors(outputs["jitbyoc"], ref)
    for name in PEERS:
        if name in outputs and name != ref_name:
            got[f"{name}_max_rel_err"] = max_errors(outputs[name], ref)[1]
    if tolerance is None:
        return got
    got["ok"] = bool(got["max_rel_err"] <= tolerance)
    if not got["ok"]:
        notes.insert(0, f"MISMATCH: jitbyoc rel err {got['max_rel_err']:.2e} vs {ref_name} "
                        f"> {tolerance:g}")
        log.warning("%s", notes[0])
    return got


def timing_fields(stats: dict[str, Stats], flops: int, peak: float,
                  precisions: dict[str, str] | None = None, lowered: float = 0.0,
                  narrow_peak: float | None = None) -> dict:
    """Medians, GFLOP/s, % of peak and the ratios of one row. ``precisions`` (default: all
    fp32) says what each candidate runs in: the fastest peer runs at jitbyoc's. With
    ``narrow_peak`` (the ``vdpbf16ps`` or ``vpdpbusd`` loop's GFLOP/s), ``% peak`` is the
    time the model's FLOPs would take at peak, its ``lowered`` FLOPs (bf16 or int8
    products) at that peak and the rest at ``peak``, over jitbyoc's median."""
    precisions = precisions or {}
    row = {}
    for who, st in stats.items():
        row.update({f"{who}_median_s": st.median, f"{who}_min_s": st.min,
                    f"{who}_max_s": st.max, f"{who}_n": st.n,
                    f"{who}_gflops": flops / st.median / 1e9 if flops else None,
                    f"{who}_precision": precisions.get(who, "fp32")})
    jit = stats["jitbyoc"].median
    if flops and peak:
        ideal = (flops - lowered) / peak + lowered / (narrow_peak or peak)
        row["jitbyoc_peak_pct"] = 100 * ideal / 1e9 / jit
    present = [p for p in PEERS if p in stats]
    for p in present:  # above 1: jitbyoc is slower than that peer
        row[f"ratio_{p}"] = jit / stats[p].median
    alike = [p for p in present if row[f"{p}_precision"] == row["jitbyoc_precision"]]
    if alike:
        row["fastest_peer"] = min(alike, key=lambda p: stats[p].median)
        row["ratio_fastest"] = jit / stats[row["fastest_peer"]].median
    return row


def measure(entry: Entry, rounds: int, workdir: str, threads: int, with_peers: bool,
            peak: float, precision: str = "fp32", narrow_peak: float | None = None,
            activations: str = "float32") -> dict | Skip:
    """Import, build, check and time one zoo model: a row (keys :func:`columns`) or a Skip.

    Parameters
    ----------
    entry : Entry
        A zoo-suite entry.
    rounds : int
        Rounds of timed blocks (see :func:`bench.timing.time_blocks`).
    workdir : str
        Where the ONNX peers may write the model's ONNX file.
    threads : int
        onnxruntime's and OpenVINO's threads (TVM's and torch's are set process-wide).
    with_peers : bool
        Run the peers of ``precision`` (:data:`PEER_NAMES`) too.
    peak : float
        The machine's measured peak in GFLOP/s, for "% of peak".
    precision : str
        What jitbyoc runs its products in: a key of :data:`PEER_NAMES` (see the module
        docstring).
    narrow_peak : float, optional
        The ``vdpbf16ps`` (bf16) or ``vpdpbusd`` (int8) loop's GFLOP/s: "% of peak" of
        the narrow products against it (int8: all of the model's, as if all ran in int8).
    activations : str
        At bf16, :func:`jitbyoc.lower_precision`'s ``activations`` (``--activations``).
    """
    got = prepare(entry, precision, workdir, activations)
    if isinstance(got, Skip):
        return got
    case, fields, built, reference, files = got
    runners = {"jitbyoc": vm_runner(built["ex_jit"], case.inputs)}
    if "ex_tvm" in built:
        runners["tvm"] = vm_runner(built["ex_tvm"], case.inputs)
    peers, notes = (peers_mod.make_peers(case, workdir, entry.name, threads, PEER_NAMES[precision],
                                         files) if with_peers else ([], ["peers off (--no-peers)"]))
    # an ONNX model has no torch form: every one of them would say so (the table's "-" does)
    notes = [n for n in notes if not n.endswith("no torch form of this model")] + \
        ([built["tvm_error"]] if "tvm_error" in built else [])
    try:
        outputs = {name: peers_mod.as_numpy(run()) for name, run in runners.items()}
        outputs.update({p.name: p.outputs for p in peers})
        checked = check(outputs, notes, REFERENCES[precision], TOLERANCES[precision])
        checked.update(accuracy_fields(outputs, outputs["jitbyoc"] if reference is None else reference))
    except Exception as err:
        return failure(entry, "run", err)
    if "ex_fp32" in built:  # timed, not checked: it is the accuracy columns' reference
        runners["jitbyoc_fp32"] = vm_runner(built["ex_fp32"], case.inputs)
    fns = {**runners, **{p.name: p.run for p in peers}}
    fns = {"jitbyoc": fns["jitbyoc"], **{n: fns[n] for n in PEERS if n in fns}}
    samples = time_blocks(fns, rounds, BLOCK_SECONDS, SETTLE_SECONDS)
    precisions = {"jitbyoc": precision, "tvm": precision, "jitbyoc_fp32": "fp32",
                  **{p.name: p.precision for p in peers}}
    flops = count_flops(case.mod)
    narrow = flops if precision == "int8" else fields.get("lowered_gflop", 0.0) * 1e9
    row = dict.fromkeys(columns())
    row.update(model=entry.name, description=entry.description, tvm_default=entry.tvm_default,
               gflop=flops / 1e9, model_ops=count_ops(case.mod), rounds=rounds,
               loadavg=(loadavg() or [None])[0], **fields, **offload_fields(built["report"]),
               **checked, **{k: v for k, v in built.items() if k.startswith("build_")},
               **timing_fields({k: Stats.of(v) for k, v in samples.items()}, flops, peak, precisions,
                               narrow, narrow_peak))
    row["notes"] = "; ".join(notes) or None
    return row


def run_suite(entries: list[Entry], args, threads: int, peak: float, tqdm,
              narrow_peak: float | None = None) -> tuple[list, list]:
    """Measure ``entries`` one after another; the rows and the skipped models."""
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="jitbyoc-zoo-") as workdir:
        bar = tqdm(entries, desc="zoo", unit="model")
        for entry in bar:
            bar.set_postfix_str(entry.name)
            rounds = args.repeat or (min(entry.repeat, 2) if args.quick else entry.repeat)
            got = measure(entry, rounds, workdir, threads, not args.no_peers, peak, args.precision,
                          narrow_peak, getattr(args, "activations", "float32"))
            if isinstance(got, dict):
                rows.append(got)
            else:
                log.warning("skipped %s: %s", entry.name, got.reason)
                skipped.append({"model": entry.name, "reason": got.reason})
            # the big models' weights (VGG-19: 0.5 GB, in several copies) go now
            for path in peers_mod.model_paths(workdir, entry.name):
                Path(path).unlink(missing_ok=True)
            gc.collect()
    return rows, skipped


def geomean(values) -> float | None:
    """Geometric mean of the positive finite values (None if there are none)."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def summarize(rows: list[dict]) -> dict:
    """The geomeans of jitbyoc's time over each peer's (and the fastest's), and the models
    whose cold build was slower than TVM's."""
    summary = {f"geomean_ratio_{p}": geomean(r[f"ratio_{p}"] for r in rows)
               for p in PEERS + ("fastest",)}
    summary["build_slower_than_tvm"] = [r["model"] for r in rows if r["build_tvm_s"] is not None
                                        and r["build_cold_jitbyoc_s"] > r["build_tvm_s"]]
    return summary


def main(args, entries: list[Entry], tqdm) -> int:
    """The zoo suite end to end: peak, models, table, files (``python -m bench --suite zoo``)."""
    from . import fp16, qdq, report, zoo_report
    from .kernels_matmul import dot_machine_peak, loop_name, machine_peak
    from .run import machine_info, warm_process

    threads = args.threads or os.cpu_count()
    copy = {"int8": qdq, "fp16": fp16}.get(args.precision)  # the module of its copies' recipe
    machine = machine_info(threads)
    peak = machine_peak(threads)
    machine["peak_gflops"] = peak
    product = NARROW_PRODUCTS.get(args.precision)
    narrow_peak = dot_machine_peak(product, threads) if product else None
    if product:
        machine[f"{args.precision}_peak_gflops"] = narrow_peak  # bf16_peak_gflops, int8_...
        machine[f"{args.precision}_loop"] = loop_name(product)
    print(report.format_machine(machine), flush=True)
    print(f"measured FMA peak {peak:.1f} GFLOP/s on {threads} thread(s)"
          + (f", {machine[args.precision + '_loop']} loop {narrow_peak:.1f}" if product else "")
          + f"; jitbyoc runs {args.precision}", flush=True)
    start = time.perf_counter()
    warm_process()
    rows, skipped = run_suite(entries, args, threads, peak, tqdm, narrow_peak)
    seconds = time.perf_counter() - start
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(rows)
    print(zoo_report.format_table(rows, skipped, machine, summary))
    paths = zoo_report.write_outputs(args.out, rows, skipped, machine, summary, {
        "suite": "zoo", "quick": args.quick, "models": args.model, "rounds": args.repeat,
        "threads": threads, "peers": not args.no_peers, "precision": args.precision,
        "activations": getattr(args, "activations", "float32"),
        "tolerance": TOLERANCES[args.precision], "block_seconds": BLOCK_SECONDS,
        "settle_seconds": SETTLE_SECONDS, "total_seconds": seconds,
        **({args.precision: {**copy.RECIPE, "cache": str(copy.CACHE_DIR)}} if copy else {})})
    print(f"{len(rows)} models measured, {len(skipped)} skipped in {seconds:.1f} s; "
          f"wrote {', '.join(str(p) for p in paths)}")
    return 0
