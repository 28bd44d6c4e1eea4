"""Statistics, the alternating timer and the block timer.

Every timing in the harness is wall time from one clock (``time.perf_counter`` unless a
test passes a fake one) around one call. Run time is measured by :func:`time_alternating`:
``warmup`` untimed rounds first (the first call of a VM function may allocate or JIT;
that is never counted as run time), then ``repeat`` timed rounds in which the candidates
take turns in a fixed order (tvm, jitbyoc, tvm, jitbyoc, ...), so slow drift of a noisy
machine hits both alike. The harness times the peers (torch, onnxruntime) in a second
alternating loop of their own: their worker threads keep spinning after a call returns,
which on a small machine would slow whichever candidate comes next. The zoo suite and the
kernel benchmarks time every candidate in blocks of calls instead (:func:`time_blocks`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

Clock = Callable[[], float]


@dataclass(frozen=True)
class Stats:
    """Median, min and max of ``n`` samples (seconds)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        """Summarize ``samples``.

        Parameters
        ----------
        samples : list of float
            At least one timing, in seconds.

        Raises
        ------
        ValueError
            If ``samples`` is empty.
        """
        if not samples:
            raise ValueError("Stats.of needs at least one sample")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def timed(fn: Callable[[], Any], clock: Clock = time.perf_counter) -> tuple[Any, float]:
    """Call ``fn()`` once; return its result and the seconds it took."""
    start = clock()
    result = fn()
    return result, clock() - start


def time_alternating(fns: Mapping[str, Callable[[], Any]], repeat: int, warmup: int = 1,
                     clock: Clock = time.perf_counter) -> dict[str, list[float]]:
    """Time each callable ``repeat`` times, taking turns, after ``warmup`` untimed rounds.

    Parameters
    ----------
    fns : mapping of str to callable
        The candidates, in the order they take turns within a round.
    repeat : int
        Timed rounds (each candidate is timed once per round); at least 1.
    warmup : int
        Untimed rounds before the first timed one; at least 1, so first-call costs are
        never counted.
    clock : callable
        Returns the current time in seconds.

    Returns
    -------
    dict of str to list of float
        The samples of each candidate, in the order they were taken.
    """
    if repeat < 1 or warmup < 1:
        raise ValueError(f"repeat and warmup must be >= 1 (got repeat={repeat}, warmup={warmup})")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            samples[name].append(timed(fn, clock)[1])
    return samples


def time_blocks(fns: Mapping[str, Callable[[], Any]], rounds: int, budget: float = 0.1,
                settle: float = 0.1, clock: Clock = time.perf_counter,
                sleep: Callable[[float], Any] = time.sleep) -> dict[str, list[float]]:
    """Per-call seconds of each candidate, taken in blocks that take turns.

    A candidate's thread pool keeps spinning for a while after a call returns (OpenBLAS,
    TVM, torch, onnxruntime alike), which on 2 cores starves whichever candidate runs
    next; call-by-call alternation measures that interference, not the candidate. So each
    round gives every candidate, in turn, ``settle`` seconds of quiet, one untimed call,
    then a block of timed calls worth about ``budget`` seconds (at least one). Round
    order alternates (A, B, C, then C, B, A), so drift hits all alike.

    Parameters
    ----------
    fns : mapping of str to callable
        The candidates, in the order of the first round.
    rounds : int
        Rounds of blocks; at least 1.
    budget, settle : float
        Seconds of timed calls per block; seconds of sleep before each block.
    clock, sleep : callable
        The timer and the pause (tests pass fakes).

    Returns
    -------
    dict of str to list of float
        Every timed call of each candidate (take the median of all of them).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            sleep(settle)
            fns[name]()  # untimed: the first call after another candidate's block
            start = clock()
            while True:
                samples[name].append(timed(fns[name], clock)[1])
                if clock() - start > budget:
                    break
    return samples


def speedup(baseline: Stats, candidate: Stats) -> float:
    """``baseline.median / candidate.median``: above 1 means the candidate is faster."""
    return baseline.median / candidate.median if candidate.median > 0 else float("inf")


def max_errors(result, reference) -> tuple[float, float]:
    """Max absolute error, and that divided by ``max|reference|`` (normwise relative error).

    ``result`` and ``reference`` are lists of numpy arrays of equal shapes. The relative
    error is normwise so that outputs near zero (relu, residuals) do not inflate it.
    """
    import numpy as np

    if len(result) != len(reference):
        raise ValueError(f"{len(result)} outputs vs {len(reference)} in the reference")
    abs_errs, scales = [0.0], [0.0]
    for out, ref in zip(result, reference):
        out, ref = np.asarray(out, dtype="float64"), np.asarray(ref, dtype="float64")
        if out.shape != ref.shape:
            raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
        if out.size:  # np.max propagates NaN, so a NaN output shows up as a NaN error
            abs_errs.append(float(np.max(np.abs(out - ref))))
            scales.append(float(np.max(np.abs(ref))))
    worst_abs, scale = float(np.max(abs_errs)), float(np.max(scales))
    return worst_abs, (worst_abs / scale if scale > 0 else worst_abs)
