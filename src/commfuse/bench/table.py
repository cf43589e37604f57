"""Plain-text tables in nccl-tests' spirit, readable in a terminal and in a Markdown file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from commfuse.units import format_size

COLLECTIVE_COLUMNS = (
    ("size", lambda r: format_size(r["bytes"])),
    ("op", lambda r: r["op"]),
    ("algo", lambda r: algo_cell(r)),
    ("time_us", lambda r: f"{r['time_us']:.1f}"),
    ("pred_us", lambda r: "-" if r.get("predicted_us") is None else f"{r['predicted_us']:.1f}"),
    ("algbw_GB/s", lambda r: f"{r['algbw_GBps']:.4f}"),
    ("busbw_GB/s", lambda r: f"{r['busbw_GBps']:.4f}"),
    ("%link", lambda r: "-" if r.get("link_pct") is None else f"{r['link_pct']:.1f}"),
    ("speedup", lambda r: ratio_cell(r, "speedup_vs_first", ".2f")),
    ("wrong", lambda r: str(r["wrong"])),
)


def algo_cell(record: dict[str, Any]) -> str:
    """The variant's name; ``auto`` rows add what the tuner ran (``auto:ring``)."""
    name = str(record.get("variant", record["algo"]))
    chosen = record.get("chosen")
    return f"{name}:{chosen}" if name == "auto" and chosen and chosen != "auto" else name


def ratio_cell(record: dict[str, Any], key: str, spec: str = ".3f") -> str:
    """``record[key]`` formatted, with " (tie)" where the record says it lies within the A/A
    control's noise floor (``bench/schedule.py``); "-" where it is missing."""
    value = record.get(key)
    if value is None:
        return "-"
    return format(value, spec) + (" (tie)" if record.get("tie") else "")


#: The fewest rounds whose interval of the median (``schedule.median_interval``) holds at least
#: 95%: below six it is the per-round ratios' whole range, which covers less (half at two rounds).
_MIN_ROUNDS_95 = 6

#: Where each command's records count their rounds: the first of these keys with an integer.
_ROUND_KEYS = ("repeats", "rounds", "reps", "num_reps", "iters")


def _rounds_of(record: dict[str, Any]) -> int | None:
    """How many rounds ``record`` was measured over; None where it does not say."""
    for key in _ROUND_KEYS:
        value = record.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def interval_label(records: Sequence[dict[str, Any]]) -> str:
    """What the records' ``ratio_ci`` is, as a column names it: ``95%`` where every record with
    one was measured over at least ``_MIN_ROUNDS_95`` rounds, ``range`` where one was measured
    over fewer (the whole range of its rounds, short of 95%), ``interval`` where one does not
    say how many rounds it had."""
    counts = [_rounds_of(r) for r in records if r.get("ratio_ci") is not None]
    if any(n is not None and n < _MIN_ROUNDS_95 for n in counts):
        return "range"
    return "interval" if None in counts else "95%"


def control_note(records: Sequence[dict[str, Any]], label: str = "variant") -> str | None:
    """One line per distinct A/A control in ``records`` (their ``control_ratio``): what the
    noise floor was and what a tie means; None when no record has a control."""
    seen: list[float] = [r["control_ratio"] for r in records if r.get("control_ratio") is not None]
    if not seen:
        return None
    low, high = min(seen), max(seen)
    spread = f"{low:.3f}" if len(seen) == 1 or low == high else f"{low:.3f} to {high:.3f}"
    # Records that carry their interval were judged by it as well (bench/schedule.py, step 6).
    by_interval = any(r.get("ratio_ci") is not None for r in records)
    what = {"95%": "95% interval", "range": "range"}.get(interval_label(records), "interval")
    rule = f" or whose {what} over rounds holds 1" if by_interval else ""
    return (
        f"A/A control (the baseline {label} timed twice, A'/A): {spread}; a ratio as close to 1 "
        f"as its row's control{rule} is marked (tie): this job cannot tell the two apart"
    )


def render(
    records: Sequence[dict[str, Any]],
    columns: Sequence[tuple[str, Any]] = COLLECTIVE_COLUMNS,
    *,
    markdown: bool = False,
) -> str:
    cells = [[fmt(r) for _, fmt in columns] for r in records]
    heads = [name for name, _ in columns]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    if markdown:
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)) + " |"]
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += [
            "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |"
            for row in cells
        ]
    else:
        lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
