"""The benchmarks' plots: bus bandwidth against message size, one line per (collective,
algorithm), the link rate drawn (``bench collectives``); times as bars, one group per record
(``bench fused``, ``ddp``, ``strategies``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.units import format_size


def plot_busbw(records: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> None:
    """Write a PNG/SVG/PDF (by extension) of busbw vs size; one panel per collective."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed: benchmarks run on headless machines
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in records:
            # The A/A control's copy (variant "native'") would draw the baseline's line twice.
            if r["op"] == op and r.get("variant", r["algo"]) == r["algo"]:
                lines[r["algo"]].append((r["bytes"], r["busbw_GBps"]))
        for algo, points in lines.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=algo)
        link = next((r["link_gbit"] for r in records if r.get("link_gbit")), None)
        if link:
            ax.axhline(
                link / 8.0,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"link {link:g} Gbit/s",
            )
        sizes = sorted({r["bytes"] for r in records if r["op"] == op})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    label: Callable[[dict[str, Any]], str],
    bars: Sequence[tuple[str, str]],
    scale: float,
    unit: str,
    spread: tuple[str, str] | None = None,
    title: str = "",
) -> None:
    """Write a PNG/SVG/PDF (by extension) of one group of horizontal bars per record, labelled
    ``label(record)``: one bar per ``(name, key)`` of ``bars``, ``record[key] * scale`` in
    ``unit``; with one bar, ``spread = (low_key, high_key)`` draws the record's range as a
    whisker (the fastest and slowest round beside the median)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed: benchmarks run on headless machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(records) * len(bars)))
    height = 0.8 / len(bars)
    rows = range(len(records))
    for i, (name, key) in enumerate(bars):
        values = [r[key] * scale for r in records]
        offsets = [row + (i - (len(bars) - 1) / 2) * height for row in rows]
        whiskers = None
        if spread is not None and len(bars) == 1:
            low, high = spread
            whiskers = [
                [v - r[low] * scale for v, r in zip(values, records, strict=True)],
                [r[high] * scale - v for v, r in zip(values, records, strict=True)],
            ]
        ax.barh(offsets, values, height=height, xerr=whiskers, capsize=3, label=name)
    ax.set_yticks(list(rows), [label(r) for r in records])
    ax.invert_yaxis()  # the first record (the baseline) on top, as in the table
    ax.set_xlabel(unit)
    ax.grid(True, axis="x", alpha=0.3)
    if len(bars) > 1:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
