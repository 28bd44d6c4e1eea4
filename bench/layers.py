"""Layer by layer against onnxruntime: ``python -m bench.layers [MODEL] [--threads N] [--rounds N]``.

A zoo model (default ``torch_resnet50``; any name of ``python -m bench --suite zoo
--list``) is built by jitbyoc and run by onnxruntime from the same ONNX file. Each
runtime's own profiler times its layers inside the whole model's runs, where a layer's
operands are as cold or warm as the model leaves them (a layer timed alone keeps its
weights in cache: ResNet-50's 14x14 1x1 1024->256 runs at 90 % of peak alone and about
65 % in the model): ``jitbyoc.profile`` per region, onnxruntime's ``enable_profiling``
per node. They take turns, ``--rounds`` times, each in runs of its own; per layer the
median over rounds of jitbyoc's per-run time, and onnxruntime's median node time times its
calls.

Layers are matched by output shape and multiply-adds (a jitbyoc region's products and
onnxruntime's Conv/Gemm/MatMul nodes), and named from onnxruntime's weight shape:
``1x1 64->256 @56x56 +sum`` is a 1x1 convolution whose node also adds a residual. The
summary gives, per kind (1x1 conv, k x k conv, grouped conv, product), the FLOPs over
the time of all such layers as % of the FMA peak, for both runtimes: the goal of issue 13
for ResNet-50's 1x1 layers is 70 %. The peak is measured before every round, and each
round's layers are also given as % of their own round's peak: on a VM whose speed moves
in phases, a peak measured once, minutes before, makes a slow phase look like slow code.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass, field


@dataclass
class Layer:
    """One shape of layer: every call with that output shape and multiply-adds."""
    name: str = ""
    kind: str = "other"
    flops: float = 0.0  # per call
    calls: int = 0  # per run
    jit: dict = field(default_factory=dict)  # round -> seconds per run
    ort: dict = field(default_factory=dict)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="torch_resnet50", help="a zoo model (default torch_resnet50)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both runtimes")
    p.add_argument("--rounds", type=int, default=4, help="turns of each runtime's profiled runs")
    p.add_argument("--runs", type=int, default=20, help="profiled runs per turn")
    p.add_argument("--top", type=int, default=30, help="layers listed (slowest first); 0: all")
    return p.parse_args(argv)


def ort_layer(event: dict):
    """``(key, name, kind)`` of an onnxruntime node event, None if it is no conv or
    product. The key: (output shape, input channels per group, taps); onnxruntime's
    blocked layout pads channel counts (24 -> 32), so keys match jitbyoc's by
    :func:`compatible`, not equality."""
    args = event.get("args", {})
    op = args.get("op_name", "")
    shapes = [next(iter(s.values())) for s in args.get("input_type_shape", [])]
    outs = [next(iter(s.values())) for s in args.get("output_type_shape", [])]
    if op not in ("Conv", "FusedConv", "Gemm", "MatMul", "FusedMatMul") or len(shapes) < 2 or not outs:
        return None
    out, x, w = tuple(outs[0]), shapes[0], shapes[1]
    if not op.endswith("Conv"):
        name = f"{op} {'x'.join(map(str, x))} @ {'x'.join(map(str, w))}"
        return (out, x[-1], 1), name, "product"
    group = x[1] // w[1] if w[1] else 1
    kind = "grouped conv" if group > 1 else "1x1 conv" if math.prod(w[2:]) == 1 else "k x k conv"
    name = (f"{'x'.join(map(str, w[2:]))} {x[1]}->{w[0]} @{'x'.join(map(str, out[2:]))}"
            + (f" g{group}" if group > 1 else "") + (" +sum" if len(shapes) > 3 else ""))
    return (out, w[1], math.prod(w[2:])), name, kind


def compatible(ort_key, jit_key) -> bool:
    """Whether onnxruntime's layer ``ort_key`` is jitbyoc's ``jit_key`` = (output shape,
    multiply-adds per call), channel counts padded by up to a block of 16."""
    (out, cin, taps), (jout, macs) = ort_key, jit_key
    if len(out) != len(jout) or out[0] != jout[0] or out[2:] != jout[2:] or not 0 <= out[1] - jout[1] < 16:
        return False
    per_output, rest = divmod(macs, math.prod(jout) * taps)
    return rest == 0 and 0 <= cin - per_output < 16


def jit_layer_key(row):
    """The key of a jitbyoc profile row: (output shape, multiply-adds per call), or None."""
    if row.owner != "jitbyoc" or not row.gflop or not row.calls or "->" not in row.shapes:
        return None
    out = tuple(int(d) for d in row.shapes.split("->")[1].split(",")[0].strip().split("x"))
    return out, round(row.gflop * 1e9 / row.calls / 2)


def ort_profile(path: str, threads: int, feed_arrays, runs: int, prefix: str) -> list[dict]:
    """onnxruntime's node events over ``runs`` runs of a new session (after 3 untimed:
    their events are dropped by the medians of :func:`match` only as outliers)."""
    import onnxruntime as ort

    from .peers import session_options

    opts = session_options(threads)
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feed = dict(zip([i.name for i in sess.get_inputs()], feed_arrays))
    for _ in range(3 + runs):
        sess.run(None, feed)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def match(layers: dict, jit_rows: list, ort_events: list[dict], round_: int = 0) -> None:
    """Add round ``round_``'s figures to ``layers`` (key -> :class:`Layer`): onnxruntime's
    median time per node, summed over the nodes of a layer; jitbyoc's time per run."""
    durations, info = collections.defaultdict(list), {}
    for e in ort_events:
        got = ort_layer(e)
        if got is not None:
            durations[e["name"]].append(e["dur"] * 1e-6)
            info[e["name"]] = got
    ort = collections.defaultdict(lambda: [0.0, 0, set(), ""])  # time, nodes, names, kind
    for node, times in durations.items():
        key, name, kind = info[node]
        acc = ort[key]
        acc[0] += statistics.median(times)
        acc[1] += 1
        acc[2].add(name)
        acc[3] = kind
    jit = collections.defaultdict(lambda: [0.0, 0, ""])
    for row in jit_rows:
        key = jit_layer_key(row)
        if key is not None:
            jit[key][0] += row.seconds
            jit[key][1] += row.calls
            jit[key][2] = row.shapes
    for key, (seconds, calls, shapes) in jit.items():
        layer = layers.setdefault(key, Layer(name=f"jitbyoc [{shapes}]", flops=2.0 * key[1], calls=calls))
        layer.jit[round_] = seconds
    for okey, (seconds, nodes, names, kind) in ort.items():
        key = next((k for k in jit if compatible(okey, k)), okey)
        layer = layers.setdefault(key, Layer(calls=nodes))
        layer.name, layer.kind = " / ".join(sorted(names)), kind
        if key == okey:  # jitbyoc has no such layer: FLOPs of onnxruntime's (padded) shapes
            layer.flops = 2.0 * math.prod(okey[0]) * okey[1] * okey[2]
        layer.ort[round_] = seconds


def _pct(flops: float, seconds: float | None, peak: float) -> str:
    return f"{100 * flops / seconds / 1e9 / peak:5.1f}%" if seconds else f"{'-':>6}"


def _by_kind(timed) -> dict:
    """Per kind: [FLOPs, jitbyoc seconds, onnxruntime seconds] summed over the layers of
    ``timed`` (``(layer, jitbyoc seconds, onnxruntime seconds)``) that both runtimes ran."""
    kinds = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for layer, j, o in timed:
        if j and o:
            acc = kinds[layer.kind]
            acc[0] += layer.flops * max(layer.calls, 1)
            acc[1] += j
            acc[2] += o
    return kinds


def table(layers: dict, peak: float, top: int) -> str:
    """Per layer (slowest in jitbyoc first) and per kind of layer."""
    med = {k: (statistics.median(v.jit.values()) if v.jit else None,
               statistics.median(v.ort.values()) if v.ort else None) for k, v in layers.items()}
    order = sorted(layers, key=lambda k: -(med[k][0] or med[k][1] or 0))
    lines = [f"{'layer':44} {'calls':>5} {'jit ms':>8} {'%peak':>6} {'ort ms':>8} {'%peak':>6} {'jit/ort':>7}"]
    for k in order[:top or None]:
        layer, (j, o) = layers[k], med[k]
        fl = layer.flops * max(layer.calls, 1)
        ratio = f"{j / o:7.2f}" if j and o else f"{'-':>7}"
        lines.append(f"{layer.name[:44]:44} {layer.calls:5d} {_ms(j)} {_pct(fl, j, peak)} {_ms(o)} "
                     f"{_pct(fl, o, peak)} {ratio}")
    lines.append("per kind (layers both runtimes ran): FLOPs / time, as % of peak; jitbyoc / onnxruntime time")
    kinds = _by_kind((layer, *med[k]) for k, layer in layers.items())
    for kind, (fl, j, o) in sorted(kinds.items()):
        lines.append(f"  {kind:14} {fl / 1e9:7.2f} GFLOP  jitbyoc {j * 1e3:8.3f} ms {_pct(fl, j, peak)}   "
                     f"onnxruntime {o * 1e3:8.3f} ms {_pct(fl, o, peak)}   {j / o:5.2f}")
    return "\n".join(lines)


def round_shares(layers: dict, peaks: list[float]) -> str:
    """Per kind, each round's FLOPs over time as % of the FMA peak measured in that round
    (a VM's slow phases move the peak with the layers; a peak from another moment does
    not), for both runtimes, and the median over rounds."""
    kinds = collections.defaultdict(lambda: ([], []))
    for r, peak in enumerate(peaks):
        sums = _by_kind((layer, layer.jit.get(r), layer.ort.get(r)) for layer in layers.values())
        for kind, (fl, j, o) in sums.items():
            kinds[kind][0].append(100 * fl / j / 1e9 / peak)
            kinds[kind][1].append(100 * fl / o / 1e9 / peak)
    lines = [f"per kind and round, % of that round's peak ({', '.join(f'{p:.1f}' for p in peaks)} GFLOP/s):"]
    for kind, (jit, ort) in sorted(kinds.items()):
        lines.append(f"  {kind:14} jitbyoc {' '.join(f'{v:5.1f}' for v in jit)}  median {statistics.median(jit):5.1f}"
                     f"   onnxruntime {' '.join(f'{v:5.1f}' for v in ort)}  median {statistics.median(ort):5.1f}")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:8.3f}" if seconds else f"{'-':>8}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    import jitbyoc

    from .kernels_matmul import machine_peak
    from .models import ZOO
    from .peers import onnx_file
    from .report import format_machine
    from .run import machine_info

    case = ZOO[args.model].make()
    with jitbyoc.enabled():
        ex = tvm.compile(case.mod, target="llvm")
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    layers: dict = {}
    peaks = [machine_peak(args.threads)]
    print(format_machine(machine_info(args.threads)), flush=True)
    print(f"{args.model}: {args.rounds} rounds of {args.runs} profiled runs per runtime, in turns, "
          f"each after measuring the FMA peak; {peaks[0]:.1f} GFLOP/s on {args.threads} thread(s) first",
          flush=True)
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "model.onnx")
        why = onnx_file(case, path)
        if why:
            raise SystemExit(f"{args.model}: {why}")
        for r in range(args.rounds):
            if r:
                peaks.append(machine_peak(args.threads))
            prof = jitbyoc.profile(vm, *case.inputs, repeat=args.runs, peak_gflops=peaks[r])
            events = ort_profile(path, args.threads, case.inputs, args.runs, os.path.join(work, f"ort{r}"))
            match(layers, prof.rows, events, r)
    peak = statistics.median(peaks)
    print(f"% of peak below: of the median round's peak, {peak:.1f} GFLOP/s (rounds: "
          f"{min(peaks):.1f}-{max(peaks):.1f})")
    print(table(layers, peak, args.top))
    print(round_shares(layers, peaks))
    return layers


if __name__ == "__main__":
    main()
