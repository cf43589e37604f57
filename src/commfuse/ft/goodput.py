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
holds by construction, and ``samples_duplicated = 0`` is what makes it exact. A replica
killed between its commit and its report trained its share without saying so, and so did a
member whose exchange failed after its part had reached another member's committed sum; the
commits inferred for them (``unreported_commits``) count as trained, and the record says how
many there were.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from commfuse.ft.config import GlobalBatch
from commfuse.ft.data import sample_range


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


def period_goodput(
    records: list[dict[str, Any]], *, steps: int, first_step: int = 0
) -> dict[str, Any]:
    """``goodput`` of per-period mode, in inner steps: a period's commit ends its last inner
    step, and the window starts at the first commit of the first period (which pays the
    one-off costs: the first quorum, the first exchange), so ``steps`` committed inner steps
    count ``steps - 1 - last inner step of period 0``; None when nothing came after it.

    Args:
        records: every attempt of every replica life (one per period: ``first_step`` and
            ``inner_steps`` say which inner steps it covers).
        steps: the inner steps the run committed.
        first_step: the inner step the run started at (``init_from``'s).
    """
    ends = [r | {"step": r["first_step"] + r["inner_steps"] - 1} for r in records]
    first = min(
        (r["step"] for r in ends if r["committed"] and r["first_step"] == first_step),
        default=None,
    )
    if first is None or first >= steps - 1:
        return {"goodput_steps_per_s": None, "goodput_window_s": None}
    return goodput(ends, steps=steps, warmup=first + 1)


def period_samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-period mode's committed attempts as one record per inner step, each naming the
    samples its replica trained at that inner step (the period's share of every inner step's
    global batch; none at the first ``skipped_steps``, which a late joiner skipped), for
    ``sample_accounting``."""
    return [
        {"step": r["first_step"] + i, "committed": True, "samples": r.get("samples")}
        for r in records
        if r["committed"]
        for i in range(r.get("skipped_steps", 0), r["inner_steps"])
    ]


def unreported_commits(
    records: list[dict[str, Any]], kills: list[dict[str, Any]], *, policy: GlobalBatch,
    num_replicas: int, batch: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """The shares that reached a committed sum without a committed report to say so.

    A replica that commits step s with ``k`` participants applied the sum of ``k`` gradients:
    its vote passes only when every collective of its step finished, and a collective of the
    quorum finishes only with every member's part in it. Every member of that quorum trained
    its samples of s, then, and two kinds of member do not say so:

    * one whose own collective failed after its part had left: a peer was killed when the
      ring had finished on some members and not yet on others. Those commit s, it reports s
      failed, and it recovers their commit at the next quorum. Its failed attempt, of the
      same quorum (``quorum``), names its share;
    * a replica killed after the commit vote of s and before its report of it. It shows as a
      step that the survivors committed with ``k`` participants and fewer than ``k``
      reports, and a killed replica whose last report was of the step before (or a failed
      try of s). Its share is then the one nobody reported: ``fixed``, the shares of ``k``
      participants minus those reported; ``shrink``, its own slot.

    Returns one record per such commit, marked ``inferred``."""
    committed: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["committed"]:
            committed[r["step"]].append(r)
    inferred = []
    for r in records:
        if r["committed"] or r.get("quorum") is None or r.get("samples") is None:
            continue
        reports = committed.get(r["step"], [])
        same = [c for c in reports if c.get("quorum") == r["quorum"]]
        if same and all(c["replica"] != r["replica"] for c in reports):
            entry = {"replica": r["replica"], "step": r["step"], "committed": True,
                     "samples": r["samples"]}  # fmt: skip
            if "skipped_steps" in r:  # per period: a late joiner's share skipped the first
                entry["skipped_steps"] = r["skipped_steps"]
            inferred.append(entry | {"inferred": True})
            committed[r["step"]].append(entry | {"participants": r["participants"]})
    for kill in kills:
        mine = [
            r
            for r in records
            if r["replica"] == kill["replica"]
            and r.get("life") == kill.get("life", r.get("life"))
            and r["t"] <= kill["t"]
        ]
        if not mine:
            continue
        last = max(mine, key=lambda r: r["t"])
        step = last["step"] + 1 if last["committed"] else last["step"]
        reports = committed.get(step, [])
        if not reports or any(r["replica"] == kill["replica"] for r in reports):
            continue
        k = max(r["participants"] for r in reports)
        if len(reports) >= k:
            continue  # it was not in the quorum that committed
        if policy == "shrink":
            samples = [kill["replica"] * batch, (kill["replica"] + 1) * batch]
        else:
            shares = {
                sample_range("fixed", replica=0, participant=p, participants=k,
                             num_replicas=num_replicas, batch=batch)
                for p in range(k)
            }  # fmt: skip
            missing = sorted(shares - {tuple(r["samples"]) for r in reports if r["samples"]})
            if len(missing) != 1:
                continue  # several at once: not inferred (counted lost)
            samples = list(missing[0])
        entry = {"replica": kill["replica"], "step": step, "committed": True, "samples": samples}
        inferred.append(entry | {"inferred": True})
        committed[step].append(entry | {"participants": k})
    return inferred


def sample_accounting(
    records: list[dict[str, Any]],
    *,
    committed_steps: int,
    num_replicas: int,
    batch: int,
    first_step: int = 0,
) -> dict[str, int]:
    """``samples_trained``, ``samples_duplicated`` and ``samples_lost`` over the steps from
    ``first_step`` (``init_from``'s) to ``committed_steps`` (see the module docstring);
    ``records`` include the ``unreported_commits``."""
    counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        in_run = first_step <= r["step"] < committed_steps
        if r["committed"] and in_run and r.get("samples") is not None:
            start, stop = r["samples"]
            for index in range(start, stop):
                counts[r["step"]][index] += 1
    trained = sum(len(c) for c in counts.values())
    duplicated = sum(n - 1 for c in counts.values() for n in c.values())
    return {
        "samples_trained": trained,
        "samples_duplicated": duplicated,
        "samples_lost": (committed_steps - first_step) * num_replicas * batch - trained,
    }
