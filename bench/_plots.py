"""PNG plots of the serving benchmarks (matplotlib, Agg). Records are the JSONL dicts."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from ._stats import finite, label_points

COLORS = ("tab:blue", "tab:green", "tab:orange", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
MARKERS = ("o", "s", "^", "D", "v", "P")
LINES = ("-", "--", ":", "-.")


def style(i: int) -> dict[str, Any]:
    """Config i's colour, marker and line style (distinct, so overlapping lines stay visible)."""
    return {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)],
            "linestyle": LINES[i % len(LINES)]}


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def by_label(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by config label (first-seen order), each sorted by concurrency."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["label"], []).append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in groups.items()}


def pareto(records: Sequence[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """Output throughput per GPU against interactivity (1/TPOT), one curve per config.
    Hollow markers: runs where requests queued for KV (iso-capacity's stopping point)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (label, rs) in enumerate(by_label(records).items()):
        st = style(i)
        rs = [r for r in rs if finite(r.get("interactivity_tok_s_per_user"))]
        xs = [r["interactivity_tok_s_per_user"] for r in rs]
        ys = [r["output_throughput_per_gpu"] for r in rs]
        ax.plot(xs, ys, color=st["color"], linestyle=st["linestyle"], label=label, lw=1.5)
        for x, y, r in zip(xs, ys, rs):
            fits = r.get("kv", {}).get("status", "fits") == "fits"
            ax.plot([x], [y], st["marker"], color=st["color"],
                    mfc=st["color"] if fits else "white", ms=5)
        label_points(ax, xs, ys, [f"c={r['concurrency']}" for r in rs])
    ax.set_xlabel("interactivity (output tok/s per user = 1 / mean TPOT)")
    ax.set_ylabel("output throughput per GPU (tok/s)")
    ax.set_title(f"{title}\n(hollow: requests queued for KV)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def grouped_bars(groups: Sequence[str], series: dict[str, Sequence[float]], path: pathlib.Path,
                 ylabel: str, title: str, fmt: str = "{:.0f}") -> None:
    """One group of bars per entry of ``groups``, one bar per series in each, values on top."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    width = 0.8 / max(len(series), 1)
    for i, (label, vals) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, vals, width, label=label, color=COLORS[i % len(COLORS)])
        for x, v in zip(xs, vals):
            ax.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups,
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def bars(headline: Sequence[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """One bar per config (its headline run): output tok/s per GPU, mean TTFT, mean TPOT."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    names = [f"{r['label']}\nc={r['concurrency']}" for r in headline]
    colors = [COLORS[i % len(COLORS)] for i in range(len(headline))]
    panels = (("output_throughput_per_gpu", "output tok/s per GPU", 1.0),
              ("ttft_mean_ms", "mean TTFT (s)", 1e-3), ("tpot_mean_ms", "mean TPOT (ms)", 1.0))
    for ax, (key, ylabel, scale) in zip(axes, panels):
        vals = [(r.get(key) or 0.0) * scale for r in headline]
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), names, fontsize=7)
        ax.set_ylabel(ylabel)
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def against_concurrency(records: Sequence[dict[str, Any]], path: pathlib.Path, title: str,
                        panels: Sequence[tuple[str, str, float]]) -> None:
    """One panel per ``(key, ylabel, scale)``, value against concurrency, one line per config.
    A key ``a.b`` reads ``record[a][b]``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (key, ylabel, scale) in zip(axes[0], panels):
        for i, (label, rs) in enumerate(by_label(records).items()):
            pts = [(r["concurrency"], _get(r, key)) for r in rs]
            pts = [(c, v * scale) for c, v in pts if finite(v)]
            if pts:
                ax.plot(*zip(*pts), label=label, ms=5 - i % 3, mfc="none" if i % 2 else None,
                        **style(i))
        levels = sorted({r["concurrency"] for r in records})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _get(record: dict[str, Any], key: str) -> float | None:
    obj: Any = record
    for part in key.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj
