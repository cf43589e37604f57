"""AllGather + GEMM and GEMM + ReduceScatter: the linear layers of sequence parallelism, fused.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198) keeps the activations between tensor-parallel blocks
sharded along the sequence: rank ``r`` holds rows ``S_r`` of ``x``. A column-parallel linear
then needs the whole sequence (AllGather, then GEMM with its output-feature shard ``W_r``), and
a row-parallel linear produces partial sums of the whole sequence that each rank needs only its
rows of (GEMM, then ReduceScatter). Unfused, each collective waits for (or blocks) the GEMM.

Fused, ring-ordered (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942; the same
decomposition as Wang et al., "Overlap Communication with Dependent Computation via
Decomposition", ASPLOS 2023):

* **AllGather + GEMM** ``y = AG(x) @ W^T``: for ``s = 0 .. P-1``, rank ``r`` holds the shard of
  rank ``r - s``; it posts the send of that shard to ``r + 1`` and the receive of shard
  ``r - s - 1`` from ``r - 1``, then computes ``y[rows of r - s]`` while they travel. ``P - 1``
  messages, exactly a ring all-gather's bytes.
* **GEMM + ReduceScatter** ``z_r = sum_i (a_i @ W_i^T)[rows of r]``: the partial sum of block
  ``j`` starts on rank ``j + 1`` and travels the ring to ``j``; at step ``s`` rank ``r`` computes
  its partial of block ``j = r - 1 - s`` (while the running sum of that block arrives from
  ``r - 1``), adds it and sends it on. At the last step ``j = r``: the result. ``P - 1`` messages,
  exactly a ring reduce-scatter's bytes. Sums run in ring order, so they are not bitwise those
  of gloo's reduce-scatter except on integer-valued inputs.

Uneven sequences: ``splits[j]`` rows live on rank ``j`` (any non-negative numbers; empty shards
send nothing). ``chunks=1`` runs the unfused reference, ``chunks >= 2`` the ring (one shard per
step: ``P`` pieces).

Backward (gradient semantics). The backward of an AllGather is a ReduceScatter and vice versa:

* ``y = AG(x) @ W^T``: ``grad_x = RS(grad_y @ W)``, itself a GEMM + ReduceScatter (the same ring,
  fused), and ``grad_W = grad_y^T @ AG(x)``, local (the forward keeps the gathered ``x``).
* ``z = RS(a @ W^T)``: ``(grad_a, AG(grad_z)) = AllGather + GEMM of grad_z with W`` (the ring,
  fused), and ``grad_W = AG(grad_z)^T @ a``, local.
"""

from __future__ import annotations

import time

import torch

from commfuse.comm import Communicator, Handle
from commfuse.fused import baselines
from commfuse.fused.chunking import elapsed_us

#: Stats labels of the rings' point-to-point traffic (exact bytes and messages).
LABEL_AG = "all_gather_gemm"
LABEL_RS = "gemm_reduce_scatter"


def check_splits(
    comm: Communicator, splits: list[int] | None, rows: int, *, local: bool
) -> list[int]:
    """The rows per rank (``splits``, or equal shards); ValueError naming the problem.

    ``local``: ``rows`` is this rank's shard (AllGather input) rather than the whole sequence."""
    world = comm.world_size
    if splits is None:
        if local:
            return [rows] * world
        base, extra = divmod(rows, world)
        return [base + (1 if i < extra else 0) for i in range(world)]
    splits = [int(s) for s in splits]
    if len(splits) != world or any(s < 0 for s in splits):
        raise ValueError(f"splits needs {world} non-negative entries (rows per rank), got {splits}")
    want = splits[comm.rank] if local else sum(splits)
    if rows != want:
        where = f"rank {comm.rank}'s shard" if local else "the sequence"
        raise ValueError(f"{where} has {rows} rows but splits {splits} says {want}")
    return splits


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{what}: need x [rows, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"{what}: x is {x.dtype} but weight is {weight.dtype}; cast one of them")


def _starts(splits: list[int]) -> list[int]:
    out, total = [], 0
    for s in splits:
        out.append(total)
        total += s
    return out


def all_gather_gemm(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    chunks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AG(x) @ weight^T, AG(x))`` for this rank's shard ``x`` [S_r, K] and weight [N_r, K]
    (module docstring): the ring when ``chunks >= 2``, else the unfused reference."""
    _check_gemm(x, weight, "all_gather_gemm")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    splits = check_splits(comm, splits, x.shape[0], local=True)
    if chunks == 1 or comm.world_size == 1:
        return all_gather_gemm_reference(comm, x, weight, splits=splits)
    rank, world = comm.rank, comm.world_size
    starts = _starts(splits)
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
                handles.append(comm.irecv(block, left, tag=s, label=LABEL_AG))
            if splits[src]:
                handles.append(comm.isend(gathered[rows], right, tag=s, label=LABEL_AG))
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
    algo: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused: one AllGather (shards padded to the longest; ``algo`` of
    ``commfuse.collectives.all_gather``, "ring" counts exact bytes), then the whole GEMM."""
    from commfuse.collectives import all_gather

    _check_gemm(x, weight, "all_gather_gemm")
    splits = check_splits(comm, splits, x.shape[0], local=True)
    longest = max(splits)
    padded = x.new_zeros((longest, x.shape[1]))
    padded[: x.shape[0]].copy_(x)
    out = x.new_empty((comm.world_size * longest, x.shape[1]))
    all_gather(comm, out, padded, algo=algo or baselines.SEQUENCE)
    gathered = torch.cat([out[j * longest : j * longest + n] for j, n in enumerate(splits)])
    return torch.matmul(gathered, weight.t()), gathered


def gemm_reduce_scatter(
    comm: Communicator,
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: list[int] | None = None,
    chunks: int = 2,
    label: str = LABEL_RS,
) -> torch.Tensor:
    """``RS(a @ weight^T)``: this rank's rows [S_r, N] of the sum over ranks, for the whole
    sequence ``a`` [S, K_r] and weight [N, K_r] (module docstring). ``label`` names the ring's
    messages in ``comm.stats`` (GEMM + AllReduce runs this ring under its own)."""
    _check_gemm(a, weight, "gemm_reduce_scatter")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    splits = check_splits(comm, splits, a.shape[0], local=False)
    if chunks == 1 or comm.world_size == 1:
        return gemm_reduce_scatter_reference(comm, a, weight, splits=splits)
    rank, world = comm.rank, comm.world_size
    starts = _starts(splits)
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

    _check_gemm(a, weight, "gemm_reduce_scatter")
    splits = check_splits(comm, splits, a.shape[0], local=False)
    full = torch.matmul(a, weight.t())
    longest, starts = max(splits), _starts(splits)
    padded = a.new_zeros((comm.world_size * longest, weight.shape[0]))
    for j, n in enumerate(splits):
        padded[j * longest : j * longest + n].copy_(full[starts[j] : starts[j] + n])
    out = a.new_empty((longest, weight.shape[0]))
    reduce_scatter(comm, out, padded, algo=algo or baselines.SEQUENCE)
    return out[: splits[comm.rank]].clone()


def all_gather_gemm_backward(
    comm: Communicator,
    grad_y: torch.Tensor,
    gathered: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight): ``RS(grad_y @ W)`` on the fused ring, ``grad_y^T @ AG(x)`` local."""
    grad_y = grad_y.contiguous()
    grad_x = gemm_reduce_scatter(comm, grad_y, weight.t(), splits=splits, chunks=chunks)
    return grad_x, torch.matmul(grad_y.t(), gathered)


def gemm_reduce_scatter_backward(
    comm: Communicator,
    grad_z: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_a, grad_weight): ``AG(grad_z) @ W`` on the fused ring, then ``AG(grad_z)^T @ a``."""
    grad_a, gathered = all_gather_gemm(
        comm, grad_z.contiguous(), weight.t().contiguous(), splits=splits, chunks=chunks
    )
    return grad_a, torch.matmul(gathered.t(), a)


def measure_all_gather_gemm(
    comm: Communicator, x: torch.Tensor, weight: torch.Tensor, splits: list[int]
) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: the AllGather alone, then the whole GEMM."""
    from commfuse.collectives import all_gather

    longest = max(splits)
    padded = x.new_zeros((longest, x.shape[1]))
    out = x.new_empty((comm.world_size * longest, x.shape[1]))
    start = time.perf_counter()
    all_gather(comm, out, padded, algo=baselines.SEQUENCE)  # what the unfused reference calls
    comm_us = elapsed_us(start)
    start = time.perf_counter()
    torch.matmul(out[: sum(splits)], weight.t())
    return elapsed_us(start), comm_us


def measure_gemm_reduce_scatter(
    comm: Communicator, a: torch.Tensor, weight: torch.Tensor, splits: list[int]
) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: the whole GEMM, then the ReduceScatter alone."""
    from commfuse.collectives import reduce_scatter

    start = time.perf_counter()
    torch.matmul(a, weight.t())
    compute_us = elapsed_us(start)
    longest = max(splits)
    out = a.new_empty((longest, weight.shape[0]))
    padded = a.new_zeros((comm.world_size * longest, weight.shape[0]))
    start = time.perf_counter()
    reduce_scatter(comm, out, padded, algo=baselines.SEQUENCE)  # what the unfused reference calls
    return compute_us, elapsed_us(start)
