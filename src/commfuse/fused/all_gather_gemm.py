"""AllGather + GEMM, fused: the column-parallel linear of sequence parallelism.

``y = AG(x) @ W^T`` for this rank's sequence shard ``x`` [S_r, K] and output-feature shard
``W`` [N_r, K] (Korthikanti et al., arXiv 2205.05198; layout in ``sequence_parallel.py``).
Ring-ordered (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942; Wang et al.,
ASPLOS 2023):

1. Rank ``r`` copies its shard into the gathered buffer.
2. For ``s = 0 .. P-1`` it holds the shard of rank ``r - s``: it posts the send of that shard to
   ``r + 1`` and the receive of shard ``r - s - 1`` from ``r - 1``, then computes
   ``y[rows of r - s]`` while they travel.

Cost: ``P - 1`` messages, exactly a ring all-gather's bytes (``(P - 1)`` shards per rank); the
GEMM of all but the last shard hides a step's transfer. ``chunks=1`` runs the unfused reference
(one AllGather, then the whole GEMM), ``chunks >= 2`` the ring (one shard per step: ``P``
pieces).

Backward: ``grad_x = RS(grad_y @ W)``, itself a fused GEMM + ReduceScatter
(``gemm_reduce_scatter.py``), and ``grad_W = grad_y^T @ AG(x)``, local (the forward keeps the
gathered ``x``); ``ops.py`` registers it.
"""

from __future__ import annotations

import torch

from commfuse.comm import Communicator, Handle
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.sequence_parallel import check_ring, starts_of

#: Stats label of the ring's point-to-point traffic (exact bytes and messages).
LABEL = "all_gather_gemm"


def all_gather_gemm(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    chunks: int = 2,
    reference_algo: str = baselines.SEQUENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AG(x) @ weight^T, AG(x))`` for this rank's shard ``x`` [S_r, K] and weight [N_r, K]
    (module docstring): the ring when ``chunks >= 2``, else the unfused reference, whose
    AllGather runs ``reference_algo``."""
    splits = check_ring(comm, x, weight, splits, chunks, what=LABEL, local=True)
    if chunks == 1 or comm.world_size == 1:
        return all_gather_gemm_reference(comm, x, weight, splits=splits, algo=reference_algo)
    rank, world = comm.rank, comm.world_size
    starts = starts_of(splits)
    gathered = x.new_empty((sum(splits), x.shape[1]))
    y = x.new_empty((sum(splits), weight.shape[0]))
    gathered[starts[rank] : starts[rank] + splits[rank]].copy_(x)
    right, left = (rank + 1) % world, (rank - 1) % world
    w_t = weight.t()
    for s in range(world):
        src = (rank - s) % world
        rows = slice(starts[src], starts[src] + splits[src])
        handles: list[Handle] = []
        if s < world - 1:
            nxt = (rank - s - 1) % world
            if splits[nxt]:
                block = gathered[starts[nxt] : starts[nxt] + splits[nxt]]
                handles.append(comm.irecv(block, left, tag=s, label=LABEL))
            if splits[src]:
                handles.append(comm.isend(gathered[rows], right, tag=s, label=LABEL))
        torch.matmul(gathered[rows], w_t, out=y[rows])  # while the next shard travels
        for handle in handles:
            handle.wait()
    return y, gathered


def all_gather_gemm_reference(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    algo: str = baselines.SEQUENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused: one AllGather (shards padded to the longest; ``algo`` of
    ``commfuse.collectives.all_gather``, "ring" counts exact bytes), then the whole GEMM."""
    from commfuse.collectives import all_gather

    splits = check_ring(comm, x, weight, splits, 1, what=LABEL, local=True)
    longest = max(splits)
    padded = x.new_zeros((longest, x.shape[1]))
    padded[: x.shape[0]].copy_(x)
    out = x.new_empty((comm.world_size * longest, x.shape[1]))
    all_gather(comm, out, padded, algo=algo)
    gathered = torch.cat([out[j * longest : j * longest + n] for j, n in enumerate(splits)])
    return torch.matmul(gathered, weight.t()), gathered


def measure_all_gather_gemm(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    algo: str = baselines.SEQUENCE,
) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: the AllGather alone, then the whole GEMM."""
    from commfuse.collectives import all_gather

    longest = max(splits)
    padded = x.new_zeros((longest, x.shape[1]))
    out = x.new_empty((comm.world_size * longest, x.shape[1]))
    start = now(comm.device)
    all_gather(comm, out, padded, algo=algo)  # what the unfused reference calls
    comm_us = elapsed_us(start, comm.device)
    start = now(comm.device)
    torch.matmul(out[: sum(splits)], weight.t())
    return elapsed_us(start, comm.device), comm_us
