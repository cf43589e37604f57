"""The fault-tolerant run's record from reports built by hand (no processes, no torchft).

* each replica group's ``recovered_bytes`` and ``served_bytes`` are what its own finished
  lives received and served, not the run's total (two replica groups of two lives each, both
  recovering and serving);
* a replica killed after a failed try at step s, whose retry of s the survivors committed
  with it in the quorum, trained step s, not s + 1 (``unreported_commits``);
* a replica killed after its commit of s and before any report of s + 1 trained s + 1;
* replicas agree only when every replica group finished the last step with the same digest:
  one that never finished (killed, not restarted) has nothing to agree with.
"""

from __future__ import annotations

from typing import Any

from commfuse.ft.accounting import summarize_ft
from commfuse.ft.config import Timeouts
from commfuse.ft.goodput import sample_accounting, unreported_commits

BATCH = 4


def attempt(
    replica: int,
    life: int,
    step: int,
    t: float,
    *,
    committed: bool = True,
    participants: int = 2,
    healed: bool = False,
    quorum: int | None = None,
) -> dict[str, Any]:
    """One attempt's report (``replica.py``'s "step"), ``shrink``'s samples."""
    return {
        "replica": replica,
        "life": life,
        "step": step,
        "committed": committed,
        "participants": participants,
        "healed": healed,
        "quorum": None if quorum is None else [quorum, 0],
        "samples": [replica * BATCH, (replica + 1) * BATCH],
        "loss": 1.0,
        "t0": t - 0.5,
        "t_quorum": t - 0.4,
        "t": t,
        "digest": "d" if committed else None,
    }


def test_each_replica_counts_the_bytes_of_its_own_lives() -> None:
    # Replica 0 is killed at t=2.5 and its second life recovers from replica 1; then replica 1
    # is killed at t=6.5 and its second life recovers from replica 0. Both recover and serve.
    records = [attempt(r, 0, s, 1.0 + s) for s in range(2) for r in range(2)]
    records += [attempt(1, 0, 2, 3.0, participants=1)]
    records += [attempt(0, 1, s, 1.0 + s, healed=s == 3) for s in range(3, 6)]
    records += [attempt(1, 0, s, 1.0 + s) for s in range(3, 6)]
    records += [attempt(0, 1, 6, 7.0, participants=1)]
    records += [attempt(1, 1, s, 1.0 + s, healed=s == 7) for s in range(7, 10)]
    records += [attempt(0, 1, s, 1.0 + s) for s in range(7, 10)]
    faults = [
        {"kind": "kill", "replica": 0, "life": 0, "t": 2.5, "step": 2},
        {"kind": "kill", "replica": 1, "life": 0, "t": 6.5, "step": 6},
    ]
    # Only the lives that finished report; a killed life's bytes are lost with it.
    results = [
        {"replica": 0, "life": 1, "step": 10, "digest": "d", "recovered_bytes": 1000,
         "served_bytes": 30},
        {"replica": 1, "life": 1, "step": 10, "digest": "d", "recovered_bytes": 200,
         "served_bytes": 7},
    ]  # fmt: skip
    record = summarize_ft(
        records=records,
        faults=faults,
        restarts=[{"replica": 0, "t": 2.6}, {"replica": 1, "t": 6.6}],
        results=results,
        num_replicas=2,
        steps=10,
        batch_samples=BATCH,
        wall_s=11.0,
        topology="2 hosts",
        timeouts=Timeouts.derive(1.0),
    )
    per_replica = [
        (r["replica"], r["lives"], r["recovered"], r["recovered_bytes"], r["served_bytes"])
        for r in record["per_replica"]
    ]
    assert per_replica == [(0, 2, 1, 1000, 30), (1, 2, 1, 200, 7)]
    assert record["recovered_bytes"] == 1200
    assert record["committed_steps"] == 10 and record["replicas_agree"]


def test_a_replica_killed_after_a_failed_try_trained_the_retried_step() -> None:
    # Step 1's first try (quorum 5) failed on both replicas; the retry (quorum 6) committed on
    # replica 0 with both in the quorum, and replica 1 was killed after its vote and before
    # its report. Its last report is the failed try of step 1, so the commit it could not
    # report is of step 1. Replica 0 then commits step 2 alone.
    records = [attempt(r, 0, 0, 1.0) for r in range(2)]
    records += [attempt(r, 0, 1, 2.0, committed=False, quorum=5) for r in range(2)]
    records += [attempt(0, 0, 1, 3.0, quorum=6)]
    records += [attempt(0, 0, 2, 4.0, participants=1, quorum=7)]
    kills = [{"kind": "kill", "replica": 1, "life": 0, "t": 3.05}]
    inferred = unreported_commits(records, kills, policy="shrink", num_replicas=2, batch=BATCH)
    assert [(r["replica"], r["step"], r["samples"]) for r in inferred] == [(1, 1, [4, 8])]
    counts = sample_accounting(records + inferred, committed_steps=3, num_replicas=2, batch=BATCH)
    # Step 2: replica 1's slot lost (it was dead), nothing else.
    assert counts == {"samples_trained": 20, "samples_duplicated": 0, "samples_lost": 4}


def test_a_replica_killed_after_its_commit_trained_the_next_step() -> None:
    # Replica 1 committed step 0, voted to commit step 1 (quorum of 2) and was killed before
    # its report.
    records = [attempt(r, 0, 0, 1.0) for r in range(2)] + [attempt(0, 0, 1, 2.0)]
    kills = [{"kind": "kill", "replica": 1, "life": 0, "t": 2.05}]
    inferred = unreported_commits(records, kills, policy="shrink", num_replicas=2, batch=BATCH)
    assert [(r["replica"], r["step"], r["samples"]) for r in inferred] == [(1, 1, [4, 8])]


def test_replicas_do_not_agree_when_one_never_finished() -> None:
    # Replica 1 is killed at t=2.5 and never restarted: only replica 0 finishes, alone, at
    # step 5. One final digest is not agreement (as a replica stopped by a loaded machine
    # until the others had finished once made it look).
    records = [attempt(r, 0, s, 1.0 + s) for s in range(2) for r in range(2)]
    records += [attempt(0, 0, s, 1.0 + s, participants=1) for s in range(2, 5)]
    results = [
        {"replica": 0, "life": 0, "step": 5, "digest": "d", "recovered_bytes": 0, "served_bytes": 0}
    ]

    def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
        return summarize_ft(
            records=records,
            faults=[{"kind": "kill", "replica": 1, "life": 0, "t": 2.5, "step": 2}],
            restarts=[],
            results=results,
            num_replicas=2,
            steps=5,
            batch_samples=BATCH,
            wall_s=6.0,
            topology="2 hosts",
            timeouts=Timeouts.derive(1.0),
        )

    record = summary(results)
    assert record["committed_steps"] == 5 and record["step_digests_agree"]
    assert record["replicas_finished"] == 1 and not record["replicas_agree"]
    # Both finished: they agree when their digests are equal, and only then.
    other = {**results[0], "replica": 1}
    assert summary([*results, other])["replicas_agree"]
    assert not summary([*results, {**other, "digest": "e"}])["replicas_agree"]
    # A replica that finished short of the last step did not finish the run.
    assert not summary([*results, {**other, "step": 4}])["replicas_agree"]
