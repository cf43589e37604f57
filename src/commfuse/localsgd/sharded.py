"""Sharded replicas: the periodic methods over FSDP2 (DTensor) parameters, in HSDP's layout.

Each replica is sharded by FSDP2 (``fully_shard``) over its own ranks, and the ranks that hold
the same shard in every replica form the replica group (Douillard et al., "INTELLECT-1", 2024;
torchft's HSDP): a 2-D device mesh ``replicate x shard`` gives both, ``mesh["shard"]`` to
``fully_shard`` and ``mesh["replicate"]`` to the ``Communicator`` of ``PeriodicSyncOptimizer``.

1. Each rank reads its local shard of every parameter (``DTensor.to_local()``, a view).
2. The periodic machinery (anchors, outer momenta, a compressor's error feedback) runs on those
   shards alone, so the outer state is sharded like the parameters, and a checkpoint is each
   rank's own ``state_dict()``.
3. An exchange averages a rank's shards with the same shards on the other replicas: each rank
   hands 1/S of the model (S shards) to the replica group per synchronisation.

Inputs that would be silently wrong are refused with a ``ValueError`` that names them: a module
wrapped in ``DistributedDataParallel`` over ranks of the exchange group (DDP would average the
gradients every step besides the periodic exchange) or in FSDP1 (its flat parameters hold
different shards on those ranks), a DTensor placement other than ``Shard(0)``
or ``Replicate()``, and a DTensor whose mesh shares ranks with the exchange group (the group
would mix different shards, or FSDP2's HSDP would already average them every step).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from commfuse import collectives
from commfuse.comm import Communicator


def _dtensor_type() -> type | None:
    """``DTensor``, or None when its module was never imported (then no tensor is one; the
    import is slow, and a model without DTensors need not pay for it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 or tensor-parallel parameter)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, detached: a DTensor's local shard (a view: writing into it
    writes the parameter), a plain tensor itself. Read anew at each use, since FSDP2 may
    re-point a parameter's local tensor (``load_state_dict(assign=True)``)."""
    local = tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    return local.detach()


def refuse_sharded(module: nn.Module, method: str) -> None:
    """Raise ``ValueError`` naming the first DTensor parameter of ``module``: ``method`` (a
    method that decides when to synchronise) reads whole parameters and gradients."""
    for name, p in module.named_parameters():
        if is_sharded(p):
            raise ValueError(
                f"{method} takes unsharded replicas, and parameter {name!r} is a DTensor "
                "(FSDP2): sharded replicas run with local_sgd, diloco or streaming_diloco"
            )


def _ranks_of(comm: Communicator) -> set[int]:
    return {comm.global_rank(r) for r in range(comm.world_size)}


def refuse_data_parallel(module: nn.Module, comm: Communicator) -> None:
    """Raise ``ValueError`` when ``module`` is (or holds) a ``DistributedDataParallel`` or an
    FSDP1 ``FullyShardedDataParallel`` whose group shares ranks with ``comm``. DDP all-reduces
    the gradients at every step and the periodic exchange averages the replicas again, so
    nothing is saved and nothing says so; FSDP1's flat parameters hold a different shard on
    each rank of its group, which the exchange would average together. Either inside each
    replica (its group disjoint from ``comm`` but for this rank) is allowed."""
    fsdp1 = sys.modules.get("torch.distributed.fsdp")
    kinds = (torch.nn.parallel.DistributedDataParallel,) + (
        () if fsdp1 is None else (fsdp1.FullyShardedDataParallel,)
    )
    wrappers = [m for m in module.modules() if isinstance(m, kinds)]
    if not wrappers:
        return
    me = comm.global_rank_of_self
    replicas = _ranks_of(comm) - {me}
    for wrapper in wrappers:
        ranks = set(torch.distributed.get_process_group_ranks(wrapper.process_group))
        if not ranks & replicas:
            continue
        what = (
            f"a module wrapped in {type(wrapper).__name__} over ranks {sorted(ranks)}, which "
            f"also exchange in the periodic group (ranks {sorted(replicas | {me})})"
        )
        if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"PeriodicSyncOptimizer got {what}: DDP would all-reduce the gradients at "
                "every step and DiLoCo would average the replicas again every H steps, so no "
                "communication is saved. Pass the unwrapped module (ddp.module) and an inner "
                "optimizer over its parameters; with Accelerate, prepare only the data loader "
                "(accelerator.prepare(loader)), not the model."
            )
        raise ValueError(
            f"PeriodicSyncOptimizer got {what}: the exchange would average different shards "
            "of its flat parameters. Shard each replica with FSDP2 over its own ranks "
            "(fully_shard(module, mesh=mesh['shard'])) and pass "
            "Communicator(mesh['replicate'].get_group())."
        )


def check_shards(named: Sequence[tuple[str, torch.Tensor]], comm: Communicator) -> None:
    """Raise ``ValueError`` for a DTensor parameter the exchange cannot average shard by shard:
    a placement other than ``Shard(0)`` or ``Replicate()``, or a mesh that shares ranks with
    ``comm`` besides this rank; then check that every rank of ``comm`` holds the same shards
    (two small integer all-reduces, only when there are DTensors)."""
    sharded = [(name, p) for name, p in named if is_sharded(p)]
    if not sharded:
        return
    from torch.distributed.tensor import Replicate, Shard

    replicas = _ranks_of(comm) - {comm.global_rank_of_self}
    shard_index: list[int] = []
    for name, p in sharded:
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        for placement in placements:
            if placement != Shard(0) and not isinstance(placement, Replicate):
                raise ValueError(
                    f"parameter {name!r} is a DTensor placed {placement} (placements "
                    f"{tuple(placements)}): the periodic exchange averages local shards and "
                    "takes only Shard(0) (fully_shard's default) and Replicate() placements"
                )
        shared = set(mesh.mesh.flatten().tolist()) & replicas
        if shared:
            raise ValueError(
                f"parameter {name!r} is a DTensor on a mesh of ranks {mesh.mesh.tolist()}, and "
                f"ranks {sorted(shared)} of that mesh are also in the periodic exchange group: "
                "the exchange must run between replicas only, the same shard on every rank of "
                "the group. Shard each replica over its own ranks (fully_shard(module, "
                "mesh=mesh['shard'])) and pass Communicator(mesh['replicate'].get_group()); a "
                "2-D (HSDP) mesh in fully_shard would average the gradients across replicas at "
                "every step besides the periodic exchange"
            )
        # The shard this rank holds: its place along the mesh's sharded dimensions.
        coordinate = mesh.get_coordinate() or [0] * len(placements)
        shard_index.append(
            sum(c for c, pl in zip(coordinate, placements, strict=True) if pl == Shard(0))
        )
        shard_index.append(local_view(p).numel())
    device = local_view(sharded[0][1]).device
    _check_same_shards(comm, shard_index, [name for name, _ in sharded], device)


def _check_same_shards(
    comm: Communicator, mine: list[int], names: list[str], device: torch.device
) -> None:
    """Raise ``ValueError`` unless every rank of ``comm`` holds the same shard (index and size)
    of every DTensor parameter ``names``: an exchange between different shards averages
    unrelated values, or hangs on different sizes."""
    if comm.world_size == 1:
        return
    high = torch.tensor(mine, dtype=torch.int64, device=device)
    low = high.clone()
    collectives.all_reduce(comm, high, "max", algo="native")
    collectives.all_reduce(comm, low, "min", algo="native")
    differ = (high != low).nonzero().flatten().tolist()
    if differ:
        name = names[differ[0] // 2]
        raise ValueError(
            f"the ranks of the periodic exchange group hold different shards of parameter "
            f"{name!r} (shard index or size differs): each rank of the group must hold the "
            "same shard in its own replica; build the group from the mesh's replicate "
            "dimension (mesh['replicate'].get_group())"
        )
