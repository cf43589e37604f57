"""Periodic kills and the global batch of a fault-tolerant run (``commfuse.ft.data``).

* ``commfuse train --fault-tolerant --chaos kill-every:...`` end to end (real lighthouse,
  real SIGKILLs, a restart that recovers from a peer) with ``--global-batch fixed``: every
  kill is an event with its detection and recovery times, the replicas agree at every step
  and at the end, and every sample of every committed step was trained exactly once;
* the same for DiLoCo (per-period mode): the survivors of a kill retry only the exchange of
  the period in flight and keep its inner steps, the quorum of each period splits every
  inner step's global batch, a committed inner step trains no sample twice, and only a
  killed replica's share of the period it died in is lost (and the inner steps a late joiner
  skipped); the run has a goodput in inner steps and a held-out loss;
* the fixed global batch's shares, scaled, give exactly the gradient of the whole batch;
* the sample accounting counts duplicates and losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.ft.data import global_batch_slice, loss_scale, sample_range
from commfuse.ft.goodput import sample_accounting, unreported_commits
from commfuse.workloads import CharLMConfig, make_workload

WORKLOAD = CharLMConfig(dim=32, layers=2, heads=2, seq=16, batch=4)
SPEC = "charlm:dim=32,layers=2,heads=2,seq=16,batch=4"
STEPS = 450
DILOCO_STEPS, H = 400, 5


def chaos_seed() -> int:
    """The seed of ``kill-every``'s draw of hosts: ``COMMFUSE_CHAOS_SEED`` replays a failed
    run's, else a fresh one. The kills come on a clock, so every run meets the steps at other
    points anyway: the seed and the events a failure prints say which."""
    seed = os.environ.get("COMMFUSE_CHAOS_SEED")
    return int(seed) if seed else random.randrange(1 << 16)


def kill_every_command(out: Path, seed: int, *, diloco: bool) -> list[str]:
    """``commfuse train`` on three hosts under ``kill-every`` with the fixed global batch,
    per step (``--digest-every-steps 1``) or DiLoCo (``H``), writing its record to ``out``."""
    command = [
        sys.executable, "-m", "commfuse.cli", "train", "--workload", SPEC, "--hosts", "3",
        "--link", "1gbit", "--fault-tolerant", "--ft-timeout", "1", "--min-replicas", "2",
        "--global-batch", "fixed", "--chaos",
        f"kill-every:every_s=3,restart_after_s=0.5,seed={seed}", "--json", str(out),
    ]  # fmt: skip
    if not diloco:
        return [
            *command, "--steps", str(STEPS), "--digest-every-steps", "1",
            # Host 2 is cut off from the start, for twice what the first quorum waits for it: it
            # joins by recovery in its first life, before any backward of its own.
            "--chaos", "cut:host=2,at_s=0,for_s=2",
        ]  # fmt: skip
    return [
        *command, "--steps", str(DILOCO_STEPS), "--strategy", f"diloco:H={H}",
        # A kill every 3 s may land between two exchanges, where the next quorum just leaves
        # the replica out; this one lands inside a period, so an exchange fails, and its victim
        # stays away for several periods, which its survivors start without it (back after
        # 0.5 s it could make the very next period's quorum: no period would split the batch).
        "--chaos", "kill:host=1,at_step=22,restart_after_s=3",
    ]  # fmt: skip


def replay(seed: int, record: dict[str, Any] | None) -> str:
    """What a failed chaos run needs to be read and replayed: the seed and every fault."""
    events = [] if record is None else record["events"]
    lines = [f"kill-every seed {seed} (replay: COMMFUSE_CHAOS_SEED={seed}); faults:"]
    keys = ("kind", "host", "groups", "step", "period", "phase", "t", "in_quorum", "detect_s",
            "recover_s", "rejoin_step")  # fmt: skip
    lines += [str({k: e.get(k) for k in keys}) for e in events]
    return "\n".join(lines)


def run_chaos(tmp_path: Path, *, diloco: bool) -> tuple[int, dict[str, Any]]:
    """Run ``kill_every_command``; its seed and record (the command's output on a failure)."""
    seed, out = chaos_seed(), tmp_path / "run.json"
    command = kill_every_command(out, seed, diloco=diloco)
    done = subprocess.run(command, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, f"{replay(seed, None)}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return seed, json.loads(out.read_text())


@contextlib.contextmanager
def replayable(seed: int, record: dict[str, Any]) -> Iterator[None]:
    """Add the seed and the faults to a failed assertion's message."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{replay(seed, record)}") from None


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_every_from_the_command_line_loses_no_sample_with_a_fixed_global_batch(
    tmp_path: Path,
) -> None:
    seed, record = run_chaos(tmp_path, diloco=False)
    with replayable(seed, record):
        check_kill_every(record)


def assert_the_finishers_agree(record: dict[str, Any]) -> None:
    """Every replica group that finished the last step holds the same model (the last step is
    always among those ``step_digests_agree`` compares). All three finished, and
    ``replicas_agree`` says so, unless a kill's victim was still away when the others ended:
    kill-every's clock may land a kill in the run's last seconds."""
    assert record["step_digests_agree"]
    away = [e for e in record["events"] if e["kind"] == "kill" and e["rejoin_step"] is None]
    finished = record["replicas_finished"]
    assert record["replicas_agree"] or (away and finished >= 2), (finished, away)


def check_kill_every(record: dict[str, Any]) -> None:
    """What a per-step run under ``kill-every`` guarantees (docs/reliability.md)."""
    steps = STEPS
    kills = [e for e in record["events"] if e["kind"] == "kill"]
    assert kills, record["events"]
    assert any(e["in_quorum"] for e in kills), kills
    # A replica killed while it was still joining held nobody up (not in_quorum); one killed
    # between two exchanges and back within the heartbeat's timeout may fail no survivor's
    # step and shrink no quorum (no detect_s). Every other kill is noticed, then recovered from.
    # (The kills come on a clock, so a fast run meets only one or two, and may notice none:
    # tests/test_ft_*.py kill inside an allreduce, where the survivors always notice.)
    noticed = [e for e in kills if e["in_quorum"] and e["detect_s"] is not None]
    for event in noticed:
        assert event["recover_s"] is not None, event
        assert event["detect_s"] <= event["recover_s"], event
    assert record["restarts"] >= 1
    assert record["committed_steps"] == steps
    # Host 2 (cut off at the start) joined late by recovery, and agrees with the others from
    # its first step on: its DDP buckets were laid out as theirs before it joined.
    late = [r for r in record["records"] if r["replica"] == 2 and r["life"] == 0]
    if late:  # (unless a kill took it before it joined)
        first = min(late, key=lambda r: r["t"])
        assert first["healed"] and first["step"] > 0, first
    assert_the_finishers_agree(record)
    assert record["steps_compared"] == steps
    # A survivor of a kill trained more than its own slot: the fixed global batch at work.
    shares = {r["samples"][1] - r["samples"][0] for r in record["records"] if r["committed"]}
    assert shares > {WORKLOAD.batch}, shares
    # Exact data accounting: every sample of every committed step, once.
    total = steps * 3 * WORKLOAD.batch
    assert record["samples_trained"] == total
    assert record["samples_duplicated"] == 0 and record["samples_lost"] == 0
    # Shares in a committed sum without a committed report (goodput.unreported_commits): the
    # victim's, killed between its vote and its report, and those of the survivors whose ring
    # it broke after their part had left: at most all but one committer per kill.
    assert record["commits_inferred"] <= (3 - 1) * len(kills)
    assert record["goodput_steps_per_s"] > 0 and record["eval_loss"] is not None


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_diloco_under_kill_every_keeps_the_survivors_inner_steps_and_splits_the_batch(
    tmp_path: Path,
) -> None:
    seed, record = run_chaos(tmp_path, diloco=True)
    with replayable(seed, record):
        check_diloco(record)


def check_diloco(record: dict[str, Any]) -> None:
    """What a DiLoCo run under ``kill-every`` guarantees (docs/reliability.md)."""
    steps = DILOCO_STEPS
    assert record["mode"] == "periodic"
    assert record["committed_steps"] == steps and record["committed_periods"] == steps // H
    assert_the_finishers_agree(record)
    records = record["records"]
    failed = [r for r in records if not r["committed"]]
    assert any(e["in_quorum"] for e in record["events"]) and failed, record["events"]
    # A failed exchange kept its period's inner steps, and a retry trained none again (a
    # retry that failed too keeps them still); an attempt that failed before it trained (its
    # quorum's group could not be built) starts its period over.
    for r in failed:
        if r["retry"]:
            assert r["kept"] and r["trained_steps"] == 0, r
        else:
            # (a late joiner trained the period's steps after those it skipped)
            todo = r["inner_steps"] - r["skipped_steps"]
            assert r["trained_steps"] == (todo if r["kept"] else 0), r
    assert any(r["kept"] for r in failed), failed
    retried = {(r["replica"], r["step"]) for r in failed}
    joined_late = {
        _attempt(r): r["skipped_steps"] for r in records if r["healed"] and not r["retry"]
    }
    for r in records:
        if r["committed"]:
            # A late joiner skips the first inner steps of the period it joins, no more (and
            # the retry of that period's exchange keeps what it skipped).
            assert r["skipped_steps"] == 0 or joined_late.get(_attempt(r)) == r["skipped_steps"], r
            assert r["skipped_steps"] < r["inner_steps"], r
            todo = r["inner_steps"] - r["skipped_steps"]
            assert r["trained_steps"] == (0 if r["retry"] else todo), r
            # A retry follows this replica's failed exchange, or it joined for the retry.
            assert not r["retry"] or (r["replica"], r["step"]) in retried or r["healed"], r
    assert record["discarded_steps"] == 0
    # The quorum of a period splits the global batch: survivors of a kill train more.
    shares = {r["samples"][1] - r["samples"][0] for r in records if r["committed"] and r["samples"]}
    assert shares > {WORKLOAD.batch}, shares
    # No sample trained twice; every sample of a period whose exchange never failed was
    # trained; what is lost is only in periods whose exchange failed (a victim's share).
    assert record["samples_duplicated"] == 0
    total = steps * 3 * WORKLOAD.batch
    assert record["samples_trained"] + record["samples_lost"] == total
    covered: dict[int, int] = {}
    skipped = set()
    for r in records:
        if r["committed"] and r["samples"]:
            start, stop = r["samples"]
            trained = r["inner_steps"] - r["skipped_steps"]
            covered[r["step"]] = covered.get(r["step"], 0) + (stop - start) * trained
            if r["skipped_steps"]:
                skipped.add(r["step"])
    whole = 3 * WORKLOAD.batch * H
    # (A victim killed between its commit and its report trained its share unreported: the
    # record infers that commit. A kill the launcher timed may not know the victim's step:
    # then the period after the victim's last report is the one it may have left unreported.)
    unreported = {e["step"] - d for e in record["events"] for d in (0, 1) if e["step"]}
    for event in record["events"]:
        before = [
            r["step"]
            for r in records
            if r["replica"] in event.get("groups", ()) and r["life"] == event.get("life")
            and r["t"] <= event["t"]
        ]  # fmt: skip
        unreported |= {max(before) + 1} if event["kind"] == "kill" and before else set()
    short = {p for p, n in covered.items() if n != whole} - {s for _, s in retried}
    short -= unreported | skipped
    assert not short, [r for r in records if r["step"] in short] + record["events"]
    shortfall = sum(whole - n for n in covered.values())
    assert record["samples_lost"] == shortfall or record["commits_inferred"] > 0
    assert record["goodput_steps_per_s"] > 0 and record["eval_loss"] is not None


def _attempt(record: dict[str, Any]) -> tuple[int, int, int]:
    """The replica, life and period of an attempt."""
    return record["replica"], record["life"], record["step"]


def test_fixed_global_batch_shares_scaled_give_the_whole_batch_gradient() -> None:
    workload = make_workload(WORKLOAD, device=torch.device("cpu"))
    model = workload.build_model(0)
    num_replicas, batch, step = 4, WORKLOAD.batch, 7

    def gradient(data: torch.Tensor, scale: float) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (workload.loss(model, data) * scale).backward()  # type: ignore[no-untyped-call]
        return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    whole = torch.cat([workload.batch(step, r, num_replicas, seed=0) for r in range(num_replicas)])
    reference = gradient(whole, 1.0)
    participants = 3  # 16 samples over 3: shares of 5, 5 and 6
    ranges = [
        sample_range(
            "fixed", replica=0, participant=p, participants=participants,
            num_replicas=num_replicas, batch=batch,
        )
        for p in range(participants)
    ]  # fmt: skip
    assert [b - a for a, b in ranges] == [5, 5, 6]
    summed = [torch.zeros_like(g) for g in reference]
    for start, stop in ranges:
        data = global_batch_slice(
            workload, step, start, stop, num_replicas=num_replicas, batch=batch, seed=0
        )
        assert torch.equal(data, whole[start:stop])
        scale = loss_scale(start, stop, participants=participants, total=num_replicas * batch)
        for s, g in zip(summed, gradient(data, scale), strict=True):
            s += g / participants  # what the hook's mean over the quorum does
    for s, g in zip(summed, reference, strict=True):
        torch.testing.assert_close(s, g, rtol=1e-5, atol=1e-7)
    # shrink: each replica its own slot, whatever the quorum.
    assert sample_range(
        "shrink", replica=2, participant=0, participants=1, num_replicas=4, batch=4
    ) == (8, 12)


def test_sample_accounting_counts_lost_and_duplicated_samples() -> None:
    def attempt(step: int, samples: list[int], committed: bool = True) -> dict[str, object]:
        return {"step": step, "committed": committed, "samples": samples}

    records = [
        attempt(0, [0, 4]), attempt(0, [4, 8]),  # step 0: all 8
        attempt(1, [0, 4]), attempt(1, [4, 8], committed=False),  # step 1: half lost
        attempt(1, [2, 6]),  # ... and 2 trained twice
    ]  # fmt: skip
    counts = sample_accounting(records, committed_steps=2, num_replicas=2, batch=4)
    assert counts == {"samples_trained": 14, "samples_duplicated": 2, "samples_lost": 2}


def test_a_commit_that_a_killed_replica_could_not_report_is_inferred() -> None:
    def attempt(replica: int, step: int, samples: list[int], t: float) -> dict[str, object]:
        return {"replica": replica, "step": step, "committed": True, "samples": samples,
                "participants": 2, "t": t}  # fmt: skip

    # Replica 1 reported step 0, voted to commit step 1 and was killed before its report.
    records = [attempt(0, 0, [0, 4], 1.0), attempt(1, 0, [4, 8], 1.0), attempt(0, 1, [0, 4], 2.0)]
    kills = [{"kind": "kill", "replica": 1, "t": 2.1}]
    inferred = unreported_commits(records, kills, policy="fixed", num_replicas=2, batch=4)
    assert [(r["replica"], r["step"], r["samples"]) for r in inferred] == [(1, 1, [4, 8])]
    counts = sample_accounting(records + inferred, committed_steps=2, num_replicas=2, batch=4)
    assert counts["samples_lost"] == 0 and counts["samples_duplicated"] == 0
    # Killed before the vote (the step committed with one participant): nothing to infer.
    alone = [*records[:2], {**records[2], "participants": 1, "samples": [0, 8]}]
    assert unreported_commits(alone, kills, policy="fixed", num_replicas=2, batch=4) == []


def test_a_share_that_reached_a_commit_of_its_quorum_counts_as_trained() -> None:
    def attempt(
        replica: int, step: int, samples: list[int], quorum: int, t: float, committed: bool = True
    ) -> dict[str, object]:
        return {"replica": replica, "step": step, "committed": committed, "samples": samples,
                "participants": 3, "quorum": [quorum, 0], "t": t}  # fmt: skip

    # Step 1 of quorum 5: replica 0 is killed when the ring has finished on replica 1 (which
    # commits) and not on replica 2 (which fails, its part already in replica 1's sum).
    records = [attempt(r, 0, [4 * r, 4 * r + 4], 5, 1.0) for r in range(3)]
    records += [attempt(1, 1, [4, 8], 5, 2.0), attempt(2, 1, [8, 12], 5, 2.1, committed=False)]
    kills = [{"kind": "kill", "replica": 0, "t": 2.05}]
    inferred = unreported_commits(records, kills, policy="fixed", num_replicas=3, batch=4)
    assert sorted((r["replica"], r["step"], r["samples"]) for r in inferred) == [
        (0, 1, [0, 4]), (2, 1, [8, 12])
    ]  # fmt: skip
    counts = sample_accounting(records + inferred, committed_steps=2, num_replicas=3, batch=4)
    assert counts == {"samples_trained": 24, "samples_duplicated": 0, "samples_lost": 0}
    # The same failure in another quorum than the commit's (every member failed in quorum 5,
    # the survivors committed step 1 in quorum 6): nothing of quorum 5 reached a sum.
    other = [*records[:3], attempt(1, 1, [4, 8], 5, 2.0, committed=False), records[4]]
    other += [attempt(1, 1, [0, 6], 6, 3.0) | {"participants": 2}]
    other += [attempt(2, 1, [6, 12], 6, 3.0) | {"participants": 2}]
    assert unreported_commits(other, kills, policy="fixed", num_replicas=3, batch=4) == []
    # shrink: the failed member's own slot.
    inferred = unreported_commits(records, kills, policy="shrink", num_replicas=3, batch=4)
    assert sorted((r["replica"], r["samples"]) for r in inferred) == [(0, [0, 4]), (2, [8, 12])]
    # Per period: a late joiner's failed share covers the inner steps it did not skip.
    late = [*records[:4], records[4] | {"skipped_steps": 3}]
    inferred = unreported_commits(late, [], policy="fixed", num_replicas=3, batch=4)
    assert [(r["replica"], r.get("skipped_steps")) for r in inferred] == [(2, 3)]
