"""How much of the FMA peak a kernel's instruction mix can reach right now:
``python -m bench.contention [--seconds S] [--threads N] [--target T]``.

The FMA peak (:mod:`jitbyoc.peak`) is a loop of FMAs on registers, one instruction per
FMA. A convolution's or GEMM's inner loop also loads: per register block of ``J x V``
accumulators, ``V`` vector loads and ``J`` broadcast weights per tap (:data:`BLOCKS`,
the blocks the conv engine picks: 16 x 1 with 32 registers, where AVX-512 folds each
broadcast into its FMA; 4 x 3 with 16, where AVX2 issues a separate broadcast and a tap
is 19 instructions for 12 FMAs). This *mix loop* runs a 3x3 window of such taps per
step, unrolled as the conv engine runs it, on an L1-resident buffer, so it never waits
on memory: on a machine of its own it runs at the FMA peak. When it runs slower than the
FMA loop timed next to it, the core's issue slots or load ports are being shared, as
with another hardware thread (another guest's vCPU on the same core of a VM host), and
every kernel with that mix is slowed alike; the FMA-only loop hardly notices. The ratio
tells "the machine is contended now" from "the kernel is slow".

Both loops take turns in blocks (``--seconds`` in all); the table gives each block's
GFLOP/s and the ratio, then the median, min and max ratio. The kernel benchmarks time
the mix loop as a candidate of their blocks (:func:`bench.kernels_matmul.yardstick_candidates`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

BUFFER_FLOATS = 2048  # 8 KB: L1-resident
BLOCKS = {32: (16, 1), 16: (4, 3)}  # vector registers -> (J, V), as conv_engine's plans
WINDOW = (3, 3)  # a step is one input channel's 3x3 window, unrolled as the conv engine runs it
ROW = 64  # floats between two rows of the window in the buffer


def mix_ir(lanes: int, j: int, v: int) -> str:
    """``float mix(int64 n, ptr buf)``: n steps, each a 3x3 window (:data:`WINDOW`) of
    taps as the conv engine unrolls it (:func:`jitbyoc.engines.conv_plan.unrolled_window`):
    per tap ``v`` unaligned vector loads at the tap's constant offset and ``j`` broadcast
    scalars from ``buf``, ``j * v`` FMAs into register accumulators; the window's corner
    moves over 4 places from step to step, as a convolution's chunks do."""
    from llvmlite import ir

    from jitbyoc.peak import fmuladd, summed_loop
    from jitbyoc.render.vectors import splat

    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, lanes)
    module = ir.Module(name="mix")
    fma = fmuladd(module, vec)
    fn = ir.Function(module, ir.FunctionType(f32, [i64, ir.PointerType()]), "mix")
    buf = fn.args[1]
    taps = [r * ROW + c for r in range(WINDOW[0]) for c in range(WINDOW[1])]

    def step(b, i, accs):
        place = b.and_(i, i64(3))
        corner = b.mul(place, i64(lanes))
        wbase = b.add(i64(BUFFER_FLOATS // 2), b.mul(place, i64(j * len(taps))))
        out = list(accs)
        for t, tap in enumerate(taps):
            xs = [b.load(b.gep(buf, [b.add(corner, i64(tap + k * lanes))], source_etype=f32), typ=vec, align=4)
                  for k in range(v)]
            for r in range(j):
                at = b.gep(buf, [b.add(wbase, i64(t * j + r))], source_etype=f32)
                wv = splat(b, b.load(at, typ=f32), lanes)
                for k in range(v):
                    out[r * v + k] = b.call(fma, [xs[k], wv, out[r * v + k]])
        return out

    summed_loop(fn, fn.args[0], [ir.Constant(vec, None)] * (j * v), step)
    return str(module)


def mix_runner(threads: int, seconds: float = 0.02):
    """``(run, flops)`` of the mix loop for the build's machine (:func:`jitbyoc.render.isa.current`),
    as :func:`jitbyoc.peak.loop_runner` gives them."""
    import numpy as np

    from jitbyoc.peak import jit_loop, lanes, loop_runner
    from jitbyoc.render.isa import vector_registers

    j, v = BLOCKS[32 if vector_registers() >= 32 else 16]
    loop, engine = jit_loop(mix_ir(lanes(), j, v), "mix", (ctypes.c_int64, ctypes.c_void_p))
    buf = np.full(BUFFER_FLOATS, 1e-3, np.float32)
    flops = 2 * WINDOW[0] * WINDOW[1] * j * v * lanes()
    return loop_runner(lambda n: loop(n, buf.ctypes.data), (engine, buf), flops, threads, seconds)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="total time of the turns")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both loops")
    p.add_argument("--target", metavar="TARGET", help="the vector ISA's target (bench/target.py), e.g. haswell")
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    from .kernels_matmul import yardstick_candidates
    from .target import describe, set_target
    from .timing import time_blocks

    args = parse_args(argv)
    set_target(args.target)
    print(describe(), flush=True)
    fns = yardstick_candidates(args.threads)
    ratios, end = [], time.perf_counter() + args.seconds
    print(f"threads {args.threads}; GFLOP/s per block (median call), in turns\n   fma    mix  mix/fma")
    while time.perf_counter() < end:
        t = time_blocks({k: f[0] for k, f in fns.items()}, rounds=1, budget=0.1, settle=0.0)
        rate = {k: fns[k][1] / statistics.median(t[k]) / 1e9 for k in fns}
        ratios.append(rate["mix"] / rate["peak"])
        print(f"{rate['peak']:6.1f} {rate['mix']:6.1f}  {ratios[-1]:6.2f}", flush=True)
    print(f"mix/fma over {len(ratios)} turns: median {statistics.median(ratios):.2f}, "
          f"min {min(ratios):.2f}, max {max(ratios):.2f} (1.0: no contention; load {os.getloadavg()[0]:.2f})")
    return ratios


if __name__ == "__main__":
    main()
