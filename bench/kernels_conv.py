"""Conv/pool kernel benchmark: ``python -m bench.kernels_conv [--threads N] [--repeat N] [--quick]``.

Prints, per case, jitbyoc's median time (and GFLOP/s for convolutions) with same-process
median-of-repeats ratios against TVM's default build and torch eager (if installed;
numpy has no convolution, so it is not a peer here). jitbyoc, TVM default and torch are
each timed in blocks of warm calls of their own, taking turns (:func:`bench.timing.time_blocks`:
a call of one between two of another's would flush the layer from cache, and TVM's and
torch's pools spin after a call). Cases:

* the target conv: 1x64x56x56, 3x3, pad 1, + bias + relu (one fused jitbyoc region),
  with weight and bias as inputs, then as constants (``const w``: as a frontend imports a
  model; jitbyoc packs the weight at build time, :mod:`jitbyoc.tvm.conv_weights`);
* (without ``--quick``) every distinct conv of ResNet-18, each + bias + relu;
* max_pool2d 3x3/2 on ResNet-18's stem output, avg_pool2d 3x3/1 on an Inception branch's
  1x256x28x28, global adaptive_avg_pool2d on 1x512x7x7;
* ResNet-18, batch 1, 224x224 (``bench.models.resnet18``: BlockBuilder, BN folded);
* (without ``--quick``) bf16 and int8 rows (:func:`narrow_conv_cases`): ResNet-50's 3x3
  layers with constant weights, through :func:`jitbyoc.lower_precision` (bf16) or as
  uint8 x int8 convolutions summed in int32, against jitbyoc's float32 build of the
  layer, as a share of the ``vdpbf16ps`` / ``vpdpbusd`` loop timed in the same blocks
  (:func:`bench.kernels_matmul.bench_narrow_case`).

Nothing heavy is imported at module level: ``--threads`` must reach TVM_NUM_THREADS
before TVM starts its pool.
"""

from __future__ import annotations

import argparse
import os
import statistics

from .kernel_common import module, vm_function
from .kernels_matmul import in_turns, with_yardsticks, yardstick_rates
from .timing import time_blocks

# (name, x shape, w shape, stride, pad): ResNet-18's distinct convolutions
RESNET_CONVS = [
    ("stem 7x7/2", (1, 3, 224, 224), (64, 3, 7, 7), 2, 3),
    ("l1 3x3 64", (1, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    ("l2 3x3/2 128", (1, 64, 56, 56), (128, 64, 3, 3), 2, 1),
    ("l2 3x3 128", (1, 128, 28, 28), (128, 128, 3, 3), 1, 1),
    ("l2 1x1/2 down", (1, 64, 56, 56), (128, 64, 1, 1), 2, 0),
    ("l3 3x3 256", (1, 256, 14, 14), (256, 256, 3, 3), 1, 1),
    ("l4 3x3 512", (1, 512, 7, 7), (512, 512, 3, 3), 1, 1),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels_conv", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every candidate")
    p.add_argument("--repeat", type=int, default=15, help="timed rounds (median reported)")
    p.add_argument("--quick", action="store_true", help="target conv, pools and ResNet-18 only")
    p.add_argument("--target", metavar="TARGET", help="jitbyoc's and TVM's build target (bench/target.py): "
                   "JSON or a CPU name such as haswell; default llvm, this machine")
    return p.parse_args(argv)


def conv_case(name, xs, ws, stride, pad, rng, constant: bool = False):
    """conv + bias + relu; weight and bias are inputs, or (``constant``) constants as a
    frontend imports a model's weights, which jitbyoc packs at build time."""
    from tvm import relax

    x, w = rng.standard_normal(xs).astype("float32"), (rng.standard_normal(ws) * 0.1).astype("float32")
    b = rng.standard_normal((1, ws[0], 1, 1)).astype("float32")
    out = (xs[2] + 2 * pad - ws[2]) // stride + 1

    def body(bb, xv, wv=relax.const(w), bv=relax.const(b)):
        y = bb.emit(relax.op.nn.conv2d(xv, wv, strides=stride, padding=pad))
        return bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, bv))))

    def torch_run(t):
        import torch
        tx, tw, tb = t(x), t(w), t(b.reshape(-1))
        return lambda: torch.relu(torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=pad))

    params = [x] if constant else [x, w, b]
    return dict(name=f"conv {name} +bias+relu{', const w' if constant else ''}", mod=module(params, body), args=params,
                flops=2 * ws[0] * ws[1] * ws[2] * ws[3] * out * out, torch=torch_run)


# ResNet-50's 3x3 layers: the pixel engine's maps, and a 7x7 map on channel vectors
NARROW_CONVS = [("56x56 3x3 64", 64, 56), ("28x28 3x3 128", 128, 28), ("14x14 3x3 256", 256, 14),
                ("7x7 3x3 512", 512, 7)]


def narrow_conv_cases(rng) -> list:
    """bf16 (``lower_precision`` of conv + bias + relu) and int8 (``conv2d`` of uint8 by a
    constant int8 weight into int32) rows of :data:`NARROW_CONVS`, each with its float32
    layer (``fp32``) for the ratio."""
    import jitbyoc
    from tvm import relax

    rows = []
    for name, c, hw in NARROW_CONVS:
        fp32 = conv_case(name, (1, c, hw, hw), (c, c, 3, 3), 1, 1, rng, constant=True)
        flops, x = fp32["flops"], fp32["args"][0]
        rows.append(dict(name=f"bf16 conv {name}", mod=jitbyoc.lower_precision(fp32["mod"]), fp32=fp32["mod"],
                         args=[x], flops=flops, product="bfloat16"))
        w = rng.integers(-128, 128, (c, c, 3, 3)).astype("int8")
        xq = rng.integers(0, 256, x.shape).astype("uint8")

        def body(bb, xv, w=w):
            return bb.emit(relax.op.nn.conv2d(xv, relax.const(w), padding=1, out_dtype="int32"))
        rows.append(dict(name=f"int8 conv {name}", mod=module([xq], body), fp32=fp32["mod"], fp32_args=[x],
                         args=[xq], flops=flops, product="uint8"))
    return rows


def pool_case(kind: str, xs, rng):
    from tvm import relax

    x = rng.standard_normal(xs).astype("float32")
    body = {"max": lambda bb, xv: bb.emit(relax.op.nn.max_pool2d(xv, 3, 2, 1)),
            "avg": lambda bb, xv: bb.emit(relax.op.nn.avg_pool2d(xv, 3, 1, 1)),
            "global": lambda bb, xv: bb.emit(relax.op.nn.adaptive_avg_pool2d(xv, (1, 1)))}[kind]

    def torch_run(t):
        import torch.nn.functional as F
        tx = t(x)
        return {"max": lambda: F.max_pool2d(tx, 3, 2, 1),
                # ONNX AveragePool's default, as Inception's: padding not counted
                "avg": lambda: F.avg_pool2d(tx, 3, 1, 1, count_include_pad=False),
                "global": lambda: F.adaptive_avg_pool2d(tx, 1)}[kind]

    label = {"max": "max_pool2d 3x3/2", "avg": "avg_pool2d 3x3/1", "global": "global adaptive_avg_pool2d"}[kind]
    return dict(name=f"{label} {'x'.join(map(str, xs))}", mod=module([x], body), args=[x],
                flops=0, torch=torch_run)


def resnet_case():
    from bench.models import resnet18

    case = resnet18()
    return dict(name="ResNet-18 batch 1", mod=case.mod, args=case.inputs, flops=3.64e9,
                torch=lambda t: (lambda m, a: lambda: m(*a))(case.torch_module, [t(v) for v in case.inputs])
                if case.torch_module is not None else None, repeat=5)


def run_case(case, repeat: int, yardsticks: dict | None = None) -> dict:
    """jitbyoc's median and its ratios to TVM default and torch; ``yardsticks``:
    :func:`bench.kernels_matmul.yardstick_candidates`, timed in the same blocks for a
    case with FLOPs (``row[name + "_gflops"]``, their median rates)."""
    import numpy as np

    jit, tvm_default = (vm_function(case["mod"], off, case["args"]) for off in (True, False))
    err = float(np.abs(jit().numpy() - tvm_default().numpy()).max())
    repeat = min(repeat, case.get("repeat", repeat))
    fns = {"jitbyoc": jit, "tvm": tvm_default}
    try:
        import torch
        torch_fn = case["torch"](torch.from_numpy)
        if torch_fn is not None:
            fns["torch"] = torch.inference_mode()(torch_fn)
    except ImportError:
        pass
    sticks = yardsticks if case["flops"] else None
    # each in blocks of warm calls of its own, in turns: a TVM-default call (tens of ms,
    # every core) between two of jitbyoc's would flush the layer out of cache
    t = time_blocks(with_yardsticks(fns, sticks), repeat, budget=0.05)
    med = {k: statistics.median(v) for k, v in t.items()}
    row = dict(name=case["name"], ms=med["jitbyoc"] * 1e3, min_ms=min(t["jitbyoc"]) * 1e3,
               vs_tvm=med["tvm"] / med["jitbyoc"], err=err)
    if case["flops"]:
        row["gflops"] = case["flops"] / med["jitbyoc"] / 1e9
    row.update(yardstick_rates(med, sticks))
    if "torch" in med:
        row["vs_torch"] = med["torch"] / med["jitbyoc"]
        row["torch_ms"] = med["torch"] * 1e3
    return row


def _print(row: dict, peak: float) -> None:
    gf = f"{row['gflops']:7.1f} GF/s {100 * row['gflops'] / peak:3.0f}%" if "gflops" in row else " " * 17
    if "gflops" in row:
        gf += in_turns(row, row["gflops"])
    torch = f"  x{row['vs_torch']:5.2f} vs torch ({row['torch_ms']:.2f} ms)" if "vs_torch" in row else "  torch n/a"
    print(f"{row['name']:52s} {row['ms']:9.3f} ms (min {row['min_ms']:.3f}) {gf}  "
          f"x{row['vs_tvm']:7.1f} vs TVM{torch}  max|err| {row['err']:.1e}", flush=True)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np

    from . import target as build_target

    build_target.set_target(args.target)
    print(build_target.describe(), flush=True)

    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    target_conv = ("1x64x56x56 3x3 pad 1", (1, 64, 56, 56), (64, 64, 3, 3), 1, 1)
    cases = [conv_case(*target_conv, rng), conv_case(*target_conv, rng, constant=True)]
    if not args.quick:
        cases += [conv_case(*spec, rng) for spec in RESNET_CONVS]
    cases += [pool_case("max", (1, 64, 112, 112), rng), pool_case("avg", (1, 256, 28, 28), rng),
              pool_case("global", (1, 512, 7, 7), rng), resnet_case()]
    from .kernels_matmul import machine_peak, yardstick_candidates

    peak, sticks = machine_peak(args.threads), yardstick_candidates(args.threads)
    print(f"threads={args.threads} repeat={args.repeat} load={os.getloadavg()[0]:.1f}; "
          f"% = of the target ISA's FMA peak measured here, {peak:.1f} GFLOP/s; in turns: of the FMA "
          "loop's and the mix loop's (bench.contention) medians timed in the case's own blocks "
          "(ratios: median of the other / median of jitbyoc; >1 means jitbyoc is faster)")
    rows = []
    for case in cases:
        rows.append(run_case(case, args.repeat, sticks))
        rows[-1]["peak_pct"] = 100 * rows[-1]["gflops"] / peak if "gflops" in rows[-1] else None
        _print(rows[-1], peak)
    if not args.quick:
        from .kernels_matmul import bench_narrow_case, report_narrow

        for case in narrow_conv_cases(rng):
            t = bench_narrow_case(case, args.repeat, args.threads)
            print(report_narrow(case, t), flush=True)
            rows.append(dict(name=case["name"], ms=t["jitbyoc"] * 1e3, gflops=case["flops"] / t["jitbyoc"] / 1e9,
                             dot_gflops=t["dot_gflops"], vs_fp32=t["fp32"] / t["jitbyoc"]))
    return rows


if __name__ == "__main__":
    main()
