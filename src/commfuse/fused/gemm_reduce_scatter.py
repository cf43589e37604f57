"""GEMM + ReduceScatter, fused: the row-parallel linear of sequence parallelism.

``z_r = sum_i (a_i @ W_i^T)[rows of r]`` for the whole sequence ``a`` [S, K_r] and input-feature
shard ``W`` [N, K_r] (Korthikanti et al., arXiv 2205.05198; layout in ``sequence_parallel.py``).
Ring-ordered (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942; Wang et al.,
ASPLOS 2023): the partial sum of block ``j`` starts on rank ``j + 1`` and travels the ring to
``j``.

1. At step ``s`` rank ``r`` computes its partial of block ``j = r - 1 - s`` while the running
   sum of that block arrives from ``r - 1``;
2. adds the two and sends the sum on to ``r + 1``;
3. at the last step ``j = r``: the result.

Cost: ``P - 1`` messages, exactly a ring reduce-scatter's bytes. Sums run in ring order, so
they are not bitwise those of gloo's reduce-scatter except on integer-valued inputs.
``chunks=1`` runs the unfused reference (the whole GEMM, then one ReduceScatter),
``chunks >= 2`` the ring (``P`` pieces).

Backward: ``(grad_a, AG(grad_z)) = AllGather + GEMM of grad_z with W`` (``all_gather_gemm.py``,
fused), and ``grad_W = AG(grad_z)^T @ a``, local.
"""

from __future__ import annotations

import torch

from commfuse.comm import Communicator, Handle
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.sequence_parallel import check_gemm, check_splits, starts_of

#: Stats label of the ring's point-to-point traffic (exact bytes and messages).
LABEL = "gemm_reduce_scatter"


def gemm_reduce_scatter(
    comm: Communicator,
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    chunks: int = 2,
    label: str = LABEL,
) -> torch.Tensor:
    """``RS(a @ weight^T)``: this rank's rows [S_r, N] of the sum over ranks, for the whole
    sequence ``a`` [S, K_r] and weight [N, K_r] (module docstring). ``label`` names the ring's
    messages in ``comm.stats`` (GEMM + AllReduce runs this ring under its own)."""
    check_gemm(a, weight, "gemm_reduce_scatter")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    splits = check_splits(comm, splits, a.shape[0], local=False)
    if chunks == 1 or comm.world_size == 1:
        return gemm_reduce_scatter_reference(comm, a, weight, splits=splits)
    rank, world = comm.rank, comm.world_size
    starts = starts_of(splits)
    right, left = (rank + 1) % world, (rank - 1) % world
    w_t = weight.t()
    sends: list[Handle] = []
    incoming: tuple[Handle, torch.Tensor] | None = None
    partial = torch.empty(0, device=a.device)
    for s in range(world):
        j = (rank - 1 - s) % world
        if s < world - 1:
            nxt = (j - 1) % world  # the running sum my left neighbour sends me next
            buf = a.new_empty((splits[nxt], weight.shape[0]))
            pending = incoming
            incoming = (comm.irecv(buf, left, tag=s, label=label), buf) if splits[nxt] else None
        else:
            pending = incoming
        partial = torch.matmul(a[starts[j] : starts[j] + splits[j]], w_t)  # while the sum arrives
        if s > 0 and pending is not None:
            pending[0].wait()
            partial = pending[1].add_(partial)  # running sum (ranks j+1 .. r-1) + mine
        if s < world - 1 and splits[j]:
            sends.append(comm.isend(partial, right, tag=s, label=label))
    for handle in sends:
        handle.wait()
    return partial


def gemm_reduce_scatter_reference(
    comm: Communicator,
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    algo: str | None = None,
) -> torch.Tensor:
    """Unfused: the whole GEMM, then one ReduceScatter (blocks padded to the longest)."""
    from commfuse.collectives import reduce_scatter

    check_gemm(a, weight, "gemm_reduce_scatter")
    splits = check_splits(comm, splits, a.shape[0], local=False)
    full = torch.matmul(a, weight.t())
    longest, starts = max(splits), starts_of(splits)
    padded = a.new_zeros((comm.world_size * longest, weight.shape[0]))
    for j, n in enumerate(splits):
        padded[j * longest : j * longest + n].copy_(full[starts[j] : starts[j] + n])
    out = a.new_empty((longest, weight.shape[0]))
    reduce_scatter(comm, out, padded, algo=algo or baselines.SEQUENCE)
    return out[: splits[comm.rank]].clone()


def gemm_reduce_scatter_backward(
    comm: Communicator,
    grad_z: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_a, grad_weight): ``AG(grad_z) @ W`` on the fused ring, then ``AG(grad_z)^T @ a``."""
    from commfuse.fused.all_gather_gemm import all_gather_gemm

    grad_a, gathered = all_gather_gemm(
        comm, grad_z.contiguous(), weight.t().contiguous(), splits=splits, chunks=chunks
    )
    return grad_a, torch.matmul(gathered.t(), a)


def measure_gemm_reduce_scatter(
    comm: Communicator, a: torch.Tensor, weight: torch.Tensor, splits: list[int]
) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: the whole GEMM, then the ReduceScatter alone."""
    from commfuse.collectives import reduce_scatter

    start = now(comm.device)
    torch.matmul(a, weight.t())
    compute_us = elapsed_us(start, comm.device)
    longest = max(splits)
    out = a.new_empty((longest, weight.shape[0]))
    padded = a.new_zeros((comm.world_size * longest, weight.shape[0]))
    start = now(comm.device)
    reduce_scatter(comm, out, padded, algo=baselines.SEQUENCE)  # what the unfused reference calls
    return compute_us, elapsed_us(start, comm.device)
