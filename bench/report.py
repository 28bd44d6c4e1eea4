"""Results out: the terminal table, JSON, CSV and the speedup plot.

Every output is made from the same list of row dicts (keys: :func:`bench.run.columns`),
so the table, the JSON ``rows`` and the CSV rows always describe the same models.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import textwrap
from pathlib import Path

log = logging.getLogger(__name__)

PEER_LABELS = {"torch": "torch", "onnxruntime": "ort"}


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with about three significant digits ('-' if missing)."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if ms >= limit:
            return f"{ms:.{digits}f}"
    return f"{ms:.3f}"


def fmt_num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _cells(row: dict, peers: list[str]) -> list[str]:
    run = [f"{fmt_ms(row[f'{w}_median_s'])} "
           f"({fmt_ms(row[f'{w}_min_s'])}-{fmt_ms(row[f'{w}_max_s'])})" for w in ("tvm", "jitbyoc")]
    cells = [row["model"], f"{row['offloaded_ops']}/{row['total_ops']} {row['offload_share']:.0%}",
             str(row["regions"]),
             f"{fmt_ms(row['build_cold_tvm_s'])}/{fmt_ms(row['build_cold_jitbyoc_s'])}",
             f"{fmt_ms(row['build_warm_tvm_s'])}/{fmt_ms(row['build_warm_jitbyoc_s'])}",
             *run, f"{row['speedup']:.2f}x" + ("" if row["ok"] else " !"),
             fmt_num(row["max_abs_err"], ".1e"), fmt_num(row["max_rel_err"], ".1e")]
    alone = [fmt_ms(row["jitbyoc_alone_median_s"])] if peers else []
    return cells + alone + [fmt_ms(row[f"{p}_median_s"]) for p in peers]


def format_table(rows: list[dict], skipped: list[dict]) -> str:
    """The results as aligned text: one line per row, then notes and skipped models.

    Parameters
    ----------
    rows : list of dict
        Result rows (see :func:`bench.run.columns`).
    skipped : list of dict
        ``{"model": ..., "reason": ...}`` for every model that did not run.
    """
    peers = [p for p in PEER_LABELS if any(r.get(f"{p}_median_s") is not None for r in rows)]
    head = ["model", "offloaded", "regions", "build cold ms tvm/jit", "build warm ms tvm/jit",
            "tvm run ms (min-max)", "jitbyoc run ms (min-max)", "speedup", "max abs err",
            "max rel err"] + (["jitbyoc alone ms"] if peers else []) + \
        [f"{PEER_LABELS[p]} ms" for p in peers]
    body = [_cells(r, peers) for r in rows]
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in body]
    lines.append("speedup = TVM default median / jitbyoc median; rel err = max|jitbyoc - tvm| "
                 "/ max|tvm|; '!' = rel err above tolerance")
    if peers:
        lines.append("tvm and jitbyoc run alternately (the speedup); 'jitbyoc alone' and each peer "
                     "run in loops of their own, warm, one after another (compare those)")
    for r in rows:
        if r.get("cold_cache_hits"):
            lines.append(f"  {r['model']}: cold jitbyoc build took {r['cold_cache_hits']} "
                         "region(s) from the compile cache")
        if r.get("left_to_tvm"):
            lines.append(f"  {r['model']}: left to TVM: {r['left_to_tvm']}")
        if r.get("notes"):
            lines.append(f"  {r['model']}: {r['notes']}")
    for s in skipped:
        lines.append(f"  SKIPPED {s['model']}: {s['reason']}")
    return "\n".join(lines)


def format_machine(machine: dict) -> str:
    versions = ", ".join(f"{k} {machine[k].split('-')[0]}"  # openvino's has its build after a '-'
                         for k in ("tvm", "llvmlite", "numpy", "torch", "onnxruntime", "openvino")
                         if machine.get(k))
    # the CPU's bf16 and int8 dot-product instructions, if any
    narrow = [*(machine.get("cpu_bf16") or []), *(machine.get("cpu_int8") or [])]
    flags = "".join(f", {flag}" for flag in narrow)
    return (f"machine: {machine['cpu_model'] or '?'} (llvm cpu {machine['cpu']}{flags}), "
            f"{machine['cores']} cores, threads {machine['threads'] or 'default'}, "
            f"load {'/'.join(map(str, machine.get('loadavg') or ['?']))}"
            + (f", a busy process on CPU {machine['busy_cpu']}" if machine.get("busy_cpu") else "")
            + f"; python {machine['python']}, {versions}"
            + (f"; {machine['target']}" if machine.get("target") else ""))


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON; non-finite floats become null (strict JSON has no NaN)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(payload), indent=2) + "\n")


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    """One CSV line per row, columns ``fields``; missing values are empty cells."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in fields})


def plot_speedups(path: Path, rows: list[dict], title: str) -> bool:
    """Bar chart of speedup over TVM default per model (log scale); False without matplotlib.

    jitbyoc's bars are TVM median / jitbyoc median; each peer that ran gets its own bars
    (TVM median / peer median) beside them.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'jitbyoc[bench]')")
        return False
    series = [("jitbyoc", "speedup")] + [(p, f"{p}_vs_tvm") for p in PEER_LABELS
                                         if any(r.get(f"{p}_vs_tvm") for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.8))
    width = 0.8 / len(series)
    for k, (label, key) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        ys = [r.get(key) or float("nan") for r in rows]
        bars = ax.bar(xs, ys, width, label=label)
        if key == "speedup":
            ax.bar_label(bars, labels=[f"{y:.2g}x" for y in ys], fontsize=7, padding=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=35, ha="right")
    ax.set_ylabel("speedup over TVM default (median run time)")
    ax.set_title(textwrap.fill(title, 120), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
