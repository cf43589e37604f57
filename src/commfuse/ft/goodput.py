"""Two figures of a fault-tolerant run from its per-attempt reports: goodput and samples.

**Goodput** is committed steps per second of training: the steps committed after the first
``warmup`` ones (which pay one-off costs, as in ``train/metrics.py``) over the time from the
first commit of step ``warmup - 1`` (on any replica group) to the last commit of the last step.
Failed attempts, the wait for a new quorum and a joiner's recovery all fall inside that
window, so a fault costs goodput exactly the time it held the survivors up. Without faults its
inverse is the mean step time.

**Samples.** Each committed attempt names the indices ``[start, stop)`` of the step's global
batch it trained (``data.py``). Over the committed steps, the accounting counts the indices
trained (``samples_trained``), those trained more than once in one step
(``samples_duplicated``, 0 unless the data split is wrong), and those no replica group trained
(``samples_lost``): ``samples_trained + samples_lost = committed_steps x num_replicas x batch``
holds by construction, and ``samples_duplicated = 0`` is what makes it exact.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def goodput(records: list[dict[str, Any]], *, steps: int, warmup: int) -> dict[str, Any]:
    """``goodput_steps_per_s`` and ``goodput_window_s`` (see the module docstring); None for
    both when fewer than two steps were committed after the warm-up.

    Args:
        records: every attempt of every replica life (``t`` is its end, monotonic).
        steps: the steps the run committed.
        warmup: steps left out at the start.
    """
    first = max(0, min(warmup, steps - 2)) - 1
    ends: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r["committed"]:
            ends[r["step"]].append(r["t"])
    if steps - 1 not in ends or (first >= 0 and first not in ends):
        return {"goodput_steps_per_s": None, "goodput_window_s": None}
    start = min(ends[first]) if first >= 0 else min(r["t0"] for r in records)
    window = max(ends[steps - 1]) - start
    counted = steps - 1 - first
    return {
        "goodput_steps_per_s": counted / window if window > 0 else None,
        "goodput_window_s": window,
        "goodput_steps": counted,
    }


def sample_accounting(
    records: list[dict[str, Any]], *, committed_steps: int, num_replicas: int, batch: int
) -> dict[str, int]:
    """``samples_trained``, ``samples_duplicated`` and ``samples_lost`` over the first
    ``committed_steps`` steps (see the module docstring)."""
    counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        if r["committed"] and r["step"] < committed_steps and r.get("samples") is not None:
            start, stop = r["samples"]
            for index in range(start, stop):
                counts[r["step"]][index] += 1
    trained = sum(len(c) for c in counts.values())
    duplicated = sum(n - 1 for c in counts.values() for n in c.values())
    return {
        "samples_trained": trained,
        "samples_duplicated": duplicated,
        "samples_lost": committed_steps * num_replicas * batch - trained,
    }
