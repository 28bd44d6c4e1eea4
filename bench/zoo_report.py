"""The zoo suite's outputs: the table, results.json/.csv and the ratio plot.

Ratios here are *time* ratios, jitbyoc's median over a peer's: below 1 jitbyoc is faster.
(The default suite's "speedup" is the other way up, TVM's time over jitbyoc's.)
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

from .peers import FP16_NAMES, INT8_NAMES
from .report import PEER_LABELS, fmt_ms, fmt_num, format_machine, write_csv, write_json
from .zoo_run import PEERS, columns

log = logging.getLogger(__name__)
# onnxruntime and OpenVINO on the int8 QDQ copy (--precision int8): "ort qdq", "ov qdq";
# on the float16 copy (--precision fp16): "ort fp16", "ov fp16"
LABELS = {**PEER_LABELS, "openvino": "ov", "openvino_f32": "ov f32", "tvm": "tvm",
          "onnxruntime_int8": "ort qdq", "openvino_int8": "ov qdq",
          "onnxruntime_fp16": "ort fp16", "openvino_fp16": "ov fp16", "jitbyoc_fp32": "jit fp32"}
# a jit/X column each, when X ran (jit/jit fp32: the narrow build's time over jitbyoc's fp32 one)
RATIO_PEERS = ("jitbyoc_fp32", "onnxruntime", "openvino", "onnxruntime_int8", "openvino_int8",
               "onnxruntime_fp16", "openvino_fp16")
# 1-cos, top1 columns
ACCURACY = ("jitbyoc", "onnxruntime_int8", "openvino_int8", "onnxruntime_fp16", "openvino_fp16",
            "openvino")


def _ratio(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2f}"


def _ran(rows: list[dict], who: str) -> list[dict]:
    return [r for r in rows if r.get(f"{who}_median_s") is not None]


def _precision(rows: list[dict], who: str) -> str:
    """What ``who`` ran in over ``rows`` (``fp32``, ``bf16``; ``bf16/fp32`` if it varied)."""
    return "/".join(sorted({r.get(f"{who}_precision") or "fp32" for r in _ran(rows, who)}))


def _run_columns(rows: list[dict]) -> list[tuple[str, object]]:
    """Times of every candidate that ran, headed with its precision, and the ratios."""
    who = ["jitbyoc"] + [p for p in PEERS if _ran(rows, p)]
    cols = [(f"{LABELS.get(w, w)} ms [{_precision(rows, w)}]",
             lambda r, w=w: fmt_ms(r.get(f"{w}_median_s"))) for w in who]
    cols += [(f"jit/{LABELS[p]}", lambda r, p=p: _ratio(r, f"ratio_{p}"))
             for p in RATIO_PEERS if p in who]
    cols.append(("jit/fastest", lambda r: f"{_ratio(r, 'ratio_fastest')} "
                 f"{LABELS.get(r.get('fastest_peer'), '')}".rstrip()))
    return cols


def _accuracy_columns(rows: list[dict]) -> list[tuple[str, object]]:
    """1 - cos and top-1 against the fp32 model, for jitbyoc and the peers of
    :data:`ACCURACY` where they ran in a lower precision or on a lower-precision copy
    (OpenVINO runs the float16 copy in f32 on a CPU without bf16; fp32 rows have none)."""
    cols = []
    for who in ACCURACY:
        if any(r.get(f"{who}_precision") not in (None, "fp32") or who in INT8_NAMES + FP16_NAMES
               for r in _ran(rows, who)):
            short = "jit" if who == "jitbyoc" else LABELS[who]
            cols += [(f"1-cos {short}", lambda r, w=who: fmt_num(r.get(f"{w}_cos_err"), ".1e")),
                     (f"top1 {short}", lambda r, w=who: fmt_num(r.get(f"{w}_top1"), ".0%"))]
    return cols


def table_columns(rows: list[dict]) -> list[tuple[str, object]]:
    """``(header, cell of a row)`` of every column the table shows for ``rows``."""
    cols = [("model", lambda r: r["model"]), ("GFLOP", lambda r: fmt_num(r["gflop"], ".2f"))]
    if any(r.get("lowered_gflop") is not None for r in rows):
        cols.append(("bf16 GFLOP", lambda r: fmt_num(r.get("lowered_gflop"), ".2f")))
    cols += [("offload", lambda r: fmt_num(r.get("offload_share"), ".0%")),
             ("ref", lambda r: LABELS.get(r["reference"], "-")),
             ("build jit s", lambda r: fmt_num(r["build_cold_jitbyoc_s"], ".1f")),
             ("build tvm s", lambda r: fmt_num(r["build_tvm_s"], ".1f"))]
    cols += _run_columns(rows)
    cols += [("GFLOP/s", lambda r: fmt_num(r["jitbyoc_gflops"], ".1f")),
             ("% peak", lambda r: fmt_num(r["jitbyoc_peak_pct"], ".0f")),
             ("rel err", lambda r: fmt_num(r["max_rel_err"], ".1e") + (" !" if r["ok"] is False else ""))]
    return cols + _accuracy_columns(rows) + [("load", lambda r: fmt_num(r["loadavg"], ".2f"))]


def _summary_lines(summary: dict, machine: dict) -> list[str]:
    ratios = [f"{LABELS[p]} {fmt_num(summary.get(f'geomean_ratio_{p}'), '.2f')}"
              for p in PEERS if summary.get(f"geomean_ratio_{p}") is not None]
    lines = [f"geomean jitbyoc/X time: {', '.join(ratios) or '-'}; jitbyoc/fastest peer at "
             f"jitbyoc's precision {fmt_num(summary.get('geomean_ratio_fastest'), '.2f')} "
             "(below 1: jitbyoc faster)"]
    slower = summary.get("build_slower_than_tvm")
    if slower is not None:
        lines.append("cold build slower than TVM's own build: " + (", ".join(slower) or "none"))
    lines.append("[p] = what the column's products run in; jit/X = jitbyoc median / X median; "
                 "fastest = fastest peer running at jitbyoc's precision; median of all calls, "
                 "every candidate timed in blocks of warm calls taking turns; GFLOP = 2 x MACs "
                 "of conv/matmul/attention (bf16 GFLOP: those lowered to bf16); "
                 + _peak_note(machine) +
                 "ref = what jitbyoc's output is checked against ('!' = rel err above "
                 "tolerance; at int8 and fp16 not judged); 1-cos, top1 = against jitbyoc's "
                 "fp32 build of the fp32 model; ort/ov qdq, ort/ov fp16 = onnxruntime/OpenVINO "
                 "on the int8 QDQ copy, the float16 copy; "
                 "load = 1-min load average after the model")
    return lines


def _peak_note(machine: dict) -> str:
    """What the "% peak" column divides by."""
    fp32, bf16 = machine.get("peak_gflops", 0), machine.get("bf16_peak_gflops")
    if machine.get("int8_peak_gflops"):
        return (f"% peak = the time the model's GOP take at the {machine.get('int8_loop', 'vpdpbusd')} loop's "
                f"{machine['int8_peak_gflops']:.0f} GOP/s (as if all ran in int8) over jitbyoc's; ")
    if not bf16:
        return f"% peak of {fp32:.0f} GFLOP/s measured (the fp32 FMA loop); "
    return (f"% peak = the time the model's GFLOP take at peak (bf16 GFLOP at the "
            f"{machine.get('bf16_loop', 'vdpbf16ps')} loop's "
            f"{bf16:.0f} GFLOP/s, the rest at the FMA loop's {fp32:.0f}) over jitbyoc's; ")


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
        :func:`bench.zoo_run.summarize`: ``geomean_ratio_<peer>`` and
        ``geomean_ratio_fastest`` (None if no row), ``build_slower_than_tvm``.
    """
    cols = table_columns(rows)
    head = [h for h, _ in cols]
    body = [[cell(r) for _, cell in cols] for r in rows]
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [format_machine(machine) + f"; load at end "
             f"{'/'.join(map(str, machine.get('loadavg_end') or ['?']))}",
             fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in body]
    lines += _summary_lines(summary, machine)
    for r in rows:
        if r.get("left_to_tvm"):
            lines.append(f"  {r['model']}: left to TVM: {r['left_to_tvm']}")
        if r.get("notes"):
            lines.append(f"  {r['model']}: {r['notes']}")
    lines += [f"  SKIPPED {s['model']}: {s['reason']}" for s in skipped]
    return "\n".join(lines)


COLORS = {"onnxruntime": "tab:blue", "openvino": "tab:purple", "openvino_f32": "tab:green",
          "torch": "tab:orange", "tvm": "tab:gray", "onnxruntime_int8": "tab:cyan",
          "openvino_int8": "tab:pink", "onnxruntime_fp16": "tab:olive", "openvino_fp16": "tab:red"}
# log-axis ticks to choose from; at most MAX_TICKS of those in range are labelled
TICKS = (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.2, 1.3, 1.5, 1.7, 2, 2.5,
         3, 4, 5, 7, 10, 15, 20, 30, 50)
MAX_TICKS = 9
TITLE_PT = 8  # title font size; its lines are wrapped to the figure's width


def _openvino_column(rows: list[dict]) -> str | None:
    """The OpenVINO run a second bar compares with: fp32 where it ran, else its default."""
    return next((p for p in ("openvino_f32", "openvino") if any(r.get(f"ratio_{p}") for r in rows)), None)


def _ticks(lo: float, hi: float) -> list[float]:
    """Labelled ticks in ``[lo, hi]``: 1 and evenly thinned :data:`TICKS`."""
    inside = [t for t in TICKS if lo <= t <= hi]
    step = -(-len(inside) // MAX_TICKS)
    return sorted(set(inside[::step]) | {1})


def plot_ratios(path: Path, rows: list[dict], title: str) -> bool:
    """:func:`ratio_figure` written to ``path``; False without matplotlib or ratios."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'jitbyoc[bench]')")
        return False
    fig = ratio_figure(rows, title)
    if fig is None:
        return False
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def ratio_figure(rows: list[dict], title: str):
    """Bars of jitbyoc's time over the fastest peer's per model, and beside each over
    OpenVINO's (fp32 where it ran; hatched), on a log scale with a line at 1; each bar is
    labelled with its ratio (and the fastest peer). The figure grows with the models, the
    title wraps to its width. None without ratios."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in rows if r.get("ratio_fastest")]
    if not rows:
        return None
    ov = _openvino_column(rows)
    width = max(6.0, (0.9 if ov else 0.6) * len(rows) + 2.5)
    fig, ax = plt.subplots(figsize=(width, 5.2))
    xs, bar = list(range(len(rows))), 0.38 if ov else 0.7
    fast = [r["ratio_fastest"] for r in rows]
    shift = -bar / 2 if ov else 0.0
    # bars grow from 1.0 (parity), up when jitbyoc is slower, down when it is faster
    bars = ax.bar([x + shift for x in xs], [y - 1 for y in fast], bar, bottom=1.0,
                  color=[COLORS[r["fastest_peer"]] for r in rows])
    ax.bar_label(bars, labels=[f"{y:.2f}\n{LABELS[r['fastest_peer']]}" for y, r in zip(fast, rows)],
                 fontsize=7, padding=2)
    shown = [ov] if ov else []
    theirs = [r.get(f"ratio_{ov}") for r in rows] if ov else []
    if ov:
        ys = [y if y else 1.0 for y in theirs]
        ob = ax.bar([x + bar / 2 for x in xs], [y - 1 for y in ys], bar, bottom=1.0, color="white",
                    edgecolor=COLORS[ov], hatch="//")
        ax.bar_label(ob, labels=[f"{y:.2f}" if y else "" for y in theirs], fontsize=7, padding=2)
    ax.set_yscale("log")
    everything = fast + [y for y in theirs if y] + [1.0]
    lo, hi = min(everything) / 1.3, max(everything) * 1.3
    ax.set_ylim(lo, hi)
    ticks = _ticks(lo, hi)
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(xs, [r["model"] for r in rows], rotation=35, ha="right")
    ax.set_ylabel("jitbyoc time / peer's time\n(below 1: jitbyoc faster)")
    peers = [p for p in COLORS if any(r["fastest_peer"] == p for r in rows)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in peers] + \
        [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=COLORS[p], hatch="//") for p in shown]
    ax.legend(handles, [f"fastest peer: {LABELS[p]}" for p in peers] + [f"against {LABELS[p]}" for p in shown],
              fontsize=7)
    ax.set_title(textwrap.fill(title, int(width * 72 / (0.6 * TITLE_PT))), fontsize=TITLE_PT)
    fig.tight_layout()
    return fig


def write_outputs(out: Path, rows: list[dict], skipped: list[dict], machine: dict,
                  summary: dict, settings: dict) -> list[Path]:
    """results.json (everything), results.csv (the rows) and zoo_ratio.png under ``out``."""
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
