"""What ``python -m bench.decoders --generate`` measures (:mod:`bench.generate` builds).

Generation (:func:`measure_generation`): jitbyoc's whole generation and torch eager's (the
same step module) take turns, ``--repeat`` times after one short untimed warm-up each;
prefill is the median over the repeats, decode the median over every step of every
repeat (argmax included). Tokens and logits are compared with torch's, and for narrow
weights with jitbyoc's fp32 build of the same module; the tokens/s are compared with the
memory bound, :func:`bench.generate.weight_bytes` over the read bandwidth of the run's
threads (:func:`bench.decoders.read_bandwidth`; the higher of a reading before the build
and one after the timings). The one-thread numpy copy bandwidth the bound used before is
printed beside it: on Zen 5 the fp32 step ran at 134 % of that bound.

``--past 32 --past 512 --past 2000`` (:func:`measure_past`): one decode token on a cache
of random values of each length, jitbyoc and torch eager each in a warm loop of its own
(:func:`bench.timing.time_alternating`), in turns, medians; printed as ms and as a ratio
to the first length. Then :func:`jitbyoc.profile` of jitbyoc's step at the first and the
last length: its slowest callees with their distinct Relax ops, those that take or make
a tensor of the past length (``[1, kv_heads or heads, past or past + 1, head_dim]``: the
cache's concat, fused with the key/value projection and the grouped-query repeat of the
keys and values, and attention) marked ``cache`` and summed.
"""

from __future__ import annotations

import re
import time

import numpy as np

from .accuracy import cosine_error
from .decoders import copy_bandwidth, read_bandwidth
from .generate import (Generation, build, empty_cache, generate, jit_runner, leading_equal, narrowed, torch_runner,
                       weight_bytes)
from .timing import Stats, time_alternating

SETTLE = 0.2  # seconds of pause before each timed generation


def against(runner, model, prompt, ref: Generation, own: Generation) -> tuple[int, float, float]:
    """(leading equal tokens, last-step and lowest logits cosine) of ``own`` against
    ``ref``; where the tokens differ, the cosines are of ``runner`` fed ``ref``'s tokens."""
    equal = leading_equal(own.tokens, ref.tokens)
    if equal < len(ref.tokens):
        own = generate(runner, model, prompt, len(ref.tokens), forced=ref.tokens)
    cos = [1 - cosine_error([a], [b]) for a, b in zip(own.logits, ref.logits)]
    return equal, cos[-1], min(cos)


def timed_generations(runners: dict, model, prompt, n: int, repeat: int) -> dict[str, dict]:
    """Each runner's whole generation in turns, ``repeat`` times after a short warm-up
    (a pause of :data:`SETTLE` before each, for the other's thread pool to stop spinning):
    prefill (median over the repeats), decode (median over every step of every repeat)
    and the last generation."""
    for runner in runners.values():
        generate(runner, model, prompt, min(n, 2))
    runs: dict[str, list[Generation]] = {name: [] for name in runners}
    for _ in range(repeat):
        for name, runner in runners.items():
            time.sleep(SETTLE)
            runs[name].append(generate(runner, model, prompt, n))
    return {name: {"prefill_s": float(np.median([g.prefill_s for g in gens])),
                   "step_s": float(np.median([s for g in gens for s in g.step_s] or [np.nan])),
                   "last": gens[-1]} for name, gens in runs.items()}


def measure_generation(args, model, step, mod) -> None:
    """Generation, jitbyoc against torch eager, and the bounds (module docstring)."""
    before, copy = read_bandwidth(args.threads), copy_bandwidth()
    start = time.perf_counter()
    narrow = narrowed(mod, args.weights, args.group_size)
    lower_s = time.perf_counter() - start
    _ex, run, build_s, offloaded = build(narrow)
    transform = f": transform {lower_s:.1f} s" if narrow is not mod else ""
    print(f"build {build_s:.1f} s ({args.weights}{transform}; {offloaded})")
    runners = {"jitbyoc": jit_runner(run), "torch": torch_runner(step)}
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, args.prompt), dtype=np.int64)
    res = timed_generations(runners, model, prompt, args.tokens, args.repeat)
    # the higher of two readings, before the build and after the timings: one reading
    # varied from 19 to 27 GB/s between runs, and a low one flattered every percentage
    after = read_bandwidth(args.threads)
    bandwidth = max(before, after)
    j, t = res["jitbyoc"], res["torch"]
    equal, last, low = against(runners["jitbyoc"], model, prompt, t["last"], j["last"])
    print(f"greedy tokens equal to torch's: {equal} of {args.tokens}; logits cosine against torch's "
          f"(fp32): last step {last:.7f}, lowest {low:.7f}")
    if args.weights != "fp32":
        _ex32, run32, build32_s, _ = build(mod)
        ref = generate(jit_runner(run32), model, prompt, args.tokens)
        equal, last, low = against(runners["jitbyoc"], model, prompt, ref, j["last"])
        print(f"against jitbyoc's fp32 build (built in {build32_s:.1f} s): greedy tokens equal {equal} of "
              f"{args.tokens}; logits cosine last step {last:.7f}, lowest {low:.7f}")
    print(f"{'':22} {'jitbyoc':>9} {'torch':>9} {'torch/jit':>9}")
    print(f"{f'prefill {args.prompt} tokens, ms':22} {j['prefill_s'] * 1e3:9.1f} {t['prefill_s'] * 1e3:9.1f} "
          f"{t['prefill_s'] / j['prefill_s']:9.2f}")
    print(f"{'decode, ms/token':22} {j['step_s'] * 1e3:9.2f} {t['step_s'] * 1e3:9.2f} "
          f"{t['step_s'] / j['step_s']:9.2f}")
    print(f"{'decode, tokens/s':22} {1 / j['step_s']:9.2f} {1 / t['step_s']:9.2f}")
    nbytes = weight_bytes(model, args.weights, args.group_size)
    bound = bandwidth / nbytes
    print(f"memory bound: {nbytes / 1e9:.3f} GB of {args.weights} weights a token over "
          f"{bandwidth / 1e9:.1f} GB/s read bandwidth ({args.threads} threads; the higher of "
          f"{before / 1e9:.1f} before the build and {after / 1e9:.1f} after the timings) = {bound:.2f} tokens/s; "
          f"jitbyoc at {1 / j['step_s'] / bound:.0%} of it ({nbytes / j['step_s'] / 1e9:.1f} GB/s), "
          f"torch (fp32 weights) at {1 / t['step_s'] / bound:.0%}; a one-thread numpy copy moved "
          f"{copy / 1e9:.1f} GB/s (read + write)")


def reads_cache(shapes: str, past: int) -> bool:
    """Whether a profile row's argument shapes hold a ``[1, h, past or past + 1, d]``."""
    dims = [[int(d) for d in s.split("x")] for s in re.findall(r"\d+(?:x\d+)+", shapes)]
    return any(len(d) == 4 and d[2] in (past, past + 1) for d in dims)


def short_ops(ops: str, width: int = 80) -> str:
    """A row's distinct Relax ops, in order, without the ``relax.`` prefix."""
    names = dict.fromkeys(o.strip().removeprefix("relax.") for o in ops.split(","))
    text = " ".join(names)
    return text if len(text) <= width else text[:width - 3] + "..."


def grouped(rows, past: int) -> list[tuple[float, float, int, str, bool, str]]:
    """Profile rows summed by owner and distinct ops (a layer's regions are callees of
    their own): (seconds, share, calls, owner, reads the cache, ops), slowest first."""
    out: dict[tuple, list] = {}
    for r in rows:
        key = (r.owner, reads_cache(r.shapes, past), short_ops(r.ops, 10_000))
        acc = out.setdefault(key, [0.0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + r.seconds, acc[1] + r.share, acc[2] + r.calls
    return sorted(((*v, *k) for k, v in out.items()), reverse=True)


def print_profile(prof, past: int, top: int) -> None:
    rows = grouped(prof.rows, past)
    cache = [r for r in rows if r[4]]
    owners = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in prof.by_owner().items())
    print(f"\njitbyoc.profile at past {past}: run {prof.run_seconds * 1e3:.2f} ms instrumented ({owners}); "
          f"callees with a past-length tensor ('cache'): {sum(r[0] for r in cache) * 1e3:.2f} ms in "
          f"{sum(r[2] for r in cache)} calls, {sum(r[1] for r in cache):.1%} of the summed call times")
    print(f"{'ms/run':>8} {'share':>6} {'calls':>5} {'owner':8} {'':5} ops (callees of the same ops summed)")
    for seconds, share, calls, owner, reads, ops in rows[:top]:
        print(f"{seconds * 1e3:8.3f} {share:6.1%} {calls:5d} {owner:8} {'cache' if reads else '':5} "
              f"{ops if len(ops) <= 80 else ops[:77] + '...'}")


def measure_past(args, model, step, mod) -> None:
    """One decode token at each of ``args.past``, then the profiles (module docstring)."""
    import torch
    import tvm

    import jitbyoc

    ex, run, build_s, offloaded = build(narrowed(mod, args.weights, args.group_size))
    print(f"build {build_s:.1f} s ({args.weights}, {offloaded}); one decode token (new 1), "
          f"{args.repeat} timed calls each, medians")
    inputs, eager, rows = {}, {}, []
    for past in args.past:
        kv = empty_cache(model, past, seed=past)
        ids = np.array([[1]], dtype=np.int64)
        inputs[past] = [tvm.runtime.tensor(ids), *[tvm.runtime.tensor(a) for a in kv]]
        tin = [torch.from_numpy(ids), *[torch.from_numpy(a) for a in kv]]

        def call(tin=tin):
            with torch.no_grad():
                return step(*tin)
        eager[past] = call
    for past in args.past:  # every length once, untimed, before any is timed: the first
        run(*inputs[past])  # length measured alone read 32 ms where 2,000 read 26 (int4)
        eager[past]()
    for past in args.past:
        mine = Stats.of(time_alternating({"j": lambda a=inputs[past]: run(*a)}, args.repeat, 2)["j"]).median
        theirs = Stats.of(time_alternating({"t": eager[past]}, args.repeat, 2)["t"]).median
        rows.append((past, mine, theirs))
    first = f"x past {rows[0][0]}"
    print(f"{'past':>5} {'jitbyoc ms':>10} {first:>11} {'torch ms':>9} {first:>11}")
    for past, mine, theirs in rows:
        print(f"{past:5d} {mine * 1e3:10.2f} {mine / rows[0][1]:11.2f} {theirs * 1e3:9.2f} "
              f"{theirs / rows[0][2]:11.2f}")
    for past in dict.fromkeys([args.past[0], args.past[-1]]):
        print_profile(jitbyoc.profile(ex, *inputs[past], repeat=5), past, args.top)
