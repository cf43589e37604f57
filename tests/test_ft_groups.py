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

The rest is cheap: the layout of groups over the ranks, and what groups of several ranks
refuse.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.ft import FaultToleranceConfig, KillFault
from commfuse.train import checkpoint as ckpt
from commfuse.train.loop import TrainConfig, params_digest
from commfuse.workloads import CharLMOptions, make_workload

WORKLOAD = CharLMOptions(dim=32, layers=2, heads=2, seq=16, batch=4)
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


def test_replica_groups_split_the_ranks_evenly_and_refuse_what_they_do_not_run() -> None:
    from commfuse.compress import PowerSGD
    from commfuse.ft.launch import check_groups_of_ranks
    from commfuse.ft.periods import ft_mode
    from commfuse.localsgd import diloco
    from commfuse.train.strategy import CommfuseDPConfig

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
    ft = FaultToleranceConfig()
    for refused in (diloco(H=4), CommfuseDPConfig(compressor=PowerSGD(rank=2))):
        config = TrainConfig(workload=WORKLOAD, strategy=refused)
        with pytest.raises(ValueError, match="replica groups of several ranks run per-step"):
            check_groups_of_ranks(config, ft, ft_mode(refused))
    with pytest.raises(ValueError, match="run global_batch='shrink'"):
        check_groups_of_ranks(
            TrainConfig(workload=WORKLOAD), FaultToleranceConfig(global_batch="fixed"), "ddp"
        )
