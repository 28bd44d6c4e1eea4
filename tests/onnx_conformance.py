"""The ONNX project's backend node tests (``onnx.backend.test.case.node``: each a one-op
model with its inputs and expected outputs) through TVM's ONNX frontend, built by TVM's
default pipeline and with jitbyoc in the same process.

A case TVM passes must pass with jitbyoc (a regression otherwise). The offload share is
the share of Relax ops jitbyoc takes in the cases TVM passes. ``tests/test_onnx_conformance.py``
runs a fixed sample in CI; the full run:

    .venv/bin/python -m tests.onnx_conformance            # all 1,884 cases, a few minutes
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

import jitbyoc


@dataclass
class Outcome:
    name: str
    tvm: str  # "pass", "wrong", or the error
    jit: str
    offloaded: int = 0
    total: int = 0
    left: tuple = ()  # the ops left to TVM, with the first words of the reason

    @property
    def regression(self) -> bool:
        return self.tvm == "pass" and self.jit != "pass"


def cases():
    from onnx.backend.test.case.node import collect_testcases
    return sorted(collect_testcases(None), key=lambda c: c.name)


def _run(mod, inputs, outputs, case, offload: bool) -> str:
    try:
        with jitbyoc.enabled() if offload else jitbyoc.disabled():
            ex = tvm.compile(mod, target="llvm")
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a))
                                                            for a in inputs])
    except Exception as err:  # noqa: BLE001 - an outcome, recorded
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}"
    got = [got] if isinstance(got, tvm.runtime.Tensor) else list(got)
    if len(got) != len(outputs):
        return f"wrong: {len(got)} outputs, expected {len(outputs)}"
    for g, want in zip(got, outputs):
        g = g.numpy() if hasattr(g, "numpy") else np.asarray(g)
        if g.shape != want.shape or (want.dtype.kind in "fc" and not np.allclose(
                g, want, rtol=case.rtol, atol=case.atol, equal_nan=True)) or (
                want.dtype.kind not in "fc" and not np.array_equal(g, want)):
            return "wrong"
    return "pass"


def run_case(case) -> Outcome | None:
    """None where TVM's frontend cannot import the model (nothing to compare)."""
    from tvm.relax.frontend.onnx import from_onnx

    inputs, outputs = case.data_sets[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = from_onnx(case.model, keep_params_in_input=False)
    except Exception:  # noqa: BLE001 - TVM's frontend does not take this model
        return None
    outputs = [np.asarray(o) for o in outputs]
    out = Outcome(case.name, _run(mod, inputs, outputs, case, False), _run(mod, inputs, outputs, case, True))
    try:
        rep = jitbyoc.report(mod)
        out.offloaded, out.total = rep.offloaded_ops, rep.total_ops
        out.left = tuple(f"{f.op}: {f.reason[:70]}" for f in rep.fallbacks)
    except Exception:  # noqa: BLE001 - the report is informative only
        pass
    return out


def summary(outcomes: list[Outcome], top: int = 0) -> str:
    passed = [o for o in outcomes if o.tvm == "pass"]
    offloaded, total = sum(o.offloaded for o in passed), sum(o.total for o in passed)
    lines = [f"{len(outcomes)} cases imported; TVM passes {len(passed)}; jitbyoc passes "
             f"{sum(o.jit == 'pass' for o in outcomes)}; regressions "
             f"{sum(o.regression for o in outcomes)}; jitbyoc passes where TVM does not: "
             f"{sum(o.jit == 'pass' and o.tvm != 'pass' for o in outcomes)}",
             f"offloaded in the cases TVM passes: {offloaded}/{total} ops "
             f"({100 * offloaded / max(total, 1):.1f} %)"]
    lines += [f"  REGRESSION {o.name}: {o.jit}" for o in outcomes if o.regression]
    left = Counter(f for o in passed for f in o.left)
    lines += ["ops left to TVM in the cases TVM passes (most frequent):"]
    lines += [f"  {n:4d}  {what}" for what, n in left.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1, help="run every k-th case only")
    ap.add_argument("--top", type=int, default=40, help="list the most frequent ops left to TVM")
    args = ap.parse_args()
    logging.getLogger("jitbyoc").setLevel(logging.ERROR)
    from tqdm import tqdm

    outcomes = [o for c in tqdm(cases()[::args.every]) if (o := run_case(c)) is not None]
    print(summary(outcomes, top=args.top))


if __name__ == "__main__":
    main()
