"""Matmul kernel benchmark: ``python -m bench.kernels_matmul [--threads N] [--rounds N] [--quick]``.

Prints, per case, jitbyoc's median time, GFLOP/s and % of the measured machine peak, and
same-process, same-thread-count ratios of per-call medians against numpy (OpenBLAS),
torch (if installed) and TVM's default build. Candidates are timed in blocks that take
turns, each after a short quiet pause (see :func:`time_blocks`: call-by-call alternation
on 2 cores measures the previous candidate's still-spinning thread pool instead).
Cases: sgemm 2048^3, a linear layer in torch.export's form (``permute_dims`` + ``matmul``
+ bias + relu), and the MLP 784-1024-1024-10 at batch 64 (matmul+bias+relu), also in
the linear form.

Peak: an LLVM IR loop of 12 independent FMA chains of one vector register each
(``<16 x float>`` with AVX-512, ``<8 x float>`` with AVX2: wider vectors would not fit
in the registers and measure spills), compiled by llvmlite's MCJIT, called through ctypes
from ``threads`` Python threads (the GIL is released), best of 5 — the FLOP rate the cores
sustain at the clock they actually run (znver4: 32 FLOP per cycle per core, one 512-bit
FMA per cycle; znver3: 32, two 256-bit FMAs per cycle).

Nothing heavy is imported at module level: ``--threads`` must reach TVM_NUM_THREADS and
OPENBLAS_NUM_THREADS before those libraries start their pools.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .kernel_common import module, vm_function


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels_matmul", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every candidate")
    p.add_argument("--rounds", type=int, default=12, help="rounds of timed blocks (median of all calls)")
    p.add_argument("--quick", action="store_true", help="smaller sgemm (1024), fewer rounds")
    p.add_argument("--tvm", action="store_true", help="also time TVM's default build on sgemm "
                   "(single-threaded and unscheduled: tens of seconds at 2048)")
    return p.parse_args(argv)


# ---- peak ---------------------------------------------------------------------------------------

CHAINS, UNROLL = 12, 4  # independent FMA chains (>= latency 4 x 2 per cycle: fit 16 registers), unrolled


def _lanes() -> int:
    """float32 lanes of one vector register of this machine."""
    from jitbyoc.render.isa import vector_bits

    return vector_bits() // 32


def _peak_loop():
    """``float peak(int64 n)``: n iterations of CHAINS x UNROLL ``<LANES x float>`` FMAs,
    compiled by llvmlite's MCJIT; returns (callable, engine) (keep the engine alive)."""
    import ctypes

    import llvmlite.binding as llvm
    from llvmlite import ir

    from jitbyoc.build import jit

    f32, i64 = ir.FloatType(), ir.IntType(64)
    LANES = _lanes()  # noqa: N806
    vec = ir.VectorType(f32, LANES)
    module = ir.Module(name="peak")
    module.triple = llvm.get_process_triple()
    fma = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{LANES}f32")
    fn = ir.Function(module, ir.FunctionType(f32, [i64]), "peak")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    entry, loop, done = b.block, fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(i64(0), entry)
    accs = [b.phi(vec) for _ in range(CHAINS)]
    cur = list(accs)
    for _ in range(UNROLL):
        cur = [b.call(fma, [c, ir.Constant(vec, [1.0000001] * LANES), ir.Constant(vec, [0.999999] * LANES)])
               for c in cur]
    i.add_incoming(b.add(i, i64(1)), loop)
    for k, (acc, c) in enumerate(zip(accs, cur)):
        acc.add_incoming(ir.Constant(vec, [float(k)] * LANES), entry)
        acc.add_incoming(c, loop)
    b.cbranch(b.icmp_signed("<", b.add(i, i64(1)), fn.args[0]), loop, done)
    b.position_at_end(done)
    total = cur[0]
    for c in cur[1:]:  # every chain must be live, or LLVM deletes it
        total = b.fadd(total, c)
    b.ret(b.extract_element(total, ir.IntType(32)(0)))
    jit.target_machine()  # initializes LLVM's native target
    # MCJIT takes ownership of its target machine: give it its own, never jitbyoc's cached one
    tm = llvm.Target.from_triple(module.triple).create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=jit.host_features(), opt=3)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(str(module)), tm)
    engine.finalize_object()
    return ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(engine.get_function_address("peak")), engine


def fma_peak(threads: int, iters: int = 20_000_000) -> float:
    """GFLOP/s of ``threads`` threads each running :func:`_peak_loop`, best of 5 (called
    through ctypes, which releases the GIL)."""
    import threading

    peak, _engine = _peak_loop()
    rates = []
    for _ in range(5):
        workers = [threading.Thread(target=peak, args=(iters,)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        rates.append(threads * iters * CHAINS * UNROLL * 2 * _lanes() / (time.perf_counter() - start) / 1e9)
    return max(rates)


# ---- models -------------------------------------------------------------------------------------

def sgemm_case(n: int, rng):
    from tvm import relax

    a, b = (rng.standard_normal((n, n)).astype("float32") for _ in range(2))
    mod = module([("a", (n, n)), ("b", (n, n))], lambda bb, x, y: bb.emit(relax.op.matmul(x, y)))
    return dict(name=f"sgemm {n}x{n}x{n}", mod=mod, args=[a, b], flops=2 * n ** 3,
                numpy=lambda: a @ b, torch=lambda t: (lambda: t(a) @ t(b)))


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


# ---- timing -------------------------------------------------------------------------------------

def _torch_run(case):
    try:
        import torch
    except ImportError:
        return None
    return case["torch"](torch.from_numpy)


def time_blocks(fns: dict, rounds: int, budget: float = 0.1, settle: float = 0.1) -> dict:
    """Per-call seconds of each candidate, taken in blocks that take turns.

    A candidate's thread pool keeps spinning for a while after a call returns (OpenBLAS,
    TVM, torch alike), which on 2 cores starves whichever candidate runs next; timing
    call-by-call alternation measures that interference, not the kernels. So each round
    gives every candidate, in turn, ``settle`` seconds of quiet, one untimed call, then a
    block of calls worth about ``budget`` seconds, each timed. Round order alternates."""
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            time.sleep(settle)
            fns[name]()
            start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - t0)
                if time.perf_counter() - start > budget:
                    break
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_case(case, rounds: int, with_tvm: bool) -> dict:
    """Median seconds per call per candidate; jitbyoc is checked against numpy first."""
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
    out = time_blocks(fns, rounds)
    out["relerr"] = err
    return out


def report(case, t: dict, peak: float) -> str:
    gf = case["flops"] / t["jitbyoc"] / 1e9
    ratios = "  ".join(f"vs {k} {t[k] / t['jitbyoc']:.2f}x" for k in ("numpy", "torch", "tvm") if k in t)
    return (f"{case['name']:<34} {t['jitbyoc'] * 1e3:9.3f} ms {gf:7.1f} GFLOP/s {100 * gf / peak:5.1f}% "
            f"of peak | {ratios} | numpy {case['flops'] / t['numpy'] / 1e9:.1f} GFLOP/s | "
            f"rel err {t['relerr']:.1e}")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if "numpy" in sys.modules:
        print("note: numpy was imported before --threads applied; OpenBLAS keeps its default pool")
    import numpy as np
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    n = 1024 if args.quick else 2048
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    def machine_peak():  # one busy core is likelier than two: threads x the 1-thread rate
        return max(fma_peak(args.threads), args.threads * fma_peak(1))

    early = machine_peak()
    print(f"threads {args.threads}, load average at start {os.getloadavg()[0]:.2f}; "
          f"per-call medians over {rounds} rounds of timed blocks", flush=True)
    cases = [sgemm_case(n, rng), linear_case(64, 784, 1024, rng), mlp_case(64, rng),
             mlp_case(64, rng, linear=True)]
    results = [bench_case(c, rounds, args.tvm or not c["name"].startswith("sgemm")) for c in cases]
    peak = max(early, machine_peak())
    print(f"measured FMA peak {peak:.1f} GFLOP/s = {peak / args.threads / 32:.2f} GHz x 32 FLOP/cycle "
          f"x {args.threads} cores (best of {args.threads} threads and {args.threads} x 1 thread, at start and end)")
    for case, t in zip(cases, results):
        print(report(case, t, peak))
    print(f"load average at end {os.getloadavg()[0]:.2f}: other processes on the machine make every "
          f"number noisy; the ratios are taken side by side.")


if __name__ == "__main__":
    main()
