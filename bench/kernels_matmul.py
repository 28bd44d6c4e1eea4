"""Matmul kernel benchmark: ``python -m bench.kernels_matmul [--threads N] [--rounds N] [--quick]``.

Prints, per case, jitbyoc's median time, GFLOP/s and % of the measured machine peak, and
same-process, same-thread-count ratios of per-call medians against numpy (OpenBLAS),
torch (if installed) and TVM's default build. Candidates are timed in blocks that take
turns, each after a short quiet pause (see :func:`time_blocks`: call-by-call alternation
on 2 cores measures the previous candidate's still-spinning thread pool instead).
Cases: sgemm 2048^3, a linear layer in torch.export's form (``permute_dims`` + ``matmul``
+ bias + relu), and the MLP 784-1024-1024-10 at batch 64 (matmul+bias+relu), also in
the linear form. bfloat16 and int8 rows (:func:`narrow_cases`): BERT's and ViT's linear
layers with constant weights, through :func:`jitbyoc.lower_precision` (bf16) or in the QDQ
form of a quantized model (int8), against jitbyoc's float32 build of the same layer (and
torch's bfloat16 ``linear``), as a share of the ``vdpbf16ps`` / ``vpdpbusd`` loop.

Peak: :func:`jitbyoc.peak.machine_peak`, the FMA rate the cores sustain at the clock
they actually run (an LLVM loop of independent one-register FMA chains).

Nothing heavy is imported at module level: ``--threads`` must reach TVM_NUM_THREADS and
OPENBLAS_NUM_THREADS before those libraries start their pools.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

from .kernel_common import module, vm_function
from .timing import time_blocks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels_matmul", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every candidate")
    p.add_argument("--rounds", type=int, default=12, help="rounds of timed blocks (median of all calls)")
    p.add_argument("--quick", action="store_true", help="smaller sgemm (1024), fewer rounds")
    p.add_argument("--tvm", action="store_true", help="also time TVM's default build on sgemm "
                   "(single-threaded and unscheduled: tens of seconds at 2048)")
    p.add_argument("--target", metavar="TARGET", help="jitbyoc's and TVM's build target (bench/target.py): "
                   "JSON or a CPU name such as haswell; default llvm, this machine")
    return p.parse_args(argv)


# ---- peak: jitbyoc.peak (one FMA loop for the library's profiler and the benchmarks) ----------

def machine_peak(threads: int) -> float:
    """The FMA peak of the benchmark's target (:mod:`bench.target`): its vector ISA on
    this machine's cores."""
    from jitbyoc.peak import machine_peak as peak
    from jitbyoc.render import isa

    from . import target as build_target

    with isa.compiling_for(build_target.machine()):
        return peak(threads)


def dot_machine_peak(product: str, threads: int) -> float:
    """The dot-product loop's peak of ``product`` (``"bfloat16"``: ``vdpbf16ps``;
    ``"uint8"``: ``vpdpbusd``) on the benchmark's target (:func:`jitbyoc.peak.dot_peak`;
    its widened form where the target lacks the instruction)."""
    from jitbyoc.peak import dot_peak
    from jitbyoc.render import isa

    from . import target as build_target

    with isa.compiling_for(build_target.machine()):
        return dot_peak(product, threads)


def loop_name(product: str) -> str:
    """The loop ``product``'s peak is measured on, on the benchmark's target: its AMX tile
    instruction where the GEMM engine runs it on tiles (:mod:`jitbyoc.engines.gemm_tiles`),
    else its vector instruction (:data:`LOOPS`)."""
    from jitbyoc.engines import gemm_tiles

    from . import target as build_target

    if gemm_tiles.has_tiles(product, build_target.machine()):
        return gemm_tiles.INSTRUCTIONS[product][0].rsplit(".", 1)[-1] + " tile"
    return LOOPS[product]


def bf16_machine_peak(threads: int) -> float:
    return dot_machine_peak("bfloat16", threads)


def yardstick_candidates(threads: int) -> dict:
    """The loops "% in turns" divides by, as candidates of the timed blocks (``(run,
    flops)`` each) for the benchmark's target: ``peak``, the FMA loop
    (:func:`jitbyoc.peak.fma_runner`), and ``mix``, a kernel's inner-loop mix of loads,
    broadcasts and FMAs on L1-resident data (:func:`bench.contention.mix_runner`).
    Timed in the same rounds as the kernels, their medians come from the same phases of
    a VM whose speed moves; "% of peak" divides by the best of a few FMA-loop runs at
    start and end instead. A mix loop below the FMA loop means the cores' issue slots are
    being shared at the time (:mod:`bench.contention`)."""
    from jitbyoc.peak import fma_runner
    from jitbyoc.render import isa

    from . import target as build_target
    from .contention import mix_runner

    with isa.compiling_for(build_target.machine()):
        return {"peak": fma_runner(threads), "mix": mix_runner(threads)}


def with_yardsticks(fns: dict, yardsticks: dict | None) -> dict:
    """``fns`` and the yardsticks' runs (:func:`yardstick_candidates`), as candidates of the
    same timed blocks."""
    return {**fns, **{name: run for name, (run, _) in (yardsticks or {}).items()}}


def yardstick_rates(medians: dict, yardsticks: dict | None) -> dict:
    """``name + "_gflops"``: each yardstick's median rate, its FLOPs over its median seconds."""
    return {f"{name}_gflops": flops / medians[name] / 1e9 for name, (_, flops) in (yardsticks or {}).items()}


def in_turns(row: dict, gflops: float) -> str:
    """``(x% of the FMA loop, y% of the mix loop in turns)`` for a row that timed them."""
    if "peak_gflops" not in row:
        return ""
    return (f" ({100 * gflops / row['peak_gflops']:.1f}% of the FMA loop, "
            f"{100 * gflops / row['mix_gflops']:.1f}% of the mix loop in turns)")


# ---- models -------------------------------------------------------------------------------------

def sgemm_case(n: int, rng):
    from tvm import relax

    a, b = (rng.standard_normal((n, n)).astype("float32") for _ in range(2))
    mod = module([("a", (n, n)), ("b", (n, n))], lambda bb, x, y: bb.emit(relax.op.matmul(x, y)))
    return dict(name=f"sgemm {n}x{n}x{n}", mod=mod, args=[a, b], flops=2 * n ** 3,
                numpy=lambda: a @ b, torch=lambda t: (lambda: t(a) @ t(b)))


def gemv_case(k: int, n: int, rng):
    """One row times a row-major (k, n) matrix: the GEMV path's column form (a decoder's
    token step through a (in, out) weight, GPT-2's Conv1D)."""
    from tvm import relax

    x, w = rng.standard_normal((1, k)).astype("float32"), rng.standard_normal((k, n)).astype("float32")
    mod = module([("x", (1, k)), ("w", (k, n))], lambda bb, xv, wv: bb.emit(relax.op.matmul(xv, wv)))
    return dict(name=f"gemv 1x{k} @ {k}x{n}", mod=mod, args=[x, w], flops=2 * k * n,
                numpy=lambda: x @ w, torch=lambda t: (lambda: t(x) @ t(w)))


def linear_case(m: int, k: int, n: int, rng):
    """torch.export's linear: permute_dims(w) + matmul + bias (+ relu)."""
    from tvm import relax

    x, w, bias = (rng.standard_normal(s).astype("float32") for s in ((m, k), (n, k), (n,)))
    mod = module([("x", (m, k)), ("w", (n, k)), ("b", (n,))],
                  lambda bb, xv, wv, bv: bb.emit(relax.op.nn.relu(bb.emit(relax.op.linear(xv, wv, bv)))))
    return dict(name=f"linear+relu {m}x{k}->{n}", mod=mod, args=[x, w, bias], flops=2 * m * k * n,
                numpy=lambda: __import__("numpy").maximum(x @ w.T + bias, 0),
                torch=lambda t: (lambda: __import__("torch").relu(
                    __import__("torch").nn.functional.linear(t(x), t(w), t(bias)))))


def mlp_case(batch: int, rng, sizes=(784, 1024, 1024, 10), linear=False):
    """matmul + bias (+ relu between layers), weights stored (in, out); with ``linear``,
    torch.export's form: weights (out, in) through ``relax.op.linear`` (permute_dims)."""
    import numpy as np
    from tvm import relax

    x = rng.standard_normal((batch, sizes[0])).astype("float32")
    ws = [(rng.standard_normal((i, o)) / np.sqrt(i)).astype("float32") for i, o in zip(sizes, sizes[1:])]
    ws = [np.ascontiguousarray(w.T) for w in ws] if linear else ws
    bs = [rng.standard_normal(o).astype("float32") for o in sizes[1:]]
    params = [("x", (batch, sizes[0]))] + [(f"w{j}", w.shape) for j, w in enumerate(ws)] + \
        [(f"b{j}", b.shape) for j, b in enumerate(bs)]

    def body(bb, xv, *rest):
        h = xv
        for j, (w, b) in enumerate(zip(rest[:len(ws)], rest[len(ws):])):
            h = bb.emit(relax.op.linear(h, w, b) if linear else relax.op.add(bb.emit(relax.op.matmul(h, w)), b))
            h = bb.emit(relax.op.nn.relu(h)) if j < len(ws) - 1 else h
        return h

    def numpy_mlp():
        h = x
        for j, (w, b) in enumerate(zip(ws, bs)):
            h = (h @ w.T if linear else h @ w) + b
            h = np.maximum(h, 0) if j < len(ws) - 1 else h
        return h

    flops = 2 * batch * sum(i * o for i, o in zip(sizes, sizes[1:]))
    return dict(name=f"MLP {'-'.join(map(str, sizes))} b{batch}{' (linear)' if linear else ''}",
                mod=module(params, body), args=[x, *ws, *bs], flops=flops, numpy=numpy_mlp,
                torch=lambda t: _torch_mlp([t(w) for w in ws], [t(b) for b in bs], t(x), linear))


def _torch_mlp(ws, bs, x, linear: bool):
    import torch

    def run():
        h = x
        for j, (w, b) in enumerate(zip(ws, bs)):
            h = torch.nn.functional.linear(h, w, b) if linear else torch.addmm(b, h, w)
            h = torch.relu(h) if j < len(ws) - 1 else h
        return h
    return run


def _linear_layer(m: int, k: int, n: int, rng):
    """``x, W, b`` and ``gelu(x @ W.T + b)`` with a constant weight, as a Relax module."""
    import numpy as np
    from tvm import relax

    x = rng.standard_normal((m, k)).astype("float32")
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float32")
    bias = rng.standard_normal(n).astype("float32")
    mod = module([("x", (m, k))], lambda bb, xv: bb.emit(relax.op.nn.gelu(bb.emit(relax.op.add(
        bb.emit(relax.op.matmul(xv, bb.emit(relax.op.permute_dims(relax.const(w))))), relax.const(bias))))))
    return x, w, bias, mod


def bf16_case(m: int, k: int, n: int, rng):
    """``gelu(x @ W.T + b)`` lowered to bfloat16 operands summed in float32
    (:func:`jitbyoc.lower_precision`); the float32 layer is the same module, not lowered."""
    import jitbyoc

    x, w, bias, mod = _linear_layer(m, k, n, rng)

    def torch_bf16(t):
        import torch
        tx, tw, tb = (t(v).to(torch.bfloat16) for v in (x, w, bias))
        return lambda: torch.nn.functional.gelu(torch.nn.functional.linear(tx, tw, tb))

    return dict(name=f"bf16 linear+gelu {m}x{k}->{n}", mod=jitbyoc.lower_precision(mod), fp32=mod, args=[x],
                flops=2 * m * k * n, torch=torch_bf16, product="bfloat16")


def int8_case(m: int, k: int, n: int, rng):
    """A quantized linear layer as TVM's ONNX frontend imports a QDQ graph:
    ``quantize(gelu(dequantize(quantize(x)) @ dequantize(Wq) + b))`` with uint8 activations
    and a per-column int8 weight, which jitbyoc runs as one uint8 x int8 product
    (:mod:`jitbyoc.tvm.quantized`); the float32 row is the unquantized layer."""
    import numpy as np
    from tvm import relax

    x, w, bias, fp32 = _linear_layer(m, k, n, rng)
    sw = (np.abs(w).max(axis=1) / 127).astype("float32")
    wq = np.round(w.T / sw).astype("int8")  # (k, n), per column
    sx, sy = np.float32(np.abs(x).max() / 127), np.float32(0.05)
    op, c = relax.op, relax.const

    def body(bb, xv):
        q = bb.emit(op.quantize(xv, c(sx), c(128, "uint8"), axis=1, out_dtype="uint8"))
        xf = bb.emit(op.dequantize(q, c(sx), c(128, "uint8"), axis=1))
        wf = bb.emit(op.dequantize(c(wq), c(sw), c(np.zeros(n, "int8")), axis=1))
        y = bb.emit(op.nn.gelu(bb.emit(op.add(bb.emit(op.matmul(xf, wf)), c(bias)))))
        out = bb.emit(op.quantize(y, c(sy), c(128, "uint8"), axis=1, out_dtype="uint8"))
        return bb.emit(op.dequantize(out, c(sy), c(128, "uint8"), axis=1))
    return dict(name=f"int8 QDQ linear {m}x{k}->{n}", mod=module([("x", (m, k))], body), fp32=fp32, args=[x],
                flops=2 * m * k * n, product="uint8")


LOOPS = {"bfloat16": "vdpbf16ps", "uint8": "vpdpbusd"}  # the instruction each narrow product runs on
FEATURES = {"bfloat16": "avx512bf16", "uint8": "avx512vnni"}


def bench_narrow_case(case, rounds: int, threads: int) -> dict:
    """Median seconds per call of the narrow layer, its float32 build (on
    ``case["fp32_args"]`` where its inputs are not the narrow layer's), torch's (bfloat16
    linear), and the product's dot-product loop, in the same timed blocks."""
    from jitbyoc.peak import dot_runner
    from jitbyoc.render import isa

    from . import target as build_target

    fns = {"jitbyoc": vm_function(case["mod"], True, case["args"]),
           "fp32": vm_function(case["fp32"], True, case.get("fp32_args", case["args"]))}
    torch_run = _torch_run(case) if "torch" in case else None
    if torch_run is not None:
        fns["torch"] = torch_run
    with isa.compiling_for(build_target.machine()):
        sticks = {"dot": dot_runner(case["product"], threads)}
    out = {name: statistics.median(t) for name, t in time_blocks(with_yardsticks(fns, sticks), rounds).items()}
    out.update(yardstick_rates(out, sticks))
    del out["dot"]
    return out


def report_narrow(case, t: dict) -> str:
    gf = case["flops"] / t["jitbyoc"] / 1e9
    ratios = "  ".join(f"vs {k} {t[k] / t['jitbyoc']:.2f}x" for k in ("fp32", "torch") if k in t)
    return (f"{case['name']:<34} {t['jitbyoc'] * 1e3:9.3f} ms {gf:7.1f} G(FL)OP/s {100 * gf / t['dot_gflops']:5.1f}% "
            f"of the {loop_name(case['product'])} loop in turns ({t['dot_gflops']:.0f}) | {ratios} (fp32: jitbyoc's "
            f"float32 build{'; torch: bfloat16 linear' if 'torch' in t else ''})")


def narrow_cases(rng) -> list:
    """The bf16 and int8 rows: BERT-base's and ViT-base's linear layers."""
    shapes = ((128, 768, 3072), (128, 3072, 768), (197, 768, 768))
    return [make(*shape, rng) for make in (bf16_case, int8_case) for shape in shapes]


# ---- timing -------------------------------------------------------------------------------------

def _torch_run(case):
    try:
        import torch
    except ImportError:
        return None
    return case["torch"](torch.from_numpy)


def bench_case(case, rounds: int, with_tvm: bool, yardsticks: dict | None = None) -> dict:
    """Median seconds per call per candidate; jitbyoc is checked against numpy first.
    ``yardsticks``: name -> ``(run, flops)`` (:func:`yardstick_candidates`), timed in the
    same blocks; the median rate of each is ``out[name + "_gflops"]``."""
    import numpy as np

    jit = vm_function(case["mod"], True, case["args"])
    got, want = jit().numpy(), case["numpy"]()
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    fns = {"jitbyoc": jit, "numpy": case["numpy"]}
    torch_run = _torch_run(case)
    if torch_run is not None:
        fns["torch"] = torch_run
    if with_tvm:
        fns["tvm"] = vm_function(case["mod"], False, case["args"])
    out = {name: statistics.median(t) for name, t in time_blocks(with_yardsticks(fns, yardsticks), rounds).items()}
    out.update(yardstick_rates(out, yardsticks))
    for name in yardsticks or {}:
        del out[name]
    out["relerr"] = err
    return out


OPENBLAS_HOLDS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def openblas_unheld() -> dict:
    """Unset, in this process only (before numpy loads OpenBLAS), the variables some
    machines set to hold OpenBLAS to an older kernel (Haswell's AVX2 one on AVX-512 CPUs:
    about half its speed), so numpy is measured at its proper speed; returns them."""
    return {k: os.environ.pop(k) for k in OPENBLAS_HOLDS if k in os.environ}


AVX2_KERNEL = "Haswell"  # OpenBLAS's AVX2 + FMA kernel


def openblas_for(target: str | None) -> dict:
    """Choose, in this process only and before numpy loads OpenBLAS, the kernel numpy runs:
    the machine's own (:func:`openblas_unheld`), or for an x86 target without AVX-512 on
    an AVX-512 machine OpenBLAS's AVX2 kernel, so "vs numpy" compares code of the same
    vector ISA (OpenBLAS's AVX-512 kernel would set a bar the target cannot use). Returns
    what was unset."""
    held = openblas_unheld()
    if target and platform.machine() == "x86_64" and _x86_without_avx512(target):
        os.environ["OPENBLAS_CORETYPE"] = AVX2_KERNEL
    return held


def _x86_without_avx512(target: str) -> bool:
    """Whether ``target`` names an x86 machine without AVX-512, asked of
    :func:`bench.target.machine` in a child process (TVM imports numpy, which must not
    load here yet)."""
    import subprocess

    code = ("import sys; from bench import target as t; t.set_target(sys.argv[1]); m = t.machine(); "
            "print(int(m.arch == 'x86_64' and not m.has('avx512f')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, target], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"--target {target}: {out.stderr.strip().splitlines()[-1] if out.stderr else 'failed'}")
    return out.stdout.strip().endswith("1")


def openblas_kernel(held: dict) -> str:
    """Which kernel numpy's OpenBLAS runs (threadpoolctl), and what was unset or set for it."""
    notes = [f"unset here: {', '.join(f'{k}={v}' for k, v in held.items())}"] if held else []
    if os.environ.get("OPENBLAS_CORETYPE") == AVX2_KERNEL:
        notes.append(f"set here: OPENBLAS_CORETYPE={AVX2_KERNEL}, the target's ISA")
    note = f" ({'; '.join(notes)})" if notes else ""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return f"numpy's BLAS kernel: unknown (pip install threadpoolctl){note}"
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    kinds = ", ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in blas)
    return f"numpy's BLAS: {kinds or 'none found'}{note}"


def report(case, t: dict, peak: float) -> str:
    gf = case["flops"] / t["jitbyoc"] / 1e9
    ratios = "  ".join(f"vs {k} {t[k] / t['jitbyoc']:.2f}x" for k in ("numpy", "torch", "tvm") if k in t)
    return (f"{case['name']:<34} {t['jitbyoc'] * 1e3:9.3f} ms {gf:7.1f} GFLOP/s {100 * gf / peak:5.1f}% "
            f"of peak{in_turns(t, gf)} | {ratios} | numpy {case['flops'] / t['numpy'] / 1e9:.1f} GFLOP/s | "
            f"rel err {t['relerr']:.1e}")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    held = openblas_for(args.target)
    if "numpy" in sys.modules:
        print("note: numpy was imported before --threads applied; OpenBLAS keeps its default pool")
    import numpy as np
    print(openblas_kernel(held), flush=True)
    from . import target as build_target

    build_target.set_target(args.target)
    print(build_target.describe(), flush=True)
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    n = 1024 if args.quick else 2048
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    early = machine_peak(args.threads)
    print(f"threads {args.threads}, load average at start {os.getloadavg()[0]:.2f}; "
          f"per-call medians over {rounds} rounds of timed blocks", flush=True)
    cases = [sgemm_case(n, rng), linear_case(64, 784, 1024, rng), mlp_case(64, rng),
             mlp_case(64, rng, linear=True), gemv_case(4096, 4096, rng), linear_case(1, 4096, 4096, rng)]
    sticks = yardstick_candidates(args.threads)
    results = [bench_case(c, rounds, args.tvm or not c["name"].startswith("sgemm"), sticks) for c in cases]
    peak = max(early, machine_peak(args.threads))
    turns = ", ".join(f"{t['peak_gflops']:.0f} / {t['mix_gflops']:.0f}" for t in results)
    print(f"measured FMA peak {peak:.1f} GFLOP/s, {peak / args.threads:.1f} per core "
          f"(best of {args.threads} threads and {args.threads} x 1 thread, at start and end); in turns "
          f"with the cases, median FMA loop / mix loop per case: {turns}")
    for case, t in zip(cases, results):
        print(report(case, t, peak))
    for case in narrow_cases(rng):
        if not build_target.machine().has(FEATURES[case["product"]]):
            print(f"{case['name']}: skipped, {build_target.machine().cpu} has no {FEATURES[case['product']]}")
            continue
        print(report_narrow(case, bench_narrow_case(case, rounds, args.threads)), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}: other processes on the machine make every "
          f"number noisy; the ratios are taken side by side.")


if __name__ == "__main__":
    main()
