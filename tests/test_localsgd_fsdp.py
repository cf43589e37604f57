"""The periodic methods over FSDP2-sharded replicas (HSDP's layout), and the inputs they refuse.

Four ranks are two replicas of two shards each (a ``replicate x shard`` device mesh): FSDP2
(``fully_shard``) shards each replica over its own two ranks, and ``PeriodicSyncOptimizer``
averages each rank's shards with the same shards of the other replica. The reference is the
same method on unsharded replicas, each trained on its two ranks' batches together, in fp64.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from commfuse.comm import Communicator
from commfuse.compress import Int4
from commfuse.localsgd import (
    PeriodicMethod,
    PeriodicSyncOptimizer,
    SelSyncConfig,
    diloco,
    local_sgd,
    post_local_sgd,
    streaming_diloco,
)
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
Method = Callable[..., PeriodicMethod]

pytestmark = pytest.mark.e2e

#: The inner AdamW's learning rate.
LR = 0.03


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 2)]
    return nn.Sequential(*layers).double()


def sharded_model(mesh: DeviceMesh) -> nn.Module:
    """``plain_model`` with every linear layer, then the whole, sharded over ``mesh`` (an odd
    row count gives uneven shards, one of a single row)."""
    model = plain_model()
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, step: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    return x, x[:, :2] * 0.5 - x[:, 2:] ** 2


def loss_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = ((model(x) - y) ** 2).mean()
    return loss


def held_out_loss(model: nn.Module) -> float:
    """The loss on 64 samples no rank trains on (every rank of a replica runs the forward)."""
    with torch.no_grad():
        return float(loss_on(model, *batch(10**6, 0, rows=64)))


def shard_of(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter."""
    return cast(DTensor, param).to_local().detach()


def mesh_2x2() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def train_steps(
    model: nn.Module, opt: PeriodicSyncOptimizer, steps: range, comm: Communicator
) -> tuple[list[float], list[int]]:
    """Train ``steps`` on this rank's batches: each step's loss and the bytes handed to the
    replica group during it."""
    losses, sent = [], []
    for step in steps:
        before = comm.stats.total().handed_bytes
        loss = loss_on(model, *batch(dist.get_rank(), step))
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        sent.append(comm.stats.total().handed_bytes - before)
    return losses, sent


def sharded_run(method: Method, options: dict[str, Any], steps: int) -> dict[str, Any]:
    mesh = mesh_2x2()
    comm = Communicator(mesh["replicate"].get_group(), name="replicate")
    model = sharded_model(mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = PeriodicSyncOptimizer(inner, model, comm, method(**copy.deepcopy(options)))
    before = held_out_loss(model)
    _, sent = train_steps(model, opt, range(steps), comm)
    opt.finish()
    shards = [shard_of(p).clone() for p in model.parameters()]
    full = [cast(DTensor, p).full_tensor().detach() for p in model.parameters()]
    return {
        "held_out": (before, held_out_loss(model)),
        "sent": sent,
        "shard_bytes": sum(s.numel() * s.element_size() for s in shards),
        "shards": shards,
        "full": full,
    }


def unsharded_reference(method: Method, options: dict[str, Any], steps: int) -> list[torch.Tensor]:
    """The same method on whole replicas: replica r trains on the batches of both its ranks
    (the mean of their two means, as FSDP2's averaged gradient)."""
    mesh = mesh_2x2()
    comm = Communicator(mesh["replicate"].get_group(), name="replicate")
    model = plain_model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = PeriodicSyncOptimizer(inner, model, comm, method(**copy.deepcopy(options)))
    ranks = mesh["shard"].mesh.tolist()
    for step in range(steps):
        pairs = [batch(r, step) for r in ranks]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        loss_on(model, x, y).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
    opt.finish()
    return [p.detach().clone() for p in model.parameters()]


def sharded_and_reference(method: Method, options: dict[str, Any], steps: int) -> dict[str, Any]:
    out = sharded_run(method, options, steps)
    reference = unsharded_reference(method, options, steps)
    out["error"] = max(
        float((got - want).abs().max())
        for got, want in zip(out.pop("full"), reference, strict=True)
    )
    return out


#: Each method, and the shards' bytes it hands the replica group at each of 9 steps, in
#: multiples of this rank's shards (None: not whole multiples, checked otherwise below).
METHODS: list[tuple[Method, dict[str, Any], list[int] | None]] = [
    (diloco, {"H": 3}, [0, 0, 1] * 3),
    (local_sgd, {"H": 3}, [0, 0, 1] * 3),
    # Two steps of averaged gradients, then an exchange every 3 steps.
    (post_local_sgd, {"H": 3, "warmup_steps": 2}, [1, 1, 0, 0, 1, 0, 0, 1, 0]),
    # Two fragments, each exchanged twice, in the background (landing in the following step).
    (streaming_diloco, {"H": 4, "num_fragments": 2, "overlap_steps": 1}, None),
    (diloco, {"H": 3, "compressor": Int4(chunk_numel=8)}, None),
]


@pytest.mark.parametrize(
    ("method", "options", "pattern"),
    METHODS,
    ids=["diloco", "local-sgd", "post-local-sgd", "streaming", "diloco-int4"],
)
def test_two_replicas_of_two_shards_train_as_unsharded_replicas(
    pool: PoolFn, method: Method, options: dict[str, Any], pattern: list[int] | None
) -> None:
    steps = 9
    results = pool(4).run(sharded_and_reference, method, options, steps)
    compressed = "compressor" in options
    for rank, out in enumerate(results):
        # Rank r holds shard r % 2 of replica r // 2; the other replica's rank holds the same.
        twin = results[(rank + 2) % 4]
        assert all(torch.equal(a, b) for a, b in zip(out["shards"], twin["shards"], strict=True))
        # Each exchange hands this rank's shards (fp64) to the replica group, never the model.
        shard = out["shard_bytes"]
        if pattern is not None:
            assert out["sent"] == [k * shard for k in pattern], (out["sent"], shard)
        elif compressed:
            exchanged = [n for n in out["sent"] if n]
            assert len(exchanged) == steps // options["H"], out["sent"]
            assert all(n < shard for n in exchanged), (out["sent"], shard)
        else:
            assert sum(out["sent"]) == steps // options["H"] * shard, (out["sent"], shard)
        # Streaming's fragments cut each rank's shards, not the whole model, and a compressor
        # rounds its own chunks: the reference is whole replicas under the other methods.
        if method is not streaming_diloco and not compressed:
            assert out["error"] < 1e-10, (rank, out["error"])
        start, end = out["held_out"]
        assert end < 0.9 * start, out["held_out"]


def resume_bit_for_bit(method: Method, options: dict[str, Any]) -> bool:
    straight = sharded_run(method, options, 9)["shards"]

    mesh = mesh_2x2()
    comm = Communicator(mesh["replicate"].get_group(), name="replicate")
    model = sharded_model(mesh["shard"])
    opt = PeriodicSyncOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), model, comm, method(**copy.deepcopy(options))
    )
    train_steps(model, opt, range(5), comm)
    buffer = io.BytesIO()  # each rank saves its own shards and its own outer state
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)

    model2 = sharded_model(mesh["shard"])
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # garbage, overwritten by the checkpoint
    opt2 = PeriodicSyncOptimizer(
        torch.optim.AdamW(model2.parameters(), lr=LR),
        model2,
        comm,
        method(**copy.deepcopy(options)),
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    train_steps(model2, opt2, range(5, 9), comm)
    opt2.finish()
    resumed = [shard_of(p) for p in model2.parameters()]
    return all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


@pytest.mark.parametrize(
    ("method", "options"),
    [
        (diloco, {"H": 3}),
        (streaming_diloco, {"H": 4, "num_fragments": 2, "overlap_steps": 2, "compressor": Int4()}),
    ],
    ids=["diloco", "streaming-int4"],
)
def test_checkpoint_mid_period_resumes_bit_for_bit(
    pool: PoolFn, method: Method, options: dict[str, Any]
) -> None:
    assert pool(4).run(resume_bit_for_bit, method, options) == [True] * 4


def replicated_and_plain_average() -> float:
    """One local-SGD step (H = 1) of a module whose weight is a DTensor replicated over its
    replica's ranks and whose bias is a plain tensor, with each replica's gradient its rank:
    the largest distance from the plain average of the replicas."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    comm = Communicator(mesh["replicate"].get_group(), name="replicate")
    torch.manual_seed(0)
    model = nn.Linear(4, 8).double()  # its weight replaced by a DTensor, its bias kept
    weight = model.weight.detach().clone()
    model.weight = nn.Parameter(distribute_tensor(weight.clone(), mesh["shard"], [Replicate()]))
    opt = PeriodicSyncOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model, comm, local_sgd(H=1)
    )
    rank = float(dist.get_rank())
    model.weight.grad = distribute_tensor(
        torch.full_like(weight, rank), mesh["shard"], [Replicate()]
    )
    model.bias.grad = torch.full_like(model.bias, rank)
    bias = model.bias.detach().clone()
    opt.step()
    mean = (0.0 + 1.0) / 2  # the replicas' gradients are their ranks
    return max(
        float((shard_of(model.weight) - (weight - 0.5 * mean)).abs().max()),
        float((model.bias.detach() - (bias - 0.5 * mean)).abs().max()),
    )


def test_replicated_dtensors_and_plain_tensors_average_with_the_shards(pool: PoolFn) -> None:
    assert pool(2).run(replicated_and_plain_average) == [0.0, 0.0]


# -- inputs refused, each named ---------------------------------------------------------------
def refusal_of(layout: str) -> str:
    """The ValueError's message for a module laid out as ``layout`` (or "accepted")."""
    rank = dist.get_rank()
    model: nn.Module = plain_model()
    comm = Communicator()
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "ddp-inside-replica":  # DDP over this rank alone: the exchange is not doubled
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        model = nn.parallel.DistributedDataParallel(model, process_group=groups[rank])
    elif layout == "fsdp1":  # its flat parameters differ between the group's ranks
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif layout == "shard-dim-1":
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        columns = lambda p: Shard(1) if p.ndim == 2 else None  # noqa: E731
        fully_shard(model, mesh=mesh["shard"], shard_placement_fn=columns)
        comm = Communicator(mesh["replicate"].get_group())
    elif layout == "sharded-over-the-group":  # the world group holds the other shard
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    elif layout == "hsdp":  # FSDP2 would average across replicas at every step
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        comm = Communicator(mesh["replicate"].get_group())
    elif layout == "selsync-sharded":  # a method that decides when: whole parameters only
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        comm = Communicator(mesh["replicate"].get_group())
    try:
        inner = torch.optim.AdamW(model.parameters())
        if layout == "selsync-sharded":
            SelSyncConfig().make_optimizer(inner, model, comm)
        else:
            PeriodicSyncOptimizer(inner, model, comm, diloco(H=2))
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ("ddp", ["DistributedDataParallel", "ddp.module", "accelerator.prepare(loader)"]),
        ("ddp-inside-replica", ["accepted"]),
        ("fsdp1", ["FullyShardedDataParallel over ranks [0, 1]", "fully_shard"]),
        ("shard-dim-1", ["'0.weight'", "Shard(dim=1)", "Shard(0)"]),
        ("sharded-over-the-group", ["'0.weight'", "mesh['replicate']"]),
        ("hsdp", ["'0.weight'", "HSDP", "fully_shard(module, mesh=mesh['shard'])"]),
        ("selsync-sharded", ["selsync", "'0.weight'", "diloco"]),
    ],
)
def test_inputs_the_exchange_cannot_handle_are_refused_by_name(
    pool: PoolFn, layout: str, named: list[str]
) -> None:
    for message in pool(2).run(refusal_of, layout):
        for word in named:
            assert word in message, message
