"""Fault-tolerant data parallelism on torchft (``commfuse.ft``), on the emulated cluster.

The end-to-end runs use the real torchft lighthouse and Managers, real processes, one emulated
host per replica group, and a real SIGKILL:

* a replica killed while its gradient allreduce is in flight: the survivors commit nothing
  for that step, commit again within 3 s (the default ``timeout_s`` of 2 s), and hold
  bit-identical parameters at every later step; the killed replica restarts, receives its
  state from a peer (checksummed), and its parameter digest equals the others' at every step
  it commits; each committed step moved exactly one gradient's bytes per replica. Four
  replicas put one survivor out of the victim's reach in gloo's ring (it waits on a live
  neighbour that gave up), which only the quorum-wide alarm frees before gloo's timeout;
* the same with PowerSGD and error feedback: the replicas agree at every step, the joiner
  receives PowerSGD's factors but not the donor's residuals (its own unsent gradient, which
  the joiner would send again), and every committed step sent exactly PowerSGD's message;
* a host's link cut for 1 s (shorter than the timeouts) while another host is slowed to
  50 Mbit/s: the job finishes, the survivors lose nothing, the replicas agree, and the
  record's data loss is exactly the steps the cut host missed;
* a run without faults equals the same run on torch DDP without torchft, bit for bit;
* ``--init-from`` and replica groups of several ranks: ``tests/test_ft_groups.py``;
* per-period mode (DiLoCo with SparseLoCo's compressed outer exchange, four replicas): one
  replica SIGKILLed while its outer exchange is in flight, another between two inner steps;
  the survivors' exchange of that period fails, and they retry only the exchange with the
  quorum of the survivors (no forward or backward pass: the period's inner steps are kept; a
  victim restarted at once waits for the next period, no state crosses during the retry)
  and go on, every
  replica holds the same outer model and outer momenta at every committed period, the joiner
  holds exactly what its donor served (model, anchors, inner and outer optimizer, error
  feedback, counters, random state; none of them fresh), every committed period sent exactly
  SparseLoCo's message, and the record's data loss is exactly the periods the victims missed;
* a fault-free per-period run (DiLoCo, ending in a partial period with its final
  synchronisation) equals the same run without torchft, loss by loss and bit by bit;
* the launcher SIGKILLed mid-run takes its replicas, its lighthouse (in its process) and the
  emulated network with it (a replica also stops by itself at its next report to the dead
  launcher; the watchdog kills one blocked in a collective, and removes the network).

The rest is cheap: a renewed gloo group of the same quorum (after a failed period) is fresh,
its alarm down; the timeouts' derivation, the state transport's checksums, where the
lighthouse and the transport listen, and that ``import commfuse.ft`` does not import torchft.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import commfuse
from commfuse.cluster import Topology
from commfuse.ft import (
    CutFault,
    FaultToleranceConfig,
    KillEveryFault,
    KillFault,
    SlowFault,
    Timeouts,
    run_fault_tolerant,
)
from commfuse.train import CosineSchedule, StepSchedule
from commfuse.train.loop import TrainConfig
from commfuse.workloads import CharLMConfig

WORKLOAD = CharLMConfig(dim=32, layers=2, heads=2, seq=16, batch=4)
#: Buckets of 10 KB: the model's gradient travels in several allreduces.
BUCKET_CAP_MB = 0.01
RECOVER_BOUND_S = 3.0


#: The fault-free comparisons: every quorum must hold both replica groups. With
#: ``min_replicas=1`` the lighthouse forms a quorum of one when the other replica's heartbeat
#: lapsed (a replica starved past ``timeout_s`` by a loaded machine), and the survivor trains
#: those steps on its own gradient alone: by design for fault tolerance, a different run for a
#: bit-for-bit comparison. Every per-step digest is reported.
FAULT_FREE = FaultToleranceConfig(min_replicas=2, digest_every_steps=1)


@contextlib.contextmanager
def _stalled_at_go(
    monkeypatch: pytest.MonkeyPatch, *, replica: int, for_s: float
) -> Iterator[None]:
    """Stop (SIGSTOP) replica group ``replica``'s first life the moment the launcher tells it
    to go, and let it continue (SIGCONT) ``for_s`` later: what a loaded machine that starves
    a process does, on purpose. (The seam is the launcher's ``_Supervisor._go``; a replica
    process leads its own process group.)"""
    from commfuse.ft import launch

    go = launch._Supervisor._go
    timers: list[threading.Timer] = []

    def signal_group(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)

    def stalled(self: Any, life: Any) -> None:
        go(self, life)
        if life.replica == replica and life.life == 0:
            signal_group(life.proc.pid, signal.SIGSTOP)
            timer = threading.Timer(for_s, signal_group, (life.proc.pid, signal.SIGCONT))
            timer.start()
            timers.append(timer)

    monkeypatch.setattr(launch._Supervisor, "_go", stalled)
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()
            timer.function(*timer.args)  # never leave a replica stopped


def _assert_same_bits(ft: dict[str, Any], plain: dict[str, Any]) -> None:
    """The fault-tolerant run ended with the plain run's bits, both replica groups finished,
    and every step was committed by both; else say where the runs part
    (``commfuse.testing.bits``)."""
    from commfuse.testing.bits import RunBits, parting

    report = parting(RunBits.of_ft(ft), RunBits.of_plain(plain))
    assert report is None, report
    finished = {replica for replica, _, _, _ in ft["rank_digests"]}
    assert finished == {0, 1} and ft["replicas_agree"], ft["rank_digests"]
    quorums = {(r["step"], r["participants"]) for r in ft["records"] if r["committed"]}
    assert all(size == 2 for _, size in quorums), sorted(quorums)


def _param_bytes() -> int:
    from commfuse.workloads import make_workload

    model = make_workload(WORKLOAD, device=torch.device("cpu")).build_model(0)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_in_allreduce_survivors_continue_and_the_restarted_replica_catches_up() -> None:
    # The restart comes after the survivors went on without the victim (2 s), and the run is
    # long enough for it to rejoin.
    kill = KillFault(host=2, at_step=5, phase="allreduce", restart_after_s=3.5)
    steps = 250
    record = run_fault_tolerant(
        TrainConfig(
            workload=WORKLOAD,
            steps=steps,
            evaluate=False,
            bucket_cap_mb=BUCKET_CAP_MB,
            # The restarted replica takes the rate of the step it rejoins at, not its donor's.
            lr_schedule=StepSchedule(every_steps=50, gamma=0.5),
        ),
        FaultToleranceConfig(faults=(kill,), min_replicas=2, digest_every_steps=1),
        Topology(num_hosts=4, link_mbit=1000),
        timeout_s=200,
    )
    records: list[dict[str, Any]] = record["records"]
    (event,) = record["events"]
    assert (event["host"], event["step"], event["phase"]) == (2, 5, "allreduce")
    kill_t = event["t"]
    survivors = [r for r in records if r["replica"] != 2]
    # The step in flight at the kill committed nowhere: every survivor's first attempt failed.
    first_tries: dict[int, dict[str, Any]] = {}
    for r in sorted(survivors, key=lambda r: r["t"]):
        if r["step"] == 5:
            first_tries.setdefault(r["replica"], r)
    assert all(not r["committed"] for r in first_tries.values()), first_tries
    assert len(first_tries) == 3
    # ... and every survivor committed it again, within the bound.
    assert event["recover_s"] is not None and event["recover_s"] <= RECOVER_BOUND_S, event
    for replica in (0, 1, 3):
        (again,) = [
            r for r in survivors if r["replica"] == replica and r["committed"] and r["step"] == 5
        ]
        assert again["t"] - kill_t <= RECOVER_BOUND_S + 0.5
        assert again["participants"] == 3  # without the victim
    # The killed replica came back, recovered from a peer, and agrees at every step it commits.
    rejoined = [r for r in records if r["replica"] == 2 and r["life"] == 1]
    assert rejoined and rejoined[0]["healed"], rejoined[:1]
    assert record["recovered_bytes"] > _param_bytes()
    by_step: dict[int, set[str]] = {}
    for r in records:
        if r["committed"]:
            by_step.setdefault(r["step"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in by_step.values()), by_step
    assert sorted(by_step) == list(range(steps))
    assert event["rejoin_step"] > 5
    rejoined_steps = {r["step"] for r in rejoined if r["committed"]}
    assert rejoined_steps == set(range(event["rejoin_step"], steps))
    assert record["step_digests_agree"] and record["replicas_agree"]
    assert record["steps_compared"] == steps
    assert record["committed_steps"] == steps
    assert record["discarded_steps"] == 3  # the three survivors' failed step 5
    # What was communicated: each committed attempt allreduced the whole gradient once.
    assert {r["bytes"] for r in records if r["committed"]} == {_param_bytes()}
    # Data: the killed replica's batches of the steps it missed are the only ones lost. The step
    # it healed at may be lost too: an attempt whose quorum does not count the replica as
    # participating (torchft's participating rank None) commits without training samples, and
    # one run here lost one batch more than the missed steps (its records were not kept).
    trained = {
        (r["replica"], r["step"]) for r in records if r["committed"] and r["samples"] is not None
    }
    lost = {(replica, step) for replica in range(4) for step in range(steps)} - trained
    why = {
        "lost": sorted(lost),
        "progress_waits": record["progress_waits"],
        "uncommitted": [
            (r["replica"], r["life"], r["step"], r["error"]) for r in records if not r["committed"]
        ],
        "healed": [(r["step"], r["samples"]) for r in rejoined if r["healed"]],
    }
    assert {(2, step) for step in range(5, event["rejoin_step"])} <= lost, why
    assert lost <= {(2, step) for step in range(5, event["rejoin_step"] + 1)}, why
    assert record["batches_lost"] == len(lost), why
    assert record["samples_lost"] == len(lost) * WORKLOAD.batch


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compressed_replicas_agree_through_a_kill_and_the_joiner_keeps_its_own_residuals() -> None:
    from commfuse.compress import PowerSGD
    from commfuse.train.strategy import CommfuseDPConfig

    compressor = PowerSGD(rank=2, ef=True, warmup=2)
    kill = KillFault(host=1, at_step=4, restart_after_s=0.5)
    record = run_fault_tolerant(
        TrainConfig(
            workload=WORKLOAD,
            strategy=CommfuseDPConfig(compressor=compressor),
            steps=10,
            evaluate=False,
        ),
        FaultToleranceConfig(faults=(kill,), min_replicas=2, digest_every_steps=1),
        Topology(num_hosts=3, link_mbit=1000),
        timeout_s=200,
    )
    records: list[dict[str, Any]] = record["records"]
    # Every replica applies the same bits: gloo's all-reduce leaves one sum on every replica.
    assert record["step_digests_agree"] and record["replicas_agree"], record["per_replica"]
    assert record["steps_compared"] == 10
    assert record["committed_steps"] == 10 and record["discarded_steps"] == 2
    rejoined = [r for r in records if r["replica"] == 1 and r["life"] == 1]
    assert rejoined and rejoined[0]["healed"] and rejoined[0]["committed"]
    # The joiner received the model and AdamW's two moments (fp32 each), checksummed tensor
    # by tensor, with PowerSGD's Q factors, but not the donor's error-feedback residuals (one
    # more fp32 per parameter): those are the donor's unsent gradient, which the joiner would
    # send a second time. A restarted joiner starts from zero residuals. (The joiner's own
    # bytes: a first life slow to ask for the first quorum heals from its peers too.)
    joiner = record["per_replica"][1]
    assert 3 * _param_bytes() < joiner["recovered_bytes"] < 4 * _param_bytes(), joiner
    assert record["recovered_bytes"] >= joiner["recovered_bytes"]
    # What was communicated, per committed step: the whole gradient during the warm-up, then
    # PowerSGD's message of every parameter (compressor.payload_bytes, parameter by parameter).
    compressed = _powersgd_payload(compressor)
    for r in (r for r in records if r["committed"]):
        assert r["bytes"] == (_param_bytes() if r["step"] < 2 else compressed), r


def _powersgd_payload(compressor: Any) -> int:
    from commfuse.compress.layout import BucketLayout
    from commfuse.workloads import make_workload

    model = make_workload(WORKLOAD, device=torch.device("cpu")).build_model(0)
    total = 0
    for i, (name, p) in enumerate(model.named_parameters()):
        compressor.set_layout(i, BucketLayout(names=(name,), shapes=(p.shape,)))
        total += compressor.payload_bytes(p.numel(), p.dtype, 3, bucket=i)
    assert 0 < total < _param_bytes() // 4
    return int(total)


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_cut_link_and_a_slow_host_cost_the_survivors_nothing() -> None:
    # Early in a run long enough (at least a second of steps) for the cut to land inside it.
    cut = CutFault(host=1, at_s=0.2, for_s=1.0)
    slow = SlowFault(host=2, link_mbit=50)  # a straggler from the start, on top
    steps = 150
    record = run_fault_tolerant(
        TrainConfig(workload=WORKLOAD, steps=steps, evaluate=False),
        FaultToleranceConfig(faults=(cut, slow), min_replicas=2, digest_every_steps=1),
        Topology(num_hosts=3, link_mbit=1000),
        timeout_s=200,
    )
    slowed, event = sorted(record["events"], key=lambda e: e["t"])
    assert (slowed["kind"], slowed["host"]) == ("slow", 2)
    assert event["kind"] == "cut" and event["host"] == 1 and event["step"] is not None
    # Down 1 s, less than the lighthouse's 2 s and gloo's 10 s: TCP delivers what was held up
    # once the link is back, and the step in flight completes. But the cut host's quorum
    # request may come back later than the lighthouse waits for stragglers (TCP backs off):
    # then the others go on without it for a step or two, and it rejoins by recovery. Either
    # way the survivors lose nothing, and the record's loss is exactly the cut host's.
    per = {p["replica"]: p for p in record["per_replica"]}
    assert per[0]["committed"] == per[2]["committed"] == steps
    lost = steps - per[1]["committed"]
    assert record["batches_lost"] == lost and record["samples_lost"] == lost * WORKLOAD.batch
    assert lost == 0 or per[1]["recovered"] >= 1
    assert event["recover_s"] is not None
    assert record["committed_steps"] == steps and record["step_digests_agree"]
    assert record["replicas_agree"]


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fault_free_run_equals_torch_ddp_bit_for_bit() -> None:
    """On a learning-rate schedule: each committed step takes the rate of its step."""
    from commfuse.train.runner import run_training

    config = TrainConfig(
        workload=WORKLOAD,
        steps=6,
        evaluate=False,
        bucket_cap_mb=BUCKET_CAP_MB,
        lr_schedule=StepSchedule(every_steps=2, gamma=0.5),
        param_fingerprints=True,
    )
    topology = Topology(num_hosts=2, link_mbit=1000)
    ft = run_fault_tolerant(config, FAULT_FREE, topology, timeout_s=200)
    plain = run_training(config, topology, progress=False, timeout_s=200)
    _assert_same_bits(ft, plain)
    assert ft["discarded_steps"] == 0 and ft["events"] == [] and ft["batches_lost"] == 0
    # The forward ran while the quorum was asked for, once per step: only the first step,
    # before any quorum, guessed its batch wrong.
    assert {r["step"] for r in ft["records"] if r["forward_again"]} == {0}
    records = sorted(ft["records"], key=lambda r: r["replica"])
    losses = [statistics.fmean(r["loss"] for r in records if r["step"] == s) for s in range(6)]
    # torch DDP's record smooths its loss curve; its per-step mean is the curve's first point.
    assert losses[0] == plain["loss_curve"][0]


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fault_free_powersgd_equals_the_run_without_torchft_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two replicas: a sum of two is the same in any order, so the quorum's all-reduce and the
    # engine's sum the same bits; what must also match is everything around them: the
    # warm-up in fp16, the factors, the error feedback, overlapped with backward or not.
    from commfuse.compress import PowerSGD
    from commfuse.train.runner import run_training
    from commfuse.train.strategy import CommfuseDPConfig

    compressor = PowerSGD(rank=2, warmup=2, warmup_fp16=True, wire="fp16", algo="native")
    config = TrainConfig(
        workload=WORKLOAD,
        strategy=CommfuseDPConfig(compressor=compressor),
        steps=6,
        evaluate=False,
        param_fingerprints=True,
    )
    topology = Topology(num_hosts=2, link_mbit=1000)
    # A loaded machine may starve a replica for longer than timeout_s (its heartbeat lapses)
    # just as the run starts; stopping one for that long makes it happen every time. The
    # other must wait for it, not train the first steps alone.
    with _stalled_at_go(monkeypatch, replica=1, for_s=2.5 * FAULT_FREE.timeout_s):
        ft = run_fault_tolerant(config, FAULT_FREE, topology, timeout_s=200)
    plain = run_training(config, topology, progress=False, timeout_s=200)
    assert ft["discarded_steps"] == 0
    _assert_same_bits(ft, plain)
    assert ft["losses"][0] == plain["loss_curve"][0]


#: DiLoCo's period in the per-period tests.
H = 4


def _sparseloco() -> Any:
    from commfuse.compress import SparseLoCo

    # Chunks small enough that the model is several of them.
    return SparseLoCo(chunk_numel=1024, num_kept_per_chunk=32)


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diloco_replicas_killed_in_the_exchange_and_between_inner_steps_rejoin_in_step() -> None:
    from commfuse.ft.periodic import state_digest
    from commfuse.localsgd import diloco

    compressor = _sparseloco()
    # Restarted at once: back before the survivors noticed its death (the lighthouse waits
    # for its heartbeat to expire), in time for their retry of the failed exchange.
    in_exchange = KillFault(host=2, at_step=9, phase="allreduce", restart_after_s=0.0)
    in_inner = KillFault(host=1, at_step=30, phase="compute", restart_after_s=0.5)
    steps = 64
    record = run_fault_tolerant(
        TrainConfig(
            workload=WORKLOAD,
            strategy=diloco(H=H, compressor=compressor),
            steps=steps,
            evaluate=False,
            lr_schedule=CosineSchedule(warmup_steps=4),
        ),
        FaultToleranceConfig(faults=(in_exchange, in_inner), min_replicas=2),
        Topology(num_hosts=4, link_mbit=1000),
        timeout_s=200,
    )
    records: list[dict[str, Any]] = record["records"]
    assert record["mode"] == "periodic" and record["committed_periods"] == steps // H
    events = sorted(record["events"], key=lambda e: e["t"])
    # The exchange of the kill's period is the first after inner step 9: period 2's, at its
    # end; the other kill comes before inner step 30, the third of period 7.
    assert [(e["host"], e["phase"], e["period"]) for e in events] == [
        (2, "allreduce", 2),
        (1, "compute", 7),
    ]
    assert events[0]["step"] == 3 * H - 1 and events[1]["step"] == 30
    lost = 0
    for event in events:
        host, period = event["host"], event["period"]
        survivors = [r for r in records if r["replica"] != host and r["t"] > event["t"]]
        # The exchange of the period in flight failed on every survivor, after all of its
        # inner steps ...
        first: dict[int, dict[str, Any]] = {}
        for r in sorted(survivors, key=lambda r: r["t"]):
            if r["step"] == period:
                first.setdefault(r["replica"], r)
        assert len(first) == 3 and not any(r["committed"] for r in first.values()), first
        assert all(r["kept"] and r["trained_steps"] == H for r in first.values()), first
        # ... and only the exchange was retried, with the quorum of the survivors: committed
        # by all of them within the bound, without a forward or backward pass, the period's inner
        # steps (and their losses) those of the failed attempt.
        assert event["recover_s"] is not None and event["recover_s"] <= RECOVER_BOUND_S, event
        again = [r for r in survivors if r["step"] == period and r["committed"]]
        assert {r["replica"] for r in again} == set(range(4)) - {host}
        for r in again:
            assert r["retry"] and r["trained_steps"] == 0, r
            assert r["losses"] == first[r["replica"]]["losses"] and len(r["losses"]) == H
        # The victim came back, healed from a peer, and committed every period from then on.
        life = [r for r in records if r["replica"] == host and r["life"] == 1]
        assert life and life[0]["healed"] and life[0]["committed"], life[:1]
        rejoined = event["rejoin_step"]
        assert {r["step"] for r in life if r["committed"]} == set(range(rejoined, steps // H))
        # The retry's quorum is the failed one's survivors: the victim, back or not, waits
        # for the next period (admitted to the retry, it would take its donor's point in a
        # period it did not train, and the average would weigh that donor twice), and no
        # state crosses the network during the retry.
        assert rejoined == period + 1 and not life[0]["retry"], life[:1]
        assert {r["participants"] for r in again} == {3}
        assert all(r["served_parts"] is None for r in again), again
        # Its batches of the kill's period are lost (the survivors kept their inner steps),
        # and those of the periods it missed.
        lost += H * (rejoined - period) + life[0]["skipped_steps"]
        # What the joiner holds is exactly what its donor served, part by part ...
        (donor,) = [r for r in records if r["served_parts"] and r["step"] == life[0]["step"]]
        assert life[0]["healed_parts"] == donor["served_parts"]
        served = donor["served_parts"]
        # ... none of it fresh: the outer momenta of the last committed period (the same on
        # every replica), and the donor's own error-feedback residuals.
        before = {
            r["outer_digest"] for r in records if r["committed"] and r["step"] == rejoined - 1
        }
        assert before == {served["outer_momenta"]}
        assert served["compressor"] != state_digest(_sparseloco().state_dict())
    # Every replica holds the same outer model at every committed period, and one model at
    # the end.
    by_period: dict[int, set[tuple[str, str]]] = {}
    for r in records:
        if r["committed"]:
            by_period.setdefault(r["step"], set()).add((r["digest"], r["outer_digest"]))
    assert sorted(by_period) == list(range(steps // H))
    assert all(len(d) == 1 for d in by_period.values()), by_period
    assert record["step_digests_agree"] and record["replicas_agree"]
    # Each kill failed one exchange on each of the three survivors, whose inner steps the
    # retry kept (none discarded); only the periods a victim missed are lost.
    assert record["discarded_periods"] == 6 and record["discarded_steps"] == 0
    assert record["committed_steps"] == steps
    assert record["batches_lost"] == lost and record["samples_lost"] == lost * WORKLOAD.batch
    # What was communicated: each committed period sent SparseLoCo's message of the whole
    # model (one fragment), nothing else.
    numel = _param_bytes() // 4
    payload = compressor.payload_bytes(numel, torch.float32, 4)
    assert 0 < payload < _param_bytes() // 20
    assert {r["bytes"] for r in records if r["committed"]} == {payload}


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fault_free_diloco_equals_the_run_without_torchft_bit_for_bit() -> None:
    from commfuse.cluster import run
    from commfuse.localsgd import diloco
    from commfuse.testing.bits import RunBits
    from commfuse.train.loop import train_rank

    # 3 periods and a partial one, closed by the final synchronisation; each inner step at
    # the scheduled rate of its step.
    steps = 3 * H + 2
    config = TrainConfig(
        workload=WORKLOAD,
        strategy=diloco(H=H),
        steps=steps,
        evaluate=False,
        lr_schedule=CosineSchedule(warmup_steps=2, min_ratio=0.0),
        param_fingerprints=True,
    )
    topology = Topology(num_hosts=2, link_mbit=1000)
    ft = run_fault_tolerant(config, FAULT_FREE, topology, timeout_s=200)
    plain = run(train_rank, config, None, net=topology, timeout_s=200)
    assert ft["discarded_steps"] == 0 and ft["batches_lost"] == 0 and ft["events"] == []
    assert ft["committed_periods"] == 4 and ft["committed_steps"] == steps
    for rank in (0, 1):
        mine = sorted((r for r in ft["records"] if r["replica"] == rank), key=lambda r: r["step"])
        losses = [loss for r in mine for loss in r["losses"]]
        assert losses == plain[rank]["history"]["loss"]  # every step, bit for bit
        assert plain[rank]["digest"] == ft["digest"]
        # One exchange of the fp32 model per period, the final synchronisation's included.
        assert [r["bytes"] for r in mine] == [_param_bytes()] * 4
        # Each period's parameters, hashed as the plain run hashes them after the period's
        # last inner step (the last one after the final synchronisation), and the same
        # choices: where the runs part, ``testing.bits`` can say so.
        fingerprints = RunBits.of_ft(ft, replica=rank).fingerprints
        assert sorted(fingerprints) == [H - 1, 2 * H - 1, 3 * H - 1, steps - 1]
        assert fingerprints == {s: plain[rank]["param_fingerprints"][s] for s in fingerprints}
        [choices] = [c for c in ft["choices"] if c["replica"] == rank]
        assert {k: choices[k] for k in ("compressor", "fragments")} == plain[rank]["choices"]


def test_per_period_mode_takes_the_local_sgd_family_and_ends_periods_at_synchronisations() -> None:
    from commfuse.compress import PowerSGD
    from commfuse.ft.periods import ft_mode, ft_periodic_config, sync_points
    from commfuse.localsgd import SelSyncConfig, diloco, local_sgd, post_local_sgd, streaming_diloco
    from commfuse.train.strategy import CommfuseDPConfig, TorchDDPConfig, TorchPowerSGDConfig

    assert ft_mode(diloco(H=50, compressor=_sparseloco())) == "periodic"
    assert ft_mode(local_sgd(H=8)) == "periodic"
    assert ft_mode(TorchDDPConfig()) == "ddp"
    assert ft_mode(CommfuseDPConfig(compressor=PowerSGD(rank=2))) == "ddp"
    for refused in (TorchPowerSGDConfig(), SelSyncConfig()):
        with pytest.raises(ValueError, match="per period: local-sgd, post-local-sgd"):
            ft_mode(refused)
    with pytest.raises(ValueError, match="hierarchical=1 needs several ranks per host"):
        ft_mode(local_sgd(H=8, hierarchical=True, ranks_per_host=2))
    adapted = ft_periodic_config(diloco(H=8, compressor=_sparseloco()))
    assert adapted.algo == "native" and adapted.compressor is not None
    assert (adapted.compressor.algo, adapted.compressor.gather_algo) == ("native", "native")
    # Every H steps, the last step, every step of a warm-up, F times per H when streaming.
    assert sync_points(diloco(H=4), 10) == [4, 8, 10]
    assert sync_points(diloco(H=4), 8) == [4, 8]
    assert sync_points(post_local_sgd(H=3, warmup_steps=2), 9) == [1, 2, 5, 8, 9]
    assert sync_points(streaming_diloco(H=8, num_fragments=4), 17) == [
        2,
        4,
        6,
        8,
        10,
        12,
        14,
        16,
        17,
    ]
    # A joiner's quorum request covers the others' period on top of the quorum's own wait.
    t = Timeouts.derive(2.0)
    assert t.period_quorum_timeout_s(0.0) == t.quorum_timeout_s
    assert t.period_quorum_timeout_s(3.0) == t.quorum_timeout_s + 6.0


@pytest.mark.netlab
@pytest.mark.timeout(120)
def test_netlab_cuts_and_slows_one_host_link() -> None:
    from commfuse.cluster.netlab import Netlab, run_cmd

    with Netlab(Topology(num_hosts=2, link_mbit=1000)) as lab:
        lab.set_rate(1, 10)
        inside = run_cmd(f"tc -n {lab.namespace(1)} qdisc show dev {lab.ifname(1)}").stdout
        outside = run_cmd(f"tc qdisc show dev {lab.peer(1)}").stdout
        other = run_cmd(f"tc qdisc show dev {lab.peer(0)}").stdout
        assert "rate 10Mbit" in inside and "rate 10Mbit" in outside, (inside, outside)
        assert "rate 1Gbit" in other
        lab.set_link(1, up=False)
        assert "state DOWN" in run_cmd(f"ip link show {lab.peer(1)}").stdout
        lab.set_link(1, up=True)
        assert "state DOWN" not in run_cmd(f"ip link show {lab.peer(1)}").stdout
        # The shaping outlives the cut.
        assert "rate 10Mbit" in run_cmd(f"tc qdisc show dev {lab.peer(1)}").stdout


def _children(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        for child in parents.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


LAUNCHER = """
from commfuse.cluster import Topology
from commfuse.ft import FaultToleranceConfig, run_fault_tolerant
from commfuse.train.loop import TrainConfig
from commfuse.workloads import CharLMConfig
if __name__ == "__main__":
    config = TrainConfig(workload=CharLMConfig(dim=32, layers=1, heads=2, seq=16, batch=4),
                         steps=10**7, evaluate=False)
    run_fault_tolerant(config, FaultToleranceConfig(), Topology(num_hosts=2, link_mbit=1000),
                       log_dir={log!r})
"""


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launcher_killed_takes_its_replicas_lighthouse_and_network_with_it(
    tmp_path: Path,
) -> None:
    from commfuse.cluster.netlab import list_labs

    before = {lab["lab_id"] for lab in list_labs()}
    script = tmp_path / "launch_ft.py"
    script.write_text(LAUNCHER.format(log=str(tmp_path)))
    src = str(Path(commfuse.__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": src},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # Training: both replicas are in their hosts' namespaces, holding their Managers.
        deadline = time.monotonic() + 120
        replicas: list[int] = []
        while time.monotonic() < deadline and len(replicas) < 2:
            time.sleep(0.5)
            own = os.readlink("/proc/self/ns/net")
            replicas = []
            for pid in _children(proc.pid):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/ns/net") != own:
                        replicas.append(pid)
        assert len(replicas) >= 2, "the replicas did not start"
        time.sleep(1.0)  # past the first quorum: the lighthouse is serving
        everything = _children(proc.pid)
        # this launcher's own labs (other jobs on the machine may build theirs meanwhile)
        labs = {
            lab["lab_id"]
            for lab in list_labs()
            if lab["lab_id"] not in before and lab.get("pid") in {proc.pid, *everything}
        }
        assert labs, "the launcher built no lab"
        proc.kill()
        assert proc.wait(timeout=15) == -signal.SIGKILL
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in everything):
            time.sleep(0.2)
        assert not [p for p in everything if _alive(p)]
        while time.monotonic() < deadline and labs & {lab["lab_id"] for lab in list_labs()}:
            time.sleep(0.2)
        assert not labs & {lab["lab_id"] for lab in list_labs()}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_timeouts_derive_from_one_setting() -> None:
    t = Timeouts.derive(2.0)
    assert t.heartbeat_timeout_s == t.join_timeout_s == 2.0
    assert t.heartbeat_interval_s == 0.4
    assert t.op_timeout_s == 10.0 and t.quorum_timeout_s > t.op_timeout_s
    assert FaultToleranceConfig().timeouts == t
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        FaultToleranceConfig(timeout_s=0)
    with pytest.raises(ValueError, match="min_replicas 5 is more than the 4"):
        FaultToleranceConfig(min_replicas=5).check_hosts(4)
    with pytest.raises(ValueError, match="kill of group 4: the run has 4 groups"):
        FaultToleranceConfig(faults=(KillFault(host=4, at_step=1),)).check_hosts(4)
    with pytest.raises(ValueError, match="fault on host 4"):
        FaultToleranceConfig(faults=(CutFault(host=4, at_s=1),)).check_hosts(4)
    with pytest.raises(ValueError, match="at most one kill per host"):
        FaultToleranceConfig(faults=(KillFault(host=1, at_step=1), KillFault(host=1, at_step=5)))
    with pytest.raises(ValueError, match="phase must be"):
        KillFault(host=0, at_step=1, phase="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="digest_every_steps must be at least 1"):
        FaultToleranceConfig(digest_every_steps=0)


def test_replicas_hash_their_parameters_at_the_steps_asked_and_after_the_last() -> None:
    from commfuse.ft.loop import ReplicaJob
    from commfuse.ft.replica import _digested

    def hashed(every: int | None) -> list[int]:
        job = ReplicaJob(
            train=TrainConfig(workload=WORKLOAD, steps=7),
            ft=FaultToleranceConfig(digest_every_steps=every),
            replica=0, num_replicas=2, life=0, addr="10.0.0.1", store_port=1, lighthouse="",
        )  # fmt: skip
        return [step for step in range(7) if _digested(job, step)]

    assert hashed(None) == [6]
    assert hashed(1) == list(range(7))
    assert hashed(3) == [2, 5, 6]


def test_chaos_specs_parse_into_faults_and_periodic_kills_follow_the_seed() -> None:
    from itertools import islice

    from commfuse.cli.spec import fault_from_spec

    assert fault_from_spec("kill:host=2,at_step=15,restart_after_s=5") == KillFault(
        host=2, at_step=15, restart_after_s=5.0
    )
    assert fault_from_spec("kill:host=0,at_step=3,restart_after_s=none,phase=compute") == (
        KillFault(host=0, at_step=3, restart_after_s=None, phase="compute")
    )
    assert fault_from_spec("cut:host=1,at_s=20,for_s=5") == CutFault(host=1, at_s=20, for_s=5)
    assert fault_from_spec("slow:host=3,link_mbit=10mbit") == SlowFault(host=3, link_mbit=10)
    every = fault_from_spec("kill-every:every_s=30,seed=7")
    assert every == KillEveryFault(every_s=30, seed=7)
    assert isinstance(every, KillEveryFault)
    first = list(islice(every.hosts(4), 8))
    assert first == list(islice(KillEveryFault(every_s=1, seed=7).hosts(4), 8))
    assert first != list(islice(KillEveryFault(every_s=1, seed=8).hosts(4), 8))
    assert set(first) <= set(range(4))
    with pytest.raises(ValueError, match="unknown fault 'flood'; known: kill, cut, slow"):
        fault_from_spec("flood:host=1")
    with pytest.raises(ValueError, match="unknown key 'link'"):
        fault_from_spec("slow:host=3,link=10mbit")


def test_a_renewed_group_of_the_same_quorum_is_fresh_and_its_alarm_is_down() -> None:
    import threading

    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions

    from commfuse.ft.process_group import AlarmedProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    addr = f"127.0.0.1:{store.port}/torchft/7/0"  # quorum 7's prefix, as the Manager makes it
    groups = [AlarmedProcessGroupGloo(timeout=timedelta(seconds=20)) for _ in range(2)]

    def on_both(target: Any, *args: Any) -> None:
        threads = [threading.Thread(target=target, args=(i, *args)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)

    def configure(i: int) -> None:
        groups[i].configure(addr, f"replica_{i:03d}", i, 2, 7)

    gathered: list[torch.Tensor] = [torch.empty(0)] * 2

    def all_gather(i: int) -> None:
        out = torch.empty(6)
        work = groups[i].allgather([list(out.chunk(2))], [torch.full((3,), float(i))],
                                   AllgatherOptions())  # fmt: skip
        groups[i].wait(work)
        gathered[i] = out

    on_both(configure)
    groups[0].raise_alarm()  # a failed period: the group of quorum 7 is done for
    assert all(g.alarmed() for g in groups)
    for group in groups:
        group.renew()
    on_both(configure)  # the same quorum again: its members did not change
    assert not any(g.alarmed() for g in groups)
    on_both(all_gather)
    expected = torch.tensor([0.0, 0, 0, 1, 1, 1])
    assert all(torch.equal(g, expected) for g in gathered), gathered


def test_state_transport_checks_every_tensor() -> None:
    from commfuse.ft.transport import ChecksumError, pack_state, unpack_state

    state: dict[str, Any] = {
        "model": {"w": torch.arange(6.0)},
        "opt": [{"step": torch.tensor(3)}],
        "n": 7,
    }
    back = unpack_state(pack_state(state))
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["n"] == 7
    blob = bytearray(pack_state(state))
    # Corrupt one float of "w" in the blob (its bytes are stored raw): the digest catches it.
    raw = torch.arange(6.0).numpy().tobytes()
    at = bytes(blob).find(raw)
    assert at >= 0
    blob[at + 4] ^= 0xFF
    with pytest.raises(ChecksumError, match="differ"):
        unpack_state(bytes(blob))
    # Nothing but tensors and plain containers is loaded.
    buffer = io.BytesIO()
    torch.save({"state": timedelta(seconds=1), "sha256": {}}, buffer)
    with pytest.raises(Exception, match=r"weights_only|Unsupported global"):
        unpack_state(buffer.getvalue())


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port`` here."""
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


def test_lighthouse_and_state_server_listen_on_their_address_only() -> None:
    from commfuse.ft.lighthouse import start_lighthouse
    from commfuse.ft.transport import ChecksummedHTTPTransport

    lighthouse = start_lighthouse(
        "127.0.0.1", netns=None, timeouts=Timeouts.derive(2.0), min_replicas=1
    )
    transport = ChecksummedHTTPTransport("127.0.0.1", timeout=timedelta(seconds=5))
    try:
        assert lighthouse.url.startswith("http://127.0.0.1:")
        assert _listening(int(lighthouse.url.rsplit(":", 1)[1])) == ["0100007F"]
        assert transport.metadata().startswith("http://127.0.0.1:")
        port = int(transport.metadata().split(":")[2].split("/")[0])
        assert _listening(port) == ["0100007F"]
    finally:
        transport.shutdown()
        lighthouse.shutdown()


@pytest.mark.e2e
def test_import_and_help_leave_torchft_unimported() -> None:
    src = str(Path(commfuse.__file__).resolve().parents[1])
    code = (
        "import sys, contextlib, io\n"
        "import commfuse, commfuse.ft\n"
        "from commfuse.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['train', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torchft', 'torch'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from commfuse.ft.require import require_torchft

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name)
    )
    with pytest.raises(ImportError, match=r"pip install 'commfuse\[ft\]'"):
        require_torchft()


def test_a_retry_that_fails_before_its_exchange_keeps_the_periods_inner_steps() -> None:
    from commfuse.ft.periodic import work_kept_for_retry

    work = {"grads": [torch.ones(3)], "losses": [2.5, 2.4], "samples": [0, 8], "skipped": 0}
    # The exchange failed after the inner steps: their work is kept for the retry.
    failed_exchange = {"state": {}, **work}
    assert work_kept_for_retry(failed_exchange, {}, retrying=False) == work
    # A retry whose quorum failed (its Manager errored) rolls back to where it began, the
    # point before the period's last optimizer step: the inner steps' work stays kept, or the
    # next attempt would start the period over from that point, an inner step short.
    assert work_kept_for_retry(None, work, retrying=True) == work
    # A first attempt that failed before its exchange starts the period over.
    assert work_kept_for_retry(None, {}, retrying=False) == {}
