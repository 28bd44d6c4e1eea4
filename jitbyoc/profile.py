"""``jitbyoc.profile``: where a built model spends its time, region by region.

TVM's Relax VM has no profiler on CPU builds, but ``vm.set_instrument(f)`` calls ``f``
before and after every call it makes. :func:`profile` times each call with it over a few
runs of the model and sums them per callee: jitbyoc's regions (named by their use symbol,
with their Relax ops and, for convolutions and products, GFLOP/s and the share of the
machine's measured FMA peak, :mod:`jitbyoc.peak`), TVM's own kernels (what stayed with
TVM) and the VM's builtins (allocation, shape handling).

FLOPs come from the kernel IR the codegen lowered (:meth:`jitbyoc.ir.kir.KernelStage.macs`),
remembered per region symbol when a build hands the region to jitbyoc; symbolic dims are
bound from the shapes of the arguments of the call being timed.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from .context import env_number
from .ir import kir, sizes
from .memo import LRU
from .engines.products import PRODUCTS
from .peak import measured_dot_peak, measured_peak

# Region symbol -> its Work, for every region a build in this process handed to jitbyoc.
# Symbols carry a digest of the code and of the names, so one symbol is one region.
_WORK = LRU(8192)


@dataclass(frozen=True)
class Work:
    """What a region computes: its Relax ops and the multiply-adds of its products."""
    ops: tuple[str, ...]
    macs: tuple[tuple, ...]  # one product of dims per product stage
    params: tuple[tuple, ...]  # the shape of each argument, inputs then outputs
    inputs: int
    sizes: dict = field(default_factory=dict)  # derived sizes (jitbyoc.ir.sizes)
    product: str = "float32"  # what its products multiply in (a key of engines.products.PRODUCTS)

    def signature(self, shapes=None) -> str:
        """The argument shapes, as ``1x64x56x56, 64x64x1x1 -> 1x64x56x56``: those of a
        call (``shapes``) when given, not the declared ones, whose symbolic dims carry
        jitbyoc's own size names (``sym0``)."""
        params = shapes if shapes is not None and len(shapes) == len(self.params) else self.params
        shown = ["x".join(map(str, p)) or "scalar" for p in params]
        return ", ".join(shown[:self.inputs]) + " -> " + ", ".join(shown[self.inputs:])

    def flops(self, shapes: list[tuple[int, ...]]) -> float | None:
        """FLOPs of one call whose arguments have ``shapes`` (None if a dim stays unknown)."""
        env = {}
        for declared, got in zip(self.params, shapes):
            for d, n in zip(declared, got):
                if isinstance(d, str) and d not in self.sizes:
                    env[d] = int(n)
        try:
            for name, tree in self.sizes.items():
                env[name] = sizes.evaluate(tree, env)
            return float(sum(2 * np.prod([env[d] if isinstance(d, str) else d for d in m], dtype=np.float64)
                             for m in self.macs))
        except KeyError:
            return None


def remember(symbol: str, kernel: kir.Kernel) -> None:
    """Note what region ``symbol`` computes (the codegen calls this for every region)."""
    macs = []
    for m in (s.macs() for s in kernel.stages if isinstance(s, kir.KernelStage)):
        macs += m if isinstance(m, list) else [] if m is None else [m]  # a fused stage lists its products
    macs = tuple(macs)
    narrow = [s.inputs[0].dtype for s in kernel.stages if isinstance(s, kir.KernelStage) and s.macs() is not None
              and s.inputs and s.inputs[0].dtype in PRODUCTS and PRODUCTS[s.inputs[0].dtype].group > 1]
    _WORK.put(symbol, Work(tuple(kernel.ops), macs, tuple(tuple(b.shape) for b in kernel.params),
                           len(kernel.inputs), dict(kernel.sizes), narrow[0] if narrow else "float32"))


@dataclass
class Row:
    """One callee of the model's runs."""
    name: str
    owner: str  # "jitbyoc", "tvm" (a kernel TVM compiled) or "vm" (a VM builtin)
    ops: str
    shapes: str  # of the arguments, for jitbyoc's regions
    calls: int  # per run
    seconds: float  # per run: the median over runs of the summed call times
    share: float = 0.0  # of the summed call times of a run
    gflop: float | None = None  # per run
    gflops: float | None = None
    peak_share: float | None = None


@dataclass
class Profile:
    """Per-callee rows, slowest first, and the run as a whole."""
    rows: list[Row]
    run_seconds: float  # median wall time of one instrumented run
    peak_gflops: float
    threads: int
    product_peaks: dict = field(default_factory=dict)  # e.g. {"bfloat16": the vdpbf16ps loop's GFLOP/s}

    @property
    def gflop(self) -> float:
        return sum(r.gflop or 0.0 for r in self.rows)

    def by_owner(self) -> dict[str, float]:
        """Seconds per run spent in jitbyoc's regions, TVM's kernels and VM builtins."""
        out: dict[str, float] = {}
        for r in self.rows:
            out[r.owner] = out.get(r.owner, 0.0) + r.seconds
        return out

    def __str__(self) -> str:
        owners = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.by_owner().items())
        lines = [(f"jitbyoc profile: run {self.run_seconds * 1e3:.3f} ms (instrumented; {owners}); "
                  f"{self.gflop:.2f} GFLOP; peak {self.peak_gflops:.0f} GFLOP/s on {self.threads} threads"
                  + "".join(f", {k} {v:.0f}" for k, v in self.product_peaks.items())),
                 f"{'ms/run':>9} {'share':>6} {'calls':>5} {'GFLOP/s':>8} {'%peak':>6}  owner    callee: ops"]
        for r in self.rows:
            rate = f"{r.gflops:8.1f}" if r.gflops is not None else f"{'':8}"
            pct = f"{100 * r.peak_share:5.1f}%" if r.peak_share is not None else f"{'':6}"
            lines.append(f"{r.seconds * 1e3:9.3f} {100 * r.share:5.1f}% {r.calls:5d} {rate} {pct}  "
                         f"{r.owner:8} {r.name}: {r.ops}" + (f" [{r.shapes}]" if r.shapes else ""))
        return "\n".join(lines)


def _owner(symbol: str, work: Work | None) -> str:
    if work is not None:
        return "jitbyoc"
    return "vm" if symbol.startswith("vm.") else "tvm"


class _Recorder:
    """The instrument: per-callee call times of the current run, and each region's FLOPs
    (from the first call's argument shapes)."""

    def __init__(self):
        self.runs: list[dict[str, list[float]]] = []
        self.flops: dict[str, float | None] = {}
        self.shapes: dict[str, list[tuple]] = {}  # of each callee's first call's arguments
        self._open: list[tuple[str, float]] = []

    def __call__(self, func, symbol, before_run, ret, *args):
        now = time.perf_counter()
        if before_run:
            self._open.append((symbol, now))
            return 0
        name, start = self._open.pop()
        self.runs[-1].setdefault(name, []).append(now - start)
        if name not in self.flops:
            work = _WORK.get(name)
            shapes = self.shapes[name] = [tuple(int(d) for d in a.shape) for a in args if hasattr(a, "shape")]
            self.flops[name] = work.flops(shapes) if work is not None else None
        return 0


def _vm(runnable, device) -> relax.VirtualMachine:
    if isinstance(runnable, relax.VirtualMachine):
        return runnable
    return relax.VirtualMachine(runnable, device)


def _rows(rec: _Recorder, peak: float, peaks: dict | None = None) -> list[Row]:
    """Per-callee rows; a region's ``%peak`` divides by the peak of what its products
    multiply in (``peaks``: product -> GFLOP/s, the bfloat16 one the ``vdpbf16ps`` loop's),
    ``peak`` (the FMA loop's) for the rest."""
    names = dict.fromkeys(n for run in rec.runs for n in run)
    rows = []
    for name in names:
        per_run = [sum(run.get(name, [])) for run in rec.runs]
        work = _WORK.get(name)
        rows.append(Row(name, _owner(name, work), ", ".join(work.ops) if work else name,
                        work.signature(rec.shapes.get(name)) if work else "", len(rec.runs[-1].get(name, [])),
                        statistics.median(per_run)))
    total = sum(r.seconds for r in rows) or 1.0
    for r in rows:
        r.share = r.seconds / total
        flop = rec.flops.get(r.name)
        if flop:  # summed over the run's calls of it (shapes of the first call)
            r.gflop = flop * r.calls / 1e9
            r.gflops = r.gflop / r.seconds if r.seconds > 0 else None
            work = _WORK.get(r.name)
            own = (peaks or {}).get(work.product, peak) if work is not None else peak
            r.peak_share = r.gflops / own if r.gflops is not None and own else None
    return sorted(rows, key=lambda r: -r.seconds)


def profile(runnable, *args, func: str = "main", repeat: int = 10, warmup: int = 2,
            device=None, peak_gflops: float | None = None) -> Profile:
    """Run ``runnable``'s ``func`` on ``args`` and time every call the VM makes.

    Parameters
    ----------
    runnable : tvm.relax.VirtualMachine or Executable
        A build (``tvm.compile``'s result) or a VM made from one.
    *args : numpy.ndarray or tvm.runtime.Tensor
        The function's arguments.
    func : str
        The function to run.
    repeat, warmup : int
        Timed runs (per-callee medians over them) and untimed runs before.
    device : tvm.runtime.Device, optional
        Where to run an executable (default CPU 0).
    peak_gflops : float, optional
        The yardstick for ``% of peak``; default: measured here (:mod:`jitbyoc.peak`) for
        ``TVM_NUM_THREADS`` threads.

    Returns
    -------
    Profile
        ``print()`` it for a table; ``rows`` hold the figures.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"jitbyoc.profile: repeat must be at least 1 and warmup at least 0 "
                         f"(got repeat={repeat}, warmup={warmup})")
    device = device or tvm.cpu(0)
    vm = _vm(runnable, device)
    inputs = [a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(a), device)
              for a in args]
    for _ in range(warmup):
        vm[func](*inputs)
    threads = env_number("TVM_NUM_THREADS", os.cpu_count() or 1)
    peak = peak_gflops or measured_peak(threads)
    rec, walls = _Recorder(), []
    vm.set_instrument(rec)
    try:
        for _ in range(repeat):
            rec.runs.append({})
            start = time.perf_counter()
            vm[func](*inputs)
            walls.append(time.perf_counter() - start)
    finally:
        vm.set_instrument(None)
    called = [_WORK.get(name) for run in rec.runs for name in run]
    peaks = {w.product: measured_dot_peak(w.product, threads) for w in called if w is not None and w.product != "float32"}
    return Profile(_rows(rec, peak, peaks), statistics.median(walls), peak, threads, peaks)
