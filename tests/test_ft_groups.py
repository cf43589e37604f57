"""Replica groups of several ranks, and a start from a checkpoint, on torchft, end to end.

``commfuse train --fault-tolerant --replica-groups 2 --init-from D`` on two emulated hosts of
two ranks each (real lighthouse, real processes and network namespaces, a real SIGKILL of a
whole group): each group trains torch DDP inside itself and meets the other group rank by
rank through torchft's Managers (``commfuse.ft.group_hook``):

* every replica group starts at the checkpoint's step with its model and optimizer state;
* every attempt sent across groups exactly each rank's shard of the gradient (half of it:
  the hierarchical exchange's saving), and nothing else;
* group 1 is killed (both its ranks) while its cross-group allreduce is in flight; group 0
  commits nothing for that step, the restarted group (which loads the checkpoint too, and
  is behind) recovers each rank from its peer rank of group 0, and the step is committed
  again by both groups, so that every committed step had both groups in it;
* hence the run's arithmetic is a fault-free run's: the parameters of all four ranks at the
  end equal, bit for bit, a reference computed here in one process from the checkpoint,
  each step's four gradients averaged as the hierarchical exchange does, ``(g0 / 4 + g1 / 4)
  + (g2 / 4 + g3 / 4)`` (a sum of two is the same in either order, so gloo's rings add the
  same bits; one thread, as each rank computes). torch DDP over four ranks sums the four in
  its ring's order instead: the same up to rounding, not bit for bit;
* the record counts steps and samples from the checkpoint's step.

Then, with what crosses groups split among a group's ranks (``commfuse.ft.group_comm``): the
split exchange on four real ranks against a group of one rank, bit for bit, for three
compressors; DiLoCo with SparseLoCo and a group killed in its outer exchange; top-k per step
with the fixed global batch and a kill. The rest is cheap: the layout of groups over the
ranks, a fault record's host and groups, and ``compare --fault-tolerant --init-from``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commfuse.ft import FaultToleranceConfig, KillFault
from commfuse.train import checkpoint as ckpt
from commfuse.train.loop import TrainConfig, params_digest
from commfuse.workloads import CharLMConfig, make_workload

WORKLOAD = CharLMConfig(dim=32, layers=2, heads=2, seq=16, batch=4)
SPEC = "charlm:dim=32,layers=2,heads=2,seq=16,batch=4"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Compute as a rank does (``OMP_NUM_THREADS=1``): a reduction inside a kernel (layer
    norm's bias gradient) adds in another order on several threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _checkpoint_at(root: Path, step: int) -> None:
    """A checkpoint of ``step`` in commfuse's format: a model (not the run's seed) after one
    AdamW step, so that neither it nor the optimizer's moments can pass for a fresh start."""
    workload = make_workload(WORKLOAD, device=torch.device("cpu"))
    model = workload.build_model(7)
    optimizer = workload.make_optimizer(model)
    loss = workload.loss(model, workload.batch(0, 0, 1, seed=7))
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    payload = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    ckpt.save_rank(root, step, 0, payload)
    ckpt.mark_latest(root, step)


def _reference(root: Path, start: int, steps: int, ranks: int) -> tuple[str, int]:
    """The parameters after steps ``[start, steps)`` from the checkpoint, on ``ranks`` ranks
    in two groups, each step's gradients averaged as ``group_hook`` does; and their count."""
    workload = make_workload(WORKLOAD, device=torch.device("cpu"))
    model = workload.build_model(0)
    optimizer = workload.make_optimizer(model)
    state = ckpt.load_rank(root, start, 0, device=torch.device("cpu"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    params = list(model.parameters())
    half = ranks // 2
    with _one_thread():
        for step in range(start, steps):
            grads = []
            for slot in range(ranks):
                model.zero_grad(set_to_none=True)
                loss = workload.loss(model, workload.batch(step, slot, ranks, seed=0))
                loss.backward()  # type: ignore[no-untyped-call]
                grads.append([p.grad.detach() / ranks for p in params if p.grad is not None])
            for i, p in enumerate(params):
                first = grads[0][i] + grads[1][i]
                second = grads[half][i] + grads[half + 1][i]
                p.grad = first + second
            optimizer.step()
    return params_digest(model), sum(p.numel() for p in params)


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_groups_of_two_ranks_from_a_checkpoint_exchange_shards_and_rejoin_rank_by_rank(
    tmp_path: Path,
) -> None:
    from commfuse.cli import main

    start, steps, kill_at = 3, 8, 5
    _checkpoint_at(tmp_path / "ckpt", start)
    out = tmp_path / "run.json"
    argv = [
        "train", "--workload", SPEC, "--hosts", "2", "--ranks-per-host", "2", "--link", "1gbit",
        "--fault-tolerant", "--replica-groups", "2", "--ft-timeout", "1", "--min-replicas", "2",
        "--steps", str(steps), "--digest-every-steps", "1", "--init-from", str(tmp_path / "ckpt"),
        "--chaos", f"kill:host=1,at_step={kill_at},restart_after_s=0.5", "--json", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    records: list[dict[str, Any]] = record["records"]
    assert record["group_size"] == 2 and record["num_replicas"] == 2
    assert record["first_step"] == start and record["committed_steps"] == steps
    assert min(r["step"] for r in records) == start
    # The kill: group 1's step failed on group 0 too, and was committed again by both.
    (event,) = record["events"]
    assert (event["host"], event["step"], event["phase"]) == (1, kill_at, "allreduce")
    failed = [(r["replica"], r["step"]) for r in records if not r["committed"]]
    assert failed == [(0, kill_at)], failed
    assert record["discarded_steps"] == 1
    assert {r["participants"] for r in records if r["committed"]} == {2}
    # The restarted group recovered both ranks from their peers (model and AdamW's moments,
    # each rank's), and went on from the step in flight.
    life = sorted(
        (r for r in records if r["replica"] == 1 and r["life"] == 1), key=lambda r: r["t"]
    )
    assert life[0]["healed"] and life[0]["step"] == kill_at and life[0]["committed"], life[:1]
    reference, numel = _reference(tmp_path / "ckpt", start, steps, ranks=4)
    assert record["recovered_bytes"] > 2 * 3 * numel * 4
    # All four ranks hold the same parameters, the hierarchical arithmetic's from the
    # checkpoint on.
    final = sorted((replica, rank) for replica, rank, _, _ in record["rank_digests"])
    assert final == [(0, 0), (0, 1), (1, 0), (1, 1)], final
    assert {d for *_, d in record["rank_digests"]} == {reference}
    assert record["step_digests_agree"] and record["steps_compared"] == steps - start
    # Data, from the checkpoint's step on: every rank's batch of every committed step.
    assert record["samples_lost"] == 0
    assert record["samples_trained"] == (steps - start) * 4 * WORKLOAD.batch
    # What crossed groups: each rank's half of the gradient per attempt, nothing else.
    assert {r["bytes"] for r in records} == {numel // 2 * 4}


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_diloco_groups_of_two_ranks_send_their_shards_and_a_killed_group_rejoins_as_one() -> None:
    from commfuse.cluster import Topology
    from commfuse.compress import SparseLoCo
    from commfuse.ft.launch import run_fault_tolerant
    from commfuse.ft.periodic import state_digest
    from commfuse.localsgd import diloco

    H, steps = 2, 8
    compressor = SparseLoCo(chunk_numel=1024, num_kept_per_chunk=32)
    kill = KillFault(host=1, at_step=3, phase="allreduce", restart_after_s=0.0)
    record = run_fault_tolerant(
        TrainConfig(
            workload=WORKLOAD, strategy=diloco(H=H, compressor=compressor), steps=steps,
            evaluate=False,
        ),
        FaultToleranceConfig(faults=(kill,), num_replica_groups=2, timeout_s=1.0),
        Topology(num_hosts=2, ranks_per_host=2, link_mbit=1000),
        timeout_s=150,
    )  # fmt: skip
    records: list[dict[str, Any]] = sorted(record["records"], key=lambda r: r["t"])
    assert record["group_size"] == 2 and record["mode"] == "periodic"
    assert record["committed_periods"] == steps // H and record["committed_steps"] == steps
    (event,) = record["events"]
    assert (event["host"], event["phase"], event["period"]) == (1, "allreduce", 1)
    # Group 0's exchange of period 1 failed after its inner steps, which it kept; it retried
    # the exchange alone (the killed group waits for the next period).
    failed = [r for r in records if not r["committed"]]
    assert [(r["replica"], r["step"], r["kept"]) for r in failed] == [(0, 1, True)], failed
    (retry,) = [r for r in records if r["retry"]]
    assert (retry["replica"], retry["committed"], retry["participants"]) == (0, True, 1)
    assert retry["trained_steps"] == 0 and retry["bytes"] == 0
    # The whole group came back at period 2, healed from group 0 (its rank 0 from rank 0):
    # the outer momenta of period 1 and the donor's error feedback, part by part.
    life = [r for r in records if r["replica"] == 1 and r["life"] == 1]
    assert life[0]["healed"] and life[0]["step"] == event["rejoin_step"] == 2, life[:1]
    assert all(r["committed"] for r in life) and [r["step"] for r in life] == [2, 3]
    (donor,) = [r for r in records if r["served_parts"] and r["step"] == 2]
    assert life[0]["healed_parts"] == donor["served_parts"]
    (period1,) = [r for r in records if r["committed"] and r["step"] == 1]
    assert donor["served_parts"]["outer_momenta"] == period1["outer_digest"]
    assert donor["served_parts"]["compressor"] != state_digest(compressor.state_dict())
    # One outer model per committed period, and all four ranks equal at the end.
    for period in range(steps // H):
        assert len({r["digest"] for r in records if r["committed"] and r["step"] == period}) == 1
    assert len({d for *_, d in record["rank_digests"]}) == 1 and len(record["rank_digests"]) == 4
    assert record["step_digests_agree"] and record["replicas_agree"]
    # What crossed groups: per attempt of two groups, each rank's half of SparseLoCo's
    # message of the whole model (padded to an even length: one element more at most).
    payload = _model_payload(compressor)
    for r in records:
        if r["participants"] == 2 and r["trained_steps"] > 0:
            assert 2 * r["bytes"] - payload in range(0, 9), (r["bytes"], payload)


@pytest.mark.netlab
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compressed_groups_keep_the_global_batch_through_a_kill_and_send_their_shards() -> None:
    from commfuse.cluster import Topology
    from commfuse.compress import TopK
    from commfuse.ft.launch import run_fault_tolerant
    from commfuse.train.strategy import CommfuseDPConfig

    # Enough steps that the killed group is back before the survivors finish alone: they take
    # about 20 ms a step; the restarted group (a spare, built while the others train) rejoins
    # at the restart.
    steps, kill_at = 240, 3
    compressor = TopK(ratio=0.1)
    # Back after the survivors committed steps alone: they train its samples meanwhile. Their
    # first commit alone comes about 1 s after the kill (the 1 s timeout, then a quorum of
    # one); a restart 1.5 s after the kill left half a second, which a loaded machine used up,
    # and one after 3 s let them finish all 240 steps alone.
    kill = KillFault(host=1, at_step=kill_at, restart_after_s=2.0)
    record = run_fault_tolerant(
        TrainConfig(
            workload=WORKLOAD, strategy=CommfuseDPConfig(compressor=compressor), steps=steps,
            evaluate=False,
        ),
        FaultToleranceConfig(
            faults=(kill,), num_replica_groups=2, timeout_s=1.0, global_batch="fixed",
            digest_every_steps=1,
        ),
        Topology(num_hosts=2, ranks_per_host=2, link_mbit=1000),
        timeout_s=150,
    )  # fmt: skip
    records: list[dict[str, Any]] = sorted(record["records"], key=lambda r: r["t"])
    assert record["group_size"] == 2 and record["committed_steps"] == steps
    (event,) = record["events"]
    assert (event["host"], event["groups"], event["step"]) == (1, [1], kill_at)
    # The global batch is 2 groups x 2 ranks x 4 samples: group 0 alone trains all 16 of a
    # step (each of its ranks half of them), with both groups each its own 8; nothing is
    # lost or trained twice.
    batch = 2 * 2 * WORKLOAD.batch
    alone = [r for r in records if r["committed"] and r["participants"] == 1]
    assert alone and all(r["samples"] == [0, batch] for r in alone), alone
    both = [r for r in records if r["committed"] and r["participants"] == 2]
    assert {(r["replica"], tuple(r["samples"])) for r in both} == {(0, (0, 8)), (1, (8, 16))}
    assert record["samples_lost"] == 0 and record["samples_duplicated"] == 0
    assert record["samples_trained"] == steps * batch
    # The restarted group healed (its own residuals start at zero) and took part again;
    # every rank of both groups ends with the same parameters.
    life = [r for r in records if r["replica"] == 1 and r["life"] == 1]
    assert life and life[0]["healed"] and all(r["committed"] for r in life), life[:1]
    assert len({d for *_, d in record["rank_digests"]}) == 1 and len(record["rank_digests"]) == 4
    assert record["step_digests_agree"] and record["replicas_agree"]
    # What crossed groups: with both groups, each rank's half of top-k's message of the
    # bucket; alone, nothing.
    payload = _model_payload(compressor)
    assert all(2 * r["bytes"] - payload in range(0, 17) for r in both), (both[0]["bytes"], payload)
    assert all(r["bytes"] == 0 for r in alone)


def test_replica_groups_split_the_ranks_evenly() -> None:
    assert FaultToleranceConfig().group_layout(4, 2) == (4, 2)  # one group per host
    assert FaultToleranceConfig(num_replica_groups=2).group_layout(4, 1) == (2, 2)
    assert FaultToleranceConfig(num_replica_groups=8).group_layout(4, 2) == (8, 1)
    with pytest.raises(ValueError, match="3 replica groups do not split 4 hosts x 2 ranks"):
        FaultToleranceConfig(num_replica_groups=3).group_layout(4, 2)
    with pytest.raises(ValueError, match="num_replica_groups must be at least 1"):
        FaultToleranceConfig(num_replica_groups=0)
    with pytest.raises(ValueError, match="kill of group 2: the run has 2 groups"):
        FaultToleranceConfig(
            num_replica_groups=2, faults=(KillFault(host=2, at_step=1),)
        ).check_hosts(4)
    with pytest.raises(ValueError, match="min_replicas 3 is more than the 2 replica groups"):
        FaultToleranceConfig(min_replicas=3, num_replica_groups=2).check_hosts(4)


def _model_payload(compressor: Any) -> int:
    """Bytes of ``compressor``'s message of the whole workload model between 2 groups."""
    model = make_workload(WORKLOAD, device=torch.device("cpu")).build_model(0)
    numel = sum(p.numel() for p in model.parameters())
    return int(compressor.payload_bytes(numel, torch.float32, 2))


def _group_exchange(sizes: list[int]) -> dict[str, Any]:
    """Rank ``r`` of 4 is group rank ``r % 2`` of replica group ``r // 2``; each group rank
    meets its peer of the other group in a real reconfigurable gloo group (torchft's
    ``configure``). Every compressor reduces, over two steps (error feedback), the same
    message on both ranks of a group through ``GroupQuorumComm``; group rank 0 of each group
    reduces it too through a plain ``QuorumComm`` between the groups (what a group of one
    rank does), with its own copy of the compressor: the reference."""
    import copy
    import dataclasses
    import os
    from datetime import timedelta

    from commfuse.compress import Int8, NoCompression, SparseLoCo
    from commfuse.ft.group_comm import GroupQuorumComm
    from commfuse.ft.periodic import state_digest
    from commfuse.ft.process_group import AlarmedProcessGroupGloo
    from commfuse.ft.quorum_comm import QuorumComm

    rank = dist.get_rank()
    replica, group_rank = divmod(rank, 2)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/group-comm-test"

    def quorum(name: str) -> QuorumComm:
        cross = AlarmedProcessGroupGloo(timeout=timedelta(seconds=30))
        cross.configure(f"{store}/{name}", f"replica_{replica:03d}", replica, 2)
        comm = QuorumComm(cross)
        comm.at_quorum(replica, 2)
        return comm

    grouped = GroupQuorumComm(quorum(f"rank{group_rank}"), groups[replica], group_rank, 2)
    reference = quorum("reference") if group_rank == 0 else None
    out: dict[str, Any] = {"digests": [], "bytes": []}
    # The quorum's own collectives, as fault-tolerant training runs every compressor.
    compressors = [
        dataclasses.replace(c, algo="native", gather_algo="native")
        for c in (NoCompression(), Int8(), SparseLoCo(chunk_numel=64, num_kept_per_chunk=4))
    ]
    for compressor in compressors:
        mine, ref = copy.deepcopy(compressor), copy.deepcopy(compressor)
        for size in sizes:
            for step in range(2):
                gen = torch.Generator().manual_seed(1000 * replica + 10 * size + step)
                x = torch.randn(size, generator=gen) * 10.0 ** torch.randint(
                    -3, 3, (size,), generator=gen
                )
                y = x.clone()
                before = grouped.bytes_sent
                mine.reduce_(grouped, x, bucket=size, step=step)  # type: ignore[arg-type]
                entry = [
                    state_digest(x),
                    state_digest(mine.state_dict()),
                    grouped.bytes_sent - before,
                ]
                if reference is not None:
                    before = reference.bytes_sent
                    ref.reduce_(reference, y, bucket=size, step=step)  # type: ignore[arg-type]
                    entry += [
                        state_digest(y),
                        state_digest(ref.state_dict()),
                        reference.bytes_sent - before,
                    ]
                out["digests"].append(entry)
    dist.barrier()
    return out


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_group_comm_splits_each_message_among_the_group_ranks_and_equals_a_group_of_one() -> None:
    from commfuse.cluster import run

    pytest.importorskip("torchft")
    sizes = [1, 7, 1000]
    results = run(_group_exchange, sizes, world_size=4)
    for i, entries in enumerate(zip(*(r["digests"] for r in results), strict=True)):
        r0, r1, r2, r3 = entries
        # Every rank of both groups ends with the same bits as the reference, a group of one
        # rank per replica group; each rank of a group with its group's compressor state
        # (error feedback: each group's own).
        assert {r0[0], r1[0], r2[0], r3[0], r0[3], r2[3]} == {r0[0]}, i
        assert {r0[1], r1[1], r0[4]} == {r0[1]} and {r2[1], r3[1], r2[4]} == {r2[1]}, i
        # Each group rank sends its half of every message (a shard padded to even length:
        # at most one element, 8 bytes, per collective more), never the whole.
        whole = r0[5]
        for sent in (r0[2], r1[2], r2[2], r3[2]):
            assert 2 * sent - whole in range(0, 17), (i, sent, whole)


def test_a_fault_record_names_the_host_and_the_replica_groups_it_hit() -> None:
    from commfuse.ft.accounting import summarize_ft
    from commfuse.ft.config import Timeouts
    from commfuse.ft.launch import GroupLayout

    # 4 hosts of one rank in 2 groups of two: host 3 holds group 1's second rank.
    pairs = GroupLayout(group_size=2, ranks_per_host=1)
    assert pairs.of_host(3) == {"replica": 1, "groups": [1], "host": 3}
    assert pairs.of_group(1) == {"replica": 1, "groups": [1], "host": 2}
    # 2 hosts of two ranks in 4 groups of one: a cut of host 1 hits groups 2 and 3.
    singles = GroupLayout(group_size=1, ranks_per_host=2)
    assert singles.of_host(1) == {"replica": 2, "groups": [2, 3], "host": 1}
    assert singles.of_group(3)["host"] == 1

    def attempt(replica: int, step: int, t: float, participants: int = 2) -> dict[str, Any]:
        return {"replica": replica, "life": 0, "step": step, "committed": True,
                "samples": [8 * replica, 8 * replica + 8], "participants": participants,
                "t": t, "t0": t - 0.6, "t_quorum": t - 0.5, "loss": 1.0, "digest": None,
                "healed": False, "bytes": 0, "error": None}  # fmt: skip

    # Host 3's link is down during step 1: group 1 misses it and commits step 2 again.
    records = [attempt(0, 0, 1.0), attempt(1, 0, 1.0), attempt(0, 1, 2.0, participants=1)]
    records += [attempt(0, 2, 3.0), attempt(1, 2, 3.0)]
    cut = {"kind": "cut", "t": 1.5, "for_s": 1.0} | pairs.of_host(3)
    record = summarize_ft(
        records=records, faults=[cut], restarts=[], results=[], num_replicas=2, steps=3,
        batch_samples=8, wall_s=4.0, topology="4 hosts", timeouts=Timeouts.derive(1.0),
    )  # fmt: skip
    (event,) = record["events"]
    assert (event["kind"], event["host"], event["groups"]) == ("cut", 3, [1])
    # Group 1 is the one that came back: its first commit after the link is up.
    assert (event["step"], event["rejoin_step"], event["rejoin_s"]) == (1, 2, 1.5)


def test_compare_fault_tolerant_takes_a_checkpoint_to_start_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commfuse.cli import main

    argv = ["compare", "--fault-tolerant", "--workload", SPEC, "--hosts", "2", "--steps", "4"]
    # The flag reaches the runs' config, which checks the folder before anything starts.
    assert main([*argv, "--init-from", str(tmp_path / "none")]) == 2
    assert "no complete checkpoint there" in capsys.readouterr().err


def _join_group(job: Any, late_s: float, conn: Any) -> None:
    """A rank of a replica group that starts ``late_s`` after its peer: builds the group's
    process group and sums a one through it."""
    import time

    from commfuse.ft.loop import init_group_process_group

    time.sleep(late_s)  # after the imports, which take their own time in each process
    try:
        init_group_process_group(job)
        one = torch.ones(1)
        dist.all_reduce(one)
        conn.send(float(one))
    except Exception as exc:
        conn.send(repr(exc))


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_the_ranks_of_a_group_find_each_other_however_far_apart_they_start() -> None:
    import multiprocessing

    from torch._C._distributed_c10d import TCPStore

    from commfuse.ft.loop import ReplicaJob

    # The operations' timeout is 1 s here; the second rank comes 2 s after the first, as
    # a busy machine starts a restarted group's processes.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ft = FaultToleranceConfig(timeout_s=0.2)
    spawn = multiprocessing.get_context("spawn")
    pipes, ranks = [], []
    for rank, late_s in ((0, 0.0), (1, 2.0)):
        job = ReplicaJob(
            train=TrainConfig(), ft=ft, replica=0, num_replicas=1, life=1, addr="127.0.0.1",
            store_port=store.port, lighthouse="", group_rank=rank, group_size=2,
        )  # fmt: skip
        ours, theirs = spawn.Pipe()
        ranks.append(spawn.Process(target=_join_group, args=(job, late_s, theirs)))
        ranks[-1].start()
        pipes.append(ours)
    sums = [pipe.recv() if pipe.poll(50) else "no answer" for pipe in pipes]
    for proc in ranks:
        proc.join(10)
    assert sums == [2.0, 2.0], sums
