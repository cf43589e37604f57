"""Sequence parallelism's shard layout, shared by its two fused rings (``all_gather_gemm.py``,
``gemm_reduce_scatter.py``).

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198) keeps the activations between tensor-parallel blocks
sharded along the sequence: rank ``r`` holds rows ``S_r`` of ``x``. A column-parallel linear
then needs the whole sequence (AllGather, then GEMM with its output-feature shard ``W_r``), and
a row-parallel linear produces partial sums of the whole sequence that each rank needs only its
rows of (GEMM, then ReduceScatter). Unfused, each collective waits for (or blocks) the GEMM;
fused, each runs as a ring whose steps overlap the GEMM of the shard at hand (Punniyamurthy,
Hamidouche and Beckmann, SC24, arXiv 2305.06942; the same decomposition as Wang et al.,
"Overlap Communication with Dependent Computation via Decomposition", ASPLOS 2023).

Uneven sequences: ``splits[j]`` rows live on rank ``j`` (any non-negative numbers; empty shards
send nothing). The backward of an AllGather is a ReduceScatter and vice versa, so each ring's
backward is the other ring.
"""

from __future__ import annotations

import torch

from commfuse.comm import Communicator


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


def check_gemm(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{what}: need x [rows, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"{what}: x is {x.dtype} but weight is {weight.dtype}; cast one of them")


def check_ring(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int] | None,
    chunks: int,
    *,
    what: str,
    local: bool,
) -> list[int]:
    """The checks both rings make of their inputs (``check_gemm``, ``chunks >= 1``,
    ``check_splits``); returns the rows per rank."""
    check_gemm(x, weight, what)
    if chunks < 1:
        raise ValueError(f"{what}: chunks must be >= 1, got {chunks}")
    return check_splits(comm, splits, x.shape[0], local=local)


def starts_of(splits: list[int]) -> list[int]:
    out, total = [], 0
    for s in splits:
        out.append(total)
        total += s
    return out
