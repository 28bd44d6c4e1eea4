"""The machine's measured float32 FMA peak, the yardstick for "% of peak" in
:func:`jitbyoc.profile` and the benchmarks.

An LLVM IR loop of :data:`CHAINS` independent FMA chains of one vector register each
(``<16 x float>`` with AVX-512, ``<8 x float>`` with AVX2: wider vectors would not fit in
the registers and would measure spills), compiled by llvmlite's MCJIT and called through
ctypes from ``threads`` Python threads (ctypes releases the GIL), best of 5: the FLOP rate
the cores sustain at the clock they actually run. Zen 4 retires one 512-bit FMA per cycle
per core (32 FLOP/cycle), Zen 5 two (64), Zen 3 two 256-bit ones (32): measuring, not
assuming, is what keeps the figure right on each.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import llvmlite.binding as llvm
from llvmlite import ir

from .engines import gemm_tiles
from .engines.gemm_micro import add_values, multiply_units
from .engines.products import PRODUCTS
from .ir.dtypes import dtype as lookup_dtype
from .toolchain import jit
from .render import isa

CHAINS, UNROLL = 12, 4  # independent chains (>= FMA latency x ports, fit 16 registers), unrolled


def lanes() -> int:
    """float32 lanes of one vector register of the build's machine (:func:`isa.current`:
    this machine, or e.g. the AVX2 subset of it under ``isa.compiling_for``)."""
    return isa.lanes("float32")


def _peak_ir(width: int) -> str:
    """``float peak(int64 n)``: n iterations of CHAINS x UNROLL ``<width x float>`` FMAs."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, width)
    module = ir.Module(name="peak")
    module.triple = isa.current().triple
    fma = fmuladd(module, vec)
    fn = ir.Function(module, ir.FunctionType(f32, [i64]), "peak")

    def step(b, _i, cur):
        for _ in range(UNROLL):
            cur = [b.call(fma, [c, ir.Constant(vec, [1.0000001] * width), ir.Constant(vec, [0.999999] * width)])
                   for c in cur]
        return cur

    summed_loop(fn, fn.args[0], [ir.Constant(vec, [float(k)] * width) for k in range(CHAINS)], step)
    return str(module)


def _dot_ir(dtype: str) -> str:
    """``float dot(int64 n)``: n iterations of CHAINS x UNROLL multiply-adds of the product
    ``dtype`` (:data:`jitbyoc.engines.products.PRODUCTS`) on one register of units each:
    the GEMM microkernel's own instruction (:func:`~jitbyoc.engines.gemm_micro.multiply_units`:
    ``vdpbf16ps`` for bfloat16 pairs, ``vpdpbusd`` for int8 quads, where the machine has
    them). An integer loop returns its sum converted to float."""
    product = PRODUCTS[dtype]
    width = isa.lanes(product.acc)
    element = lookup_dtype(product.acc).ir
    acc, units = ir.VectorType(element, width), ir.VectorType(ir.IntType(32), width)
    module = ir.Module(name="dot")
    module.triple = isa.current().triple
    fn = ir.Function(module, ir.FunctionType(ir.FloatType(), [ir.IntType(64)]), "dot")
    one = ir.Constant(units, [0x3F803F80] * width)  # a pair of bfloat16 ones (float loops)

    integer = not isinstance(element, ir.FloatType)

    def step(b, _i, cur):
        for _ in range(UNROLL):  # an integer chain multiplies its own bits by the next
            # chain's: LLVM folds integer arithmetic on constants (the widened int8 loop
            # became additions in closed form)
            cur = [multiply_units(b, product, c, cur[(j + 1) % len(cur)], c) if integer
                   else multiply_units(b, product, one, one, c) for j, c in enumerate(cur)]
        return cur

    start = int if integer else float
    summed_loop(fn, fn.args[0], [ir.Constant(acc, [start(k)] * width) for k in range(CHAINS)], step)
    return str(module)


def dot_runner(dtype: str, threads: int, seconds: float = 0.02) -> tuple[Callable[[], None], float]:
    """:func:`fma_runner` for the product ``dtype``'s instruction (``"bfloat16"``: the
    ``vdpbf16ps`` loop), the yardstick of its kernels; one instruction is ``2 * group``
    FLOP per float32 lane."""
    loop, engine = jit_loop(*_dot_loop(dtype))
    return loop_runner(loop, engine, _dot_flops(dtype), threads, seconds)


def _dot_loop(dtype: str) -> tuple[str, str]:
    """(IR, function) of the product ``dtype``'s loop: its tile products where the GEMM
    engine runs it on AMX tiles (:mod:`jitbyoc.engines.gemm_tiles`), else its vector
    instruction's."""
    if _on_tiles(dtype):
        return gemm_tiles.loop_ir(dtype, isa.current().triple), "dot"
    return _dot_ir(dtype), "dot"


def _on_tiles(dtype: str) -> bool:
    """Whether the product ``dtype``'s loop is AMX's (the build's machine has it, and Linux
    granted this process the tiles)."""
    return gemm_tiles.has_tiles(dtype) and gemm_tiles.granted()


def _dot_flops(dtype: str) -> int:
    """FLOPs of one iteration of the product ``dtype``'s loop on one thread."""
    if _on_tiles(dtype):
        return gemm_tiles.loop_flops(dtype)
    return CHAINS * UNROLL * 2 * PRODUCTS[dtype].group * isa.lanes(PRODUCTS[dtype].acc)


def fmuladd(module: ir.Module, vec: ir.VectorType) -> ir.Function:
    """``llvm.fmuladd`` on ``vec``: one FMA where the machine has them, a multiply and an add
    where not (llvm.fma is a libm call per lane there: SSE-only x86-64 measured 1.6 GFLOP/s)."""
    return ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fmuladd.v{vec.count}f32")


def summed_loop(fn: ir.Function, count, inits: list, step) -> None:
    """``fn``'s body: ``accs = step(builder, i, accs)`` for ``i`` in ``[0, count)`` (at least
    once), ``accs`` starting at ``inits``, then return lane 0 of their sum: every value
    stays live, or LLVM deletes the work."""
    i64 = ir.IntType(64)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    entry, loop, done = b.block, fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    accs = [b.phi(init.type) for init in inits]
    out = step(b, i, list(accs))
    i.add_incoming(i64(0), entry)
    i.add_incoming(b.add(i, i64(1)), b.block)
    for acc, init, o in zip(accs, inits, out):
        acc.add_incoming(init, entry)
        acc.add_incoming(o, b.block)
    b.cbranch(b.icmp_signed("<", b.add(i, i64(1)), count), loop, done)
    b.position_at_end(done)
    total = out[0]
    for o in out[1:]:
        total = add_values(b, total, o)
    lane = b.extract_element(total, ir.IntType(32)(0))
    b.ret(lane if isinstance(lane.type, ir.FloatType) else b.sitofp(lane, ir.FloatType()))


def jit_loop(ir_text: str, name: str, argtypes: tuple = (ctypes.c_int64,)):
    """Function ``name`` of the LLVM IR ``ir_text``, compiled by MCJIT for the build's
    machine (:func:`isa.current`), as ``(ctypes callable returning float, engine)``; keep
    the engine alive while the callable is used."""
    jit.target_machine()  # initializes LLVM's native target
    # MCJIT takes ownership of its target machine: give it its own, never jitbyoc's cached one
    m = isa.current()
    tm = llvm.Target.from_triple(m.triple).create_target_machine(cpu=m.cpu, features=m.features, opt=3)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(ir_text), tm)
    engine.finalize_object()
    return ctypes.CFUNCTYPE(ctypes.c_float, *argtypes)(engine.get_function_address(name)), engine


def peak_loop():
    """The compiled loop as ``(callable(n) -> float, engine)``; keep the engine alive."""
    return jit_loop(_peak_ir(lanes()), "peak")


def fma_peak(threads: int, iters: int = 20_000_000) -> float:
    """GFLOP/s of ``threads`` threads each running :func:`peak_loop`, best of 5."""
    peak, _engine = peak_loop()
    return _best_rate(peak, flops_per_iteration(), threads, iters)


def dot_peak(dtype: str, threads: int, iters: int = 5_000_000) -> float:
    """GFLOP/s of the product ``dtype``'s instruction (:func:`dot_runner`'s loop: the
    ``vdpbf16ps`` loop for bfloat16), the better of ``threads`` threads together and
    ``threads`` times one, as :func:`machine_peak`."""
    loop, _engine = jit_loop(*_dot_loop(dtype))
    flops = _dot_flops(dtype)
    return max(_best_rate(loop, flops, threads, iters), threads * _best_rate(loop, flops, 1, iters))


def measured_dot_peak(dtype: str, threads: int) -> float:
    """:func:`dot_peak`, measured once per process and machine; the FMA peak for a float
    product (group 1)."""
    if PRODUCTS[dtype].group == 1:
        return measured_peak(threads)
    return _measured_dot(dtype, threads, isa.current())


@lru_cache(maxsize=None)
def _measured_dot(dtype: str, threads: int, machine: isa.Machine) -> float:
    return dot_peak(dtype, threads)


def _best_rate(peak, flops_per_iter: int, threads: int, iters: int) -> float:
    """GFLOP/s of ``threads`` threads each running ``peak(iters)``, best of 5."""
    rates = []
    for _ in range(5):
        workers = [threading.Thread(target=peak, args=(iters,)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        rates.append(threads * iters * flops_per_iter / (time.perf_counter() - start) / 1e9)
    return max(rates)


def flops_per_iteration() -> int:
    """FLOPs of one iteration of :func:`peak_loop` on one thread."""
    return CHAINS * UNROLL * 2 * lanes()


def fma_runner(threads: int, seconds: float = 0.02) -> tuple[Callable[[], None], float]:
    """``(run, flops)``: ``run()`` keeps ``threads`` threads on :func:`peak_loop` for about
    ``seconds``, ``flops`` what one call computes (:func:`loop_runner`). The peak as a
    candidate of a benchmark's timed blocks, taking turns with the kernels it is the
    yardstick for: on a VM whose speed moves in phases, a peak measured once
    (:func:`machine_peak`, the best of several) and a kernel's median over minutes come
    from different phases."""
    loop, engine = peak_loop()
    return loop_runner(loop, engine, flops_per_iteration(), threads, seconds)


def loop_runner(loop, keep, flops_per_iter: int, threads: int, seconds: float) -> tuple[Callable[[], None], float]:
    """``(run, flops)``: ``run()`` calls ``loop(iters)`` on ``threads`` threads at once, ``iters``
    calibrated here (one thread) to take about ``seconds``; ``flops`` is what one call
    computes. ``keep`` (the compiled code's engine) lives as long as ``run``."""
    start = time.perf_counter()
    loop(1_000_000)
    iters = max(1, int(seconds / (time.perf_counter() - start) * 1_000_000))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="jitbyoc-loop")

    def run() -> None:
        run.keep = keep
        list(pool.map(loop, [iters] * threads))

    return run, float(threads * iters * flops_per_iter)


def machine_peak(threads: int, iters: int = 20_000_000) -> float:
    """The FMA peak in GFLOP/s on ``threads`` cores: the better of ``threads`` threads
    together and ``threads`` times one thread (one core busy with another process is
    likelier than two, and then the one-thread rate is the cleaner measure: a profile of
    ResNet-50 once measured 116 GFLOP/s for 2 threads together, one core's rate, and
    printed 156 % of peak)."""
    return max(fma_peak(threads, iters), threads * fma_peak(1, iters))


def measured_peak(threads: int) -> float:
    """:func:`machine_peak` for ``threads`` threads, measured once per process and
    machine (about 0.3 s)."""
    return _measured(threads, isa.current())


@lru_cache(maxsize=None)
def _measured(threads: int, machine: isa.Machine) -> float:
    return machine_peak(threads, iters=5_000_000)
