"""Restarted replicas never train from behind the progress a live replica holds.

torchft's lighthouse forms a quorum of whoever asks, and the quorum's step is the highest its
members hold. Two replicas restarted from nothing can therefore meet while the one replica
holding the run's progress is held out (its link down, or stuck in a collective with a dead
peer): their quorum's step is 0, and they would train the run's first steps again. When the
held-out replica comes back, the quorum takes whichever side is ahead and the other side's
steps are thrown away, progress or repeated samples.

The scenario, on the emulated network: replicas 0 and 1 are killed at step 10 and restarted
after 2.5 s; replica 2 trains on alone, then its link goes down for 6 s, and the two restarted
replicas meet without it. They must wait for it (the launcher tells each restarted life the
highest step a live replica has committed), then recover its state and go on from its step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from commfuse.cluster import Topology
from commfuse.ft import CutFault, FaultToleranceConfig, KillFault, run_fault_tolerant
from commfuse.train.loop import TrainConfig
from commfuse.workloads import CharLMConfig

WORKLOAD = CharLMConfig(dim=32, layers=2, heads=2, seq=16, batch=4)


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["per-step", "per-period", "per-step-groups"])
def test_restarted_replicas_wait_for_the_progress_a_cut_off_replica_holds(mode: str) -> None:
    from commfuse.localsgd import diloco

    kills = tuple(
        KillFault(host=h, at_step=10, phase="compute", restart_after_s=2.5) for h in (0, 1)
    )
    cut = CutFault(host=2, at_s=2.0, for_s=6.0)
    steps = 1000  # replica 2 alone must not finish before its link goes down
    config = TrainConfig(workload=WORKLOAD, steps=steps, evaluate=False)
    if mode == "per-period":  # a record's step is then the period (an exchange every 10 steps)
        config = dataclasses.replace(config, strategy=diloco(H=10))
    # Replica groups of two ranks, one group to a host: a group's ranks wait as one.
    groups = mode.endswith("groups")
    record = run_fault_tolerant(
        config,
        FaultToleranceConfig(
            faults=(*kills, cut), min_replicas=1, timeout_s=1.0,
            num_replica_groups=3 if groups else None,
        ),
        Topology(num_hosts=3, ranks_per_host=2 if groups else 1, link_mbit=1000),
        timeout_s=200,
    )  # fmt: skip
    records: list[dict[str, Any]] = record["records"]
    (cut_event,) = [e for e in record["events"] if e["kind"] == "cut"]
    # What replica 2 held when its link went down: its committed steps by then.
    held = 1 + max(
        r["step"]
        for r in records
        if r["replica"] == 2 and r["committed"] and r["t"] <= cut_event["t"]
    )
    assert held > (10 if mode == "per-step" else 1), held  # it trained on alone after the kills
    restarted = [r for r in records if r["life"] >= 1 and r["committed"]]
    assert restarted, "the restarted replicas never committed a step"
    # No restarted replica trained a step that the cut-off replica already held.
    assert min(r["step"] for r in restarted) >= held, sorted(r["step"] for r in restarted)[:5]
    # They waited, and said so, instead of training from step 0.
    assert record["progress_waits"] > 0
    assert record["samples_duplicated"] == 0
    assert record["committed_steps"] == steps and record["replicas_agree"]


def _life(replica: int, life: int) -> tuple[Any, Any]:
    """A launcher's entry for one life and the replica's end of its pipe (no process: the
    supervisor's floor bookkeeping reads only the entry and writes only the pipe)."""
    from multiprocessing import Pipe

    from commfuse.ft.launch import _Life

    ours, theirs = Pipe(duplex=True)
    return _Life(replica=replica, life=life, proc=None, conn=ours, log=""), theirs  # type: ignore[arg-type]


def _supervisor(*lives: Any) -> Any:
    """The launcher's loop over ``lives``, after the go of the run's first lives."""
    from commfuse.ft.config import FaultToleranceConfig
    from commfuse.ft.launch import GroupLayout, _Job, _Supervisor

    job = _Job()
    job.lives = list(lives)
    supervisor = _Supervisor(
        job=job, ft=FaultToleranceConfig(), num=3, spares={}, start=lambda r, lf: [],
        lab=None, layout=GroupLayout(group_size=1, ranks_per_host=1),
    )  # fmt: skip
    supervisor.went = True
    return supervisor


def test_a_waiting_replica_hears_the_floor_fall_when_the_replica_holding_it_dies() -> None:
    from commfuse.ft.progress import read_floor

    holder, _ = _life(2, 0)  # committed 265 steps, then was cut off
    other, _ = _life(1, 0)  # committed 40 steps, alive
    fresh, fresh_end = _life(0, 1)  # restarted while the holder was cut off
    supervisor = _supervisor(holder, other, fresh)
    holder.going = other.going = True  # told to go at the start
    for life, step in ((holder, 264), (other, 39)):
        supervisor._message(life, "step", {"step": step, "committed": True}, now=0.0)
    supervisor._message(fresh, "ready", {}, now=0.0)
    assert fresh_end.recv_bytes() == b"go"
    assert read_floor(fresh_end, wait=True) == 265
    supervisor._update_floors()  # nothing changed: nothing sent
    assert not fresh_end.poll(0)
    assert supervisor.told == {(0, 1): 265, (1, 0): 265}  # the other one is behind too
    holder.exited = True  # it died before it came back: its 265 steps are gone
    supervisor._update_floors()
    assert read_floor(fresh_end) == 40  # the most a live replica holds
    other.killed_at = 1.0
    supervisor._update_floors()
    assert read_floor(fresh_end) == 0  # nobody alive is ahead of it: it trains
    supervisor._message(fresh, "step", {"step": 0, "committed": True}, now=2.0)
    supervisor._update_floors()
    assert supervisor.told == {}  # it reached its floor: no more messages


def test_a_replica_that_missed_steps_hears_the_floor_and_one_in_step_does_not() -> None:
    from commfuse.ft.launch import FLOOR_LAG
    from commfuse.ft.progress import read_floor

    ahead, _ = _life(0, 0)
    in_step, in_step_end = _life(1, 0)
    cut_off, cut_off_end = _life(2, 0)
    supervisor = _supervisor(ahead, in_step, cut_off)
    for life in (ahead, in_step, cut_off):
        supervisor._go(life)
    for end in (in_step_end, cut_off_end):
        assert end.recv_bytes() == b"go" and read_floor(end, wait=True) == 0

    def commit(life: Any, step: int) -> None:
        supervisor._message(life, "step", {"step": step, "committed": True}, now=0.0)
        supervisor._update_floors()

    # In one quorum the reports of a step arrive one after another: one step apart at most.
    for step in range(5):
        commit(ahead, step)
        commit(in_step, step)
        commit(cut_off, step)
    assert not in_step_end.poll(0) and not cut_off_end.poll(0)
    # The cut-off replica misses steps the others commit: once it is FLOOR_LAG behind, it is
    # told the floor, once.
    for step in range(5, 5 + FLOOR_LAG + 2):
        commit(ahead, step)
        commit(in_step, step)
    assert read_floor(cut_off_end) == 5 + FLOOR_LAG
    assert not in_step_end.poll(0) and not cut_off_end.poll(0)
    # It recovers the others' state and commits their step: it needs the floor no more.
    commit(cut_off, 5 + FLOOR_LAG + 1)
    assert supervisor.told == {} and not cut_off_end.poll(0)


def test_the_run_summary_says_how_often_a_replica_waited_for_the_progress() -> None:
    from commfuse.cli.train_ft import describe_ft_record

    record = {
        "committed_steps": 1000, "steps": 1000, "discarded_steps": 0, "samples_lost": 0,
        "final_loss": 2.5, "wall_s": 20.0, "step_digests_agree": True, "events": [],
    }  # fmt: skip
    assert "waited" not in describe_ft_record(record)
    assert "56 attempts waited" in describe_ft_record({**record, "progress_waits": 56})
