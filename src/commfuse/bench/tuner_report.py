"""What ``commfuse tune`` reports of a profile: each calibration point's measured time, model
and errors, and how often the tuner's choice was the fastest measured (its regret)."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from typing import Any

from commfuse.collectives.profile import Profile
from commfuse.collectives.tuner import choose_for, model_at_block, predict


def describe(profile: Profile) -> list[dict[str, Any]]:
    """One record per calibration point: measured, model and leave-one-out errors, and whether
    ``choose`` picks that algorithm there (for ``commfuse tune``'s report)."""
    world = profile.world_size
    records: list[dict[str, Any]] = []
    for collective, algos in profile.corrections.items():
        rows: list[dict[str, Any]] = []
        for algo, fix in algos.items():
            loo = fix.leave_one_out_errors()
            for i, (size, measured) in enumerate(
                zip(fix.sizes_bytes, fix.measured_s, strict=False)
            ):
                block = fix.block_bytes[i] if i < len(fix.block_bytes) else 0
                model = model_at_block(collective, algo, size, world, profile, block)
                rows.append(
                    {
                        "collective": collective,
                        "algo": algo,
                        "bytes": size,
                        "block_bytes": block or None,
                        "measured_s": measured,
                        "model_s": model,
                        "predicted_s": predict(collective, algo, size, world, profile),
                        "model_err": model / measured - 1.0,
                        "loo_err": loo[i],
                        "chosen": choose_for(collective, size, world, profile) == algo,
                    }
                )
        rows.sort(key=lambda r: (r["bytes"], r["measured_s"]))
        best: dict[Any, Any] = {}
        for row in rows:  # fastest first within each size
            best.setdefault(row["bytes"], row["measured_s"])
        for row in rows:
            # Measured over the best measured at its size, less 1: the chosen row's is auto's.
            row["regret"] = row["measured_s"] / best[row["bytes"]] - 1.0
        records.extend(rows)
    return records


def pick_summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per collective, from ``describe``'s records: how often ``choose`` picks each algorithm
    over the calibration sizes, how often that is the fastest measured, and its regret (the
    pick's measured time over the fastest's, less 1), median and worst."""
    picked: dict[str, list[dict[str, Any]]] = {}
    for row in records:
        if row["chosen"]:
            picked.setdefault(row["collective"], []).append(row)
    return [
        {
            "collective": collective,
            **pick_stats(
                [row["algo"] for row in rows],
                [row["regret"] for row in rows],
                best_picked=sum(row["regret"] == 0.0 for row in rows),
            ),
        }
        for collective, rows in picked.items()
    ]


def pick_stats(
    picks: Sequence[str], regrets: Sequence[float], *, best_picked: int
) -> dict[str, Any]:
    """One summary of a choice made at several sizes: how many sizes, how often each algorithm
    was picked (most often first), how often the pick was the fastest measured, and the regret
    (pick's time over the fastest's, less 1), median and worst."""
    counts = collections.Counter(picks)
    return {
        "sizes": len(picks),
        "picks": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "best_picked": best_picked,
        "median_regret": statistics.median(regrets),
        "max_regret": max(regrets),
    }
