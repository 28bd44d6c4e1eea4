"""The zoo suite's outputs: the table, results.json/.csv and the ratio plot.

Ratios here are *time* ratios, jitbyoc's median over a peer's: below 1 jitbyoc is faster.
(The default suite's "speedup" is the other way up, TVM's time over jitbyoc's.)
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

from .report import PEER_LABELS, fmt_ms, fmt_num, format_machine, write_csv, write_json

log = logging.getLogger(__name__)
LABELS = {**PEER_LABELS, "tvm": "tvm"}


def _ratio(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2f}"


def _cells(row: dict) -> list[str]:
    fastest = row.get("fastest_peer")
    offload = (f"{row['offload_share']:.0%}" if row.get("offload_share") is not None else "-")
    return [row["model"], fmt_num(row["gflop"], ".2f"), offload, LABELS.get(row["reference"], "-"),
            fmt_num(row["build_cold_jitbyoc_s"], ".1f"), fmt_num(row["build_tvm_s"], ".1f"),
            fmt_ms(row["jitbyoc_median_s"]), fmt_ms(row["onnxruntime_median_s"]),
            fmt_ms(row["torch_median_s"]), fmt_ms(row["tvm_median_s"]),
            _ratio(row, "ratio_onnxruntime"),
            f"{_ratio(row, 'ratio_fastest')} {LABELS.get(fastest, '')}".rstrip(),
            fmt_num(row["jitbyoc_gflops"], ".1f"), fmt_num(row["jitbyoc_peak_pct"], ".0f"),
            fmt_num(row["max_rel_err"], ".1e") + ("" if row["ok"] is not False else " !"),
            fmt_num(row["loadavg"], ".2f")]


HEAD = ["model", "GFLOP", "offload", "ref", "build jit s", "build tvm s", "jitbyoc ms", "ort ms",
        "torch ms", "tvm ms", "jit/ort", "jit/fastest", "GFLOP/s", "% peak", "rel err", "load"]


def format_table(rows: list[dict], skipped: list[dict], machine: dict, summary: dict) -> str:
    """The zoo results as aligned text, with the machine, the geomeans, notes and skips.

    Parameters
    ----------
    rows : list of dict
        Zoo rows (keys: :func:`bench.zoo_run.columns`).
    skipped : list of dict
        ``{"model": ..., "reason": ...}`` per model that did not run.
    machine : dict
        :func:`bench.run.machine_info` plus ``peak_gflops`` and ``loadavg_end``.
    summary : dict
        ``geomean_ratio_onnxruntime`` and ``geomean_ratio_fastest`` (None if no row).
    """
    body = [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in [HEAD] + body) for i in range(len(HEAD))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [format_machine(machine) + f"; load at end "
             f"{'/'.join(map(str, machine.get('loadavg_end') or ['?']))}",
             fmt(HEAD), fmt(["-" * w for w in widths])] + [fmt(c) for c in body]
    g_ort, g_fast = summary.get("geomean_ratio_onnxruntime"), summary.get("geomean_ratio_fastest")
    lines.append(f"geomean jitbyoc/onnxruntime time {fmt_num(g_ort, '.2f')}, jitbyoc/fastest peer "
                 f"{fmt_num(g_fast, '.2f')} (below 1: jitbyoc faster)")
    slower = summary.get("build_slower_than_tvm")
    if slower is not None:
        lines.append("cold build slower than TVM's own build: " + (", ".join(slower) or "none"))
    lines.append("jit/X = jitbyoc median / X median; median of all calls, every candidate "
                 "timed in blocks of warm calls taking turns; GFLOP = 2 x MACs of conv/matmul/attention; "
                 f"% peak of {machine.get('peak_gflops', 0):.0f} GFLOP/s measured; ref = what "
                 "jitbyoc's output is checked against ('!' = rel err above tolerance); "
                 "load = 1-min load average after the model")
    for r in rows:
        if r.get("left_to_tvm"):
            lines.append(f"  {r['model']}: left to TVM: {r['left_to_tvm']}")
        if r.get("notes"):
            lines.append(f"  {r['model']}: {r['notes']}")
    lines += [f"  SKIPPED {s['model']}: {s['reason']}" for s in skipped]
    return "\n".join(lines)


def plot_ratios(path: Path, rows: list[dict], title: str) -> bool:
    """Bars of jitbyoc's time over the fastest peer's per model (log scale, a line at 1);
    each bar is labelled with the ratio and that peer. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'jitbyoc[bench]')")
        return False
    rows = [r for r in rows if r.get("ratio_fastest")]
    if not rows:
        return False
    colors = {"onnxruntime": "tab:blue", "torch": "tab:orange", "tvm": "tab:gray"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.8))
    ys = [r["ratio_fastest"] for r in rows]
    # bars grow from 1.0 (parity), up when jitbyoc is slower, down when it is faster
    bars = ax.bar(range(len(rows)), [y - 1 for y in ys], 0.7, bottom=1.0,
                  color=[colors[r["fastest_peer"]] for r in rows])
    ax.bar_label(bars, labels=[f"{y:.2f} {LABELS[r['fastest_peer']]}" for y, r in zip(ys, rows)],
                 fontsize=7, padding=2)
    ax.set_yscale("log")
    lo, hi = min(ys + [1.0]) / 1.25, max(ys + [1.0]) * 1.25
    ax.set_ylim(lo, hi)
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 20) if lo <= t <= hi]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=35, ha="right")
    ax.set_ylabel("jitbyoc time / fastest peer's (below 1: jitbyoc faster)")
    shown = [p for p in colors if any(r["fastest_peer"] == p for r in rows)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in shown],
              [f"fastest peer: {LABELS[p]}" for p in shown], fontsize=8)
    ax.set_title(textwrap.fill(title, 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out: Path, rows: list[dict], skipped: list[dict], machine: dict,
                  summary: dict, settings: dict) -> list[Path]:
    """results.json (everything), results.csv (the rows) and zoo_ratio.png under ``out``."""
    from .zoo_run import columns

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv"]
    write_json(paths[0], {"machine": machine, "settings": settings, "summary": summary,
                          "columns": columns(), "rows": rows, "skipped": skipped})
    write_csv(paths[1], rows, columns())
    title = (f"{format_machine(machine)}; peak {machine.get('peak_gflops', 0):.0f} GFLOP/s; "
             f"load at end {'/'.join(map(str, machine.get('loadavg_end') or ['?']))}")
    if plot_ratios(out / "zoo_ratio.png", rows, title):
        paths.append(out / "zoo_ratio.png")
    return paths
