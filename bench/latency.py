"""``python -m bench.latency``: how fast jitbyoc builds, cold and warm, against TVM's default.

For each model (default: ResNet-18 and the encoder block), in one process:

* TVM default: ``tvm.compile`` with jitbyoc disabled;
* cold, empty cache: jitbyoc enabled, nothing compiled before (memory and a fresh disk
  directory; the compile workers already run): the library engines the model needs are
  compiled too;
* cold model, engines cached: the same, but the library engines (:mod:`jitbyoc.engines`,
  compiled once per machine) are in the disk cache, as after any earlier build on this
  machine: what a new model costs;
* warm: the same model again (every region a cache hit);
* one layer changed: the first ``relu`` of the model becomes ``gelu`` (or, with no relu,
  the first ``gelu`` becomes ``relu``); only the regions holding it should compile.

Each jitbyoc build is split into jitbyoc's own time (partitioning + code generation,
from ``jitbyoc.last_report().timings``) and the rest, which is TVM's own work:
legalizing and compiling what stays with TVM, and its Relax VM pipeline.
The TVM default and the two cold builds are taken in turn, ``--repeat`` rounds after an
untimed warm-up round; the table gives medians, and each cold build's median ratio to the
TVM build of its own round (robust to a machine whose speed drifts between rounds).
Targets (issue 5): cold total <= TVM default; warm jitbyoc time <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

import jitbyoc
from jitbyoc.render import isa
from jitbyoc.toolchain import cache, driver
from jitbyoc.engines import PREFIX as ENGINE_PREFIX
from jitbyoc.tvm import partition

from .models import ZOO


@mutator
class _SwapFirst(PyExprMutator):
    """Replace the first call of op ``src`` with op ``dst`` (same operands)."""

    def __init__(self, mod, src: str, dst: str):
        super().__init__(mod)
        self.src, self.dst, self.done = tvm.ir.Op.get(src), tvm.ir.Op.get(dst), False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not self.done and isinstance(call.op, tvm.ir.Op) and call.op.same_as(self.src):
            self.done = True
            return relax.Call(self.dst, call.args)
        return call


# One op swapped for another of the same operands, the first pair the model has: an
# activation, else (MobileNetV2's ReLU6 is a clip, of three operands) an add.
SWAPS = (("relax.nn.relu", "relax.nn.gelu"), ("relax.nn.gelu", "relax.nn.relu"),
         ("relax.sigmoid", "relax.tanh"), ("relax.add", "relax.subtract"))


def change_one_layer(mod: tvm.IRModule) -> tvm.IRModule:
    for src, dst in SWAPS:
        swap = _SwapFirst(mod, src, dst)
        func = swap.visit_expr(mod["main"])
        if swap.done:
            out = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions)
            out["main"] = func
            return relax.transform.Normalize()(out)
    raise ValueError("model has no relu, gelu, sigmoid or add to change")


def _timed_build(mod) -> tuple[float, dict]:
    t0 = time.perf_counter()
    tvm.compile(mod, target="llvm")
    total = time.perf_counter() - t0
    rep = jitbyoc.last_report() if jitbyoc.is_enabled() else None
    return total, {"timings": dict(rep.timings) if rep else {},
                   "status": [r.cache for r in rep.regions] if rep else []}


def _forget() -> None:
    """Drop every in-process memory of earlier builds (compiled code, partitions, runtime
    modules), so the next build is as cold as in a fresh process whose worker pool runs."""
    cache.clear_memory()
    partition._MEMO.clear()
    driver._MODULES.clear()


def _cold(mod, engines_cached: set[str]) -> tuple[float, dict]:
    """A build with an empty compile cache, or one holding only ``engines_cached``."""
    with tempfile.TemporaryDirectory() as tmp:
        cache.configure(path=tmp)
        _forget()
        driver.engine_code(engines_cached, isa.current())  # compiled into the fresh directory
        _forget()
        return _timed_build(mod)


def _median(runs: list[tuple[float, dict]]) -> tuple[float, dict]:
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


def measure(name: str, repeat: int) -> dict:
    """Rounds of (TVM default, cold empty, cold engines cached) builds, taken in turn so
    that a noisy machine slows each kind alike; medians, and medians of each round's
    ratios to its TVM build."""
    mod = ZOO[name].make().mod
    saved = cache.SETTINGS.path
    with jitbyoc.disabled():
        _timed_build(mod)  # untimed warm-up of TVM's own lazy initialization
    with jitbyoc.enabled():
        _cold(mod, set())  # warm-up; tells which engines the model needs
        engines = {s for s in driver.last_cache_status() if s.startswith(ENGINE_PREFIX)}
    rounds = []
    for _ in range(repeat):
        with jitbyoc.disabled():
            base = _timed_build(mod)[0]
        with jitbyoc.enabled():
            rounds.append((base, _cold(mod, set()), _cold(mod, engines)))
    with jitbyoc.enabled(), tempfile.TemporaryDirectory() as tmp:
        cache.configure(path=tmp)
        _timed_build(mod)
        warm, warm_info = _median([_timed_build(mod) for _ in range(repeat)])
        changed, changed_info = _timed_build(change_one_layer(mod))
    cache.SETTINGS.path = saved
    cold, cold_info = _median([r[1] for r in rounds])
    model, model_info = _median([r[2] for r in rounds])
    jit_time = lambda info: sum(info["timings"].values())  # noqa: E731
    return {
        "model": name,
        "tvm_default_s": statistics.median(r[0] for r in rounds),
        "cold_total_s": cold, "cold_jitbyoc_s": jit_time(cold_info), "cold_tvm_s": cold - jit_time(cold_info),
        "cold_ratio": statistics.median(r[1][0] / r[0] for r in rounds),
        "cold_timings": cold_info["timings"], "engines": sorted(engines),
        "cold_model_total_s": model, "cold_model_jitbyoc_s": jit_time(model_info),
        "cold_model_tvm_s": model - jit_time(model_info),
        "cold_model_ratio": statistics.median(r[2][0] / r[0] for r in rounds),
        "warm_total_s": warm, "warm_jitbyoc_s": jit_time(warm_info), "warm_tvm_s": warm - jit_time(warm_info),
        "regions": len(cold_info["status"]),
        "changed_regions_compiled": sum(s == "compiled" for s in changed_info["status"]),
        "changed_total_s": changed, "changed_jitbyoc_s": jit_time(changed_info),
    }


def table(rows: list[dict]) -> str:
    head = ("| model | TVM default build | jitbyoc cold, empty cache (jitbyoc + TVM) | "
            "cold model, engines cached (jitbyoc + TVM) | warm rebuild (jitbyoc + TVM) "
            "| one layer changed: regions compiled |\n|---|---|---|---|---|---|")
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    both = lambda r, k: f"{ms(r[k + '_total_s'])} ({ms(r[k + '_jitbyoc_s'])} + {ms(r[k + '_tvm_s'])})"  # noqa: E731
    ratio = lambda r, k: f"{both(r, k)}, {r[k + '_ratio']:.2f}x TVM"  # noqa: E731
    lines = [head]
    for r in rows:
        lines.append(f"| {r['model']} | {ms(r['tvm_default_s'])} | {ratio(r, 'cold')} | {ratio(r, 'cold_model')} | "
                     f"{both(r, 'warm')} | {r['changed_regions_compiled']} of {r['regions']} "
                     f"({ms(r['changed_jitbyoc_s'])}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="zoo model (repeatable)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = [measure(name, args.repeat) for name in args.model or ["resnet18", "transformer_block"]]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
