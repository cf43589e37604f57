"""What a fault-tolerant run did, from every replica's per-step reports.

Each replica group reports every attempt at a step: the step, whether it committed, the
quorum's size, its loss and times, and after a commit the SHA-256 of its parameters. From
those (and the launcher's record of kills and restarts) the run's record states the steps
committed and lost, the replicas' recoveries and the goodput; each field is defined in
``docs/reliability.md``, "The fields of a fault-tolerant run's record".
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any, Literal

from commfuse.ft.config import GlobalBatch, Timeouts
from commfuse.ft.goodput import (
    goodput,
    period_goodput,
    period_samples,
    sample_accounting,
    unreported_commits,
)


def _failed_after(records: list[dict[str, Any]], t: float) -> float | None:
    """Seconds from ``t`` to the end of the first failed attempt after it, or to the first
    quorum after it smaller than the last one before it (a replica killed between two
    collectives fails no step: the next quorum leaves it out), whichever came first."""
    times = [r["t"] for r in records if r["t"] > t and not r["committed"]]
    before = [r for r in records if r["t_quorum"] <= t]  # quorums formed before the fault
    if before:
        size = max(before, key=lambda r: r["t_quorum"])["participants"]
        times += [r["t_quorum"] for r in records if r["t_quorum"] > t and r["participants"] < size]
    return min(times) - t if times else None


def _committed_after(records: list[dict[str, Any]], t: float) -> float | None:
    """Seconds from ``t`` to the first commit of a step begun after it (a step that was past
    its exchange at ``t`` is no sign of recovery)."""
    times = [r["t"] for r in records if r["t0"] > t and r["committed"]]
    return min(times) - t if times else None


# long because: the record's one definition, each total a few lines over the same lists of
# reports; split into helpers, the record's keys would be scattered over them.
def summarize_ft(
    *,
    records: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    restarts: list[dict[str, Any]],
    results: list[dict[str, Any]],
    num_replicas: int,
    steps: int,
    batch_samples: int,
    wall_s: float,
    topology: str,
    timeouts: Timeouts,
    global_batch: GlobalBatch = "shrink",
    warmup: int = 2,
    mode: Literal["ddp", "periodic"] = "ddp",
    first_step: int = 0,
) -> dict[str, Any]:
    """The run's record (see the module docstring) from the replicas' reports.

    Args:
        records: every attempt of every replica life (``replica.py``'s "step" reports).
        faults: the faults injected: kind, replica, monotonic time t, and a kill's step and
            phase (reported by the replica just before) or a cut's duration ``for_s``.
        restarts: the restarts (replica, t).
        results: the final report of each replica life that finished.
        num_replicas: replica groups at the start.
        steps: the steps the run was to commit.
        batch_samples: samples in one replica group's batch.
        wall_s: the launcher's wall time.
        topology: the cluster, in words.
        timeouts: the run's derived timeouts.
        global_batch: who trained a missing replica group's samples (``data.py``).
        warmup: steps left out of the goodput (``goodput.py``).
        mode: per step (``ddp``: a record per step) or per period (``periodic``: a record
            per period, with ``first_step``, ``inner_steps`` and ``losses``).
        first_step: the step the run started at (``init_from``'s checkpoint; 0 without):
            samples and goodput count from there.

    Returns:
        The record, JSON-serialisable.
    """
    # A replica's wait for the run's progress (``progress.py``) trained nothing and
    # failed nobody's step: counted, then left out of every attempt's accounting.
    waits = [r for r in records if r.get("behind") is not None]
    records = [r for r in records if r.get("behind") is None]
    committed = [r for r in records if r["committed"]]
    digests: dict[int, set[str]] = defaultdict(set)
    for r in committed:
        if r.get("digest") is not None:  # per step: only the steps hashed (digest_every_steps)
            digests[r["step"]].add(r["digest"])
    committed_steps = max((res["step"] for res in results), default=0)
    kills = [f for f in faults if f["kind"] == "kill"]
    inferred = unreported_commits(
        records, kills, policy=global_batch, num_replicas=num_replicas, batch=batch_samples
    )
    samples = sample_accounting(
        records + inferred,
        committed_steps=committed_steps,
        num_replicas=num_replicas,
        batch=batch_samples,
        first_step=first_step,
    )
    samples["commits_inferred"] = len(inferred)
    final = next((res for res in results if res["step"] == steps), {})
    if mode == "periodic":
        # A period's share of the global batch holds for each of its inner steps; a commit
        # that a killed replica could not report covers its period's inner steps.
        span = {r["step"]: (r["first_step"], r["inner_steps"]) for r in records}
        for entry in inferred:
            entry["first_step"], entry["inner_steps"] = span[entry["step"]]
        samples = sample_accounting(
            period_samples(records + inferred),
            committed_steps=committed_steps,
            num_replicas=num_replicas,
            batch=batch_samples,
            first_step=first_step,
        )
        samples["commits_inferred"] = len(inferred)
    events = []
    for fault in faults:
        t = fault["t"]
        # The replica groups it hit: a kill's group, every group with a rank on a cut host.
        hit = set(fault.get("groups", [fault["replica"]]))
        survivors = [r for r in records if r["replica"] not in hit]
        # A killed replica rejoins from its restart on; a cut one once its link is back.
        back = t + fault.get("for_s", 0.0)
        rejoined = [r for r in committed if r["replica"] in hit and r["t"] > back]
        after = [r["step"] for r in survivors if r["t"] > t]
        # A replica killed before its new life joined a quorum held nobody up.
        joined = fault["kind"] != "kill" or any(
            r["replica"] in hit and r.get("life") == fault.get("life", r.get("life"))
            for r in records
        )
        events.append(
            {
                "kind": fault["kind"],
                "host": fault.get("host", fault["replica"]),
                "groups": sorted(hit),
                # A cut's: the survivors' step in flight when the link went down.
                "step": fault["step"] if "step" in fault else min(after, default=None),
                # Per-period mode: the period of the kill's inner step.
                "period": fault.get("period"),
                "phase": fault.get("phase"),
                "for_s": fault.get("for_s"),
                "t": t,
                "in_quorum": joined,
                "detect_s": _failed_after(survivors, t) if joined else None,
                "recover_s": _committed_after(survivors, t) if joined else None,
                "rejoin_s": min(r["t"] for r in rejoined) - t if rejoined else None,
                "rejoin_step": min(r["step"] for r in rejoined) if rejoined else None,
            }
        )
    per_replica = []
    for replica in range(num_replicas):
        mine = [r for r in records if r["replica"] == replica]
        finished = [res for res in results if res["replica"] == replica]  # a killed life: none
        per_replica.append(
            {
                "replica": replica,
                "lives": len({r["life"] for r in mine}),
                "committed": sum(r.get("inner_steps", 1) for r in mine if r["committed"]),
                "discarded": sum(_discarded_steps(r) for r in mine),
                "recovered": sum(r["healed"] for r in mine),
                # What its finished lives received from donors and served to joiners.
                "recovered_bytes": sum(res["recovered_bytes"] for res in finished),
                "served_bytes": sum(res["served_bytes"] for res in finished),
            }
        )
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in sorted(committed, key=lambda r: r["replica"]):
        # A late joiner's losses begin after the inner steps it skipped.
        first = r.get("first_step", r["step"]) + r.get("skipped_steps", 0)
        for i, loss in enumerate(r.get("losses", [r["loss"]])):
            by_step[first + i].append(loss)
    # The mean over the replica groups that committed each step (as torch DDP's record).
    losses = [statistics.fmean(by_step[step]) for step in sorted(by_step)]
    step_times = [r["t"] - r["t0"] for r in committed]
    final_digests = {res["digest"] for res in results if res["step"] == steps}
    finished_groups = {res["replica"] for res in results if res["step"] == steps}
    periods = {}
    if mode == "periodic":
        periods = {
            "committed_periods": max((res["periods"] for res in results), default=0),
            "discarded_periods": sum(not r["committed"] for r in records),
        }
    return {
        "mode": mode,
        "topology": topology,
        "num_replicas": num_replicas,
        "steps": steps,
        "first_step": first_step,
        "committed_steps": committed_steps,
        "discarded_steps": sum(_discarded_steps(r) for r in records),
        "progress_waits": len(waits),
        **periods,
        "global_batch": global_batch,
        # A batch is one replica group's slot of a step (``shrink``: its own samples).
        "batches_lost": samples["samples_lost"] // batch_samples
        if global_batch == "shrink"
        else None,
        **samples,
        "step_digests_agree": all(len(d) == 1 for d in digests.values()),
        "steps_compared": sum(len(d) > 0 for d in digests.values()),
        # Every replica group finished the last step, with the same parameters: a group that
        # never finished (killed and not restarted, or its last life failed) has no digest to
        # compare, and the others' agreeing says nothing about it.
        "replicas_finished": len(finished_groups),
        "replicas_agree": finished_groups == set(range(num_replicas)) and len(final_digests) == 1,
        "digest": next((res["digest"] for res in results if res["step"] == steps), None),
        "events": events,
        "restarts": len(restarts),
        "per_replica": per_replica,
        "recovered_bytes": sum(res["recovered_bytes"] for res in results),
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "step_time_s": statistics.median(step_times) if step_times else None,
        **(
            period_goodput(records, steps=committed_steps, first_step=first_step)
            if mode == "periodic"
            else goodput(records, steps=committed_steps, warmup=first_step + warmup)
        ),
        "eval_loss": final.get("eval_loss"),
        "eval_accuracy": final.get("eval_accuracy"),
        "wall_s": wall_s,
        "timeouts": dataclasses.asdict(timeouts),
        "records": records,
    }


def _discarded_steps(record: dict[str, Any]) -> int:
    """The steps of training an attempt threw away: none if it committed or kept them for its
    retry (per-period mode: a failed exchange keeps its period's inner steps); else those it
    trained (a period's attempt that failed before training, at its quorum, trained none; a
    per-step attempt trained its one step)."""
    if record["committed"] or record.get("kept"):
        return 0
    return int(record.get("trained_steps", record.get("inner_steps", 1)))
