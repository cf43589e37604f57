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
fused), and ``grad_W = AG(grad_z)^T @ a``, local; ``ops.py`` registers it.
"""

from __future__ import annotations

import torch

from commfuse.comm import Communicator, Handle
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.sequence_parallel import check_ring, starts_of

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
    reference_algo: str = baselines.SEQUENCE,
) -> torch.Tensor:
    """``RS(a @ weight^T)``: this rank's rows [S_r, N] of the sum over ranks, for the whole
    sequence ``a`` [S, K_r] and weight [N, K_r] (module docstring): the ring when
    ``chunks >= 2``, else the unfused reference, whose ReduceScatter runs ``reference_algo``.
    ``label`` names the ring's messages in ``comm.stats`` (GEMM + AllReduce runs this ring
    under its own)."""
    splits = check_ring(comm, a, weight, splits, chunks, what=LABEL, local=False)
    if chunks == 1 or comm.world_size == 1:
        return gemm_reduce_scatter_reference(comm, a, weight, splits=splits, algo=reference_algo)
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
    algo: str = baselines.SEQUENCE,
) -> torch.Tensor:
    """Unfused: the whole GEMM, then one ReduceScatter (blocks padded to the longest; ``algo``
    of ``commfuse.collectives.reduce_scatter``)."""
    from commfuse.collectives import reduce_scatter

    splits = check_ring(comm, a, weight, splits, 1, what=LABEL, local=False)
    full = torch.matmul(a, weight.t())
    longest, starts = max(splits), starts_of(splits)
    padded = a.new_zeros((comm.world_size * longest, weight.shape[0]))
    for j, n in enumerate(splits):
        padded[j * longest : j * longest + n].copy_(full[starts[j] : starts[j] + n])
    out = a.new_empty((longest, weight.shape[0]))
    reduce_scatter(comm, out, padded, algo=algo)
    return out[: splits[comm.rank]].clone()


def measure_gemm_reduce_scatter(
    comm: Communicator,
    a: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    algo: str = baselines.SEQUENCE,
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
    reduce_scatter(comm, out, padded, algo=algo)  # what the unfused reference calls
    return compute_us, elapsed_us(start, comm.device)
