"""The MoE workload: a training step with both All-to-Alls fused (3 chunks) follows the unfused
step (1 chunk, gloo's All-to-All) step for step (losses and every parameter within rtol 1e-5 over
three steps, world sizes 1 and 3), replicated parameters stay identical across ranks, batches
are a pure function of (seed, step, rank), and the fused step sends through the fused operators
what the unfused one sends through gloo's All-to-All. The replicated gradients travel in two
all-reduces per step: the head's (gloo's), issued before the backward's last exchange, and the
rest by recursive doubling after it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.comm.communicator import default_config
from commfuse.fused import baselines
from commfuse.fused import gemm_all_to_all as ga
from commfuse.testing import RankPool
from commfuse.workloads.moe import LATE_ALL_REDUCE, MoEConfig, MoEWorkload

PoolFn = Callable[[int], RankPool]
OPTIONS = MoEConfig(d_model=8, d_hidden=6, num_experts=4, tokens_per_rank=10, num_classes=3)


def train(num_chunks: int, steps: int) -> tuple[list[float], list[torch.Tensor], dict[str, int]]:
    comm = Communicator(config=dataclasses.replace(default_config(), trace=True))
    workload = MoEWorkload(OPTIONS)
    model = workload.build_model(comm, 5, fused=num_chunks > 1, num_chunks=num_chunks)
    optimizer = workload.make_optimizer(model)
    losses = []
    comm.stats.reset()
    for step in range(steps):
        batch = workload.batch(step, comm.rank, seed=5, device=comm.device)
        comm.trace.clear()
        losses.append(workload.train_step(comm, model, optimizer, batch))
    exchanges = {ga.LABEL, label("all_to_all", baselines.ALL_TO_ALL)}
    late = label("all_reduce", LATE_ALL_REDUCE)
    kinds = [e.kind for e in comm.trace.events if e.kind in exchanges | {"all_reduce", late}]
    sizes = [e.nbytes for e in comm.trace.events if e.kind == "all_reduce"] + [0]
    last_exchange = max((i for i, kind in enumerate(kinds) if kind in exchanges), default=-1)
    sent = {
        "fused": comm.stats[ga.LABEL].bytes_sent,
        "all_to_all": comm.stats["all_to_all"].native_bytes,
        "all_reduce_calls": comm.stats["all_reduce"].calls,
        # the head's gradients travel before the backward's last exchange, the rest after it
        "head_first": int(
            late in kinds and kinds.index("all_reduce") < last_exchange < kinds.index(late)
        ),
        "head_bytes": sizes[0],
        # the rest by recursive doubling: handed once per step, sent in whole buffers
        "rest_handed": comm.stats[late].handed_bytes,
        "rest_sent": comm.stats[late].bytes_sent,
    }
    return losses, [p.detach().clone() for p in model.parameters()], sent


def compare() -> list[str]:
    comm = Communicator()
    failures = []
    unfused_losses, unfused_params, unfused_sent = train(1, 3)
    fused_losses, fused_params, fused_sent = train(3, 3)
    where = f"rank {comm.rank}"
    if not torch.allclose(torch.tensor(fused_losses), torch.tensor(unfused_losses), rtol=1e-5):
        failures.append(f"{where}: losses {fused_losses} vs {unfused_losses}")
    for i, (a, b) in enumerate(zip(fused_params, unfused_params, strict=True)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            failures.append(f"{where}: parameter {i} differs after 3 steps")
    if comm.world_size > 1:
        if unfused_sent["fused"] != 0 or fused_sent["all_to_all"] != 0:
            failures.append(f"{where}: wrong path used {fused_sent} {unfused_sent}")
        if fused_sent["fused"] == 0:
            failures.append(f"{where}: fused step sent nothing")
    head_bytes = 4 * (OPTIONS.num_classes * OPTIONS.d_model + OPTIONS.num_classes)
    rest_bytes = 4 * (2 * OPTIONS.d_model + OPTIONS.num_experts * OPTIONS.d_model)
    for sent in (fused_sent, unfused_sent):
        many = comm.world_size > 1  # one rank communicates nothing
        if (
            (sent["all_reduce_calls"], sent["head_bytes"]) != (3, head_bytes)
            or sent["rest_handed"] != 3 * rest_bytes * many
            or (many and not (sent["rest_sent"] > 0 and sent["rest_sent"] % rest_bytes == 0))
            or (many and not sent["head_first"])
        ):
            failures.append(f"{where}: replicated gradients' all-reduces {sent}")
    head = fused_params[-2].clone()
    comm.all_reduce(head, "max")
    if not torch.equal(head, fused_params[-2]):
        failures.append(f"{where}: replicated head differs across ranks")
    return failures


@pytest.mark.parametrize("world", [1, 3])
def test_moe_step_fused_matches_unfused(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(compare, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_moe_batches_deterministic() -> None:
    workload = MoEWorkload(OPTIONS)
    x1, y1 = workload.batch(3, 1, seed=2, device=torch.device("cpu"))
    x2, y2 = workload.batch(3, 1, seed=2, device=torch.device("cpu"))
    x3, _ = workload.batch(3, 2, seed=2, device=torch.device("cpu"))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == (10, 8) and int(y1.max()) < 3


def test_moe_options_errors() -> None:
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        MoEConfig(top_k=0)
