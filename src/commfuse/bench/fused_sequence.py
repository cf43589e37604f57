"""``commfuse bench fused --op all_gather_gemm,gemm_reduce_scatter``: the sequence-parallel rings.

Shapes are ``(S, K, N)``: the whole sequence ``S`` (rows split across ranks), the input
features ``K`` and the output features ``N`` of the full ``[N, K]`` weight. AllGather + GEMM
shards the output features (column-parallel: rank ``r`` gathers ``x [S, K]`` and computes
``[S, N / P]``); GEMM + ReduceScatter shards the input features (row-parallel: ``[S, K / P]``
in, ``[S / P, N]`` out). Inputs are integer-valued, so the ring's sum order gives the same bits
as gloo's and ``wrong`` must be 0. The unfused reference and ``M`` use commfuse's own choice of
collective (``algo="auto"``): gloo's reduce-scatter is an allreduce followed by a slice, so it
costs as much as the allreduce, about twice the ring reduce-scatter, and a baseline that slow
would flatter the fused ring. The fused variant is the ring (``P`` pieces); the automatic
choice falls back to the unfused reference when the cost model says the ring cannot pay.
"""

from __future__ import annotations

import torch

from commfuse.bench.fused import FusedForms
from commfuse.collectives import all_gather, reduce_scatter
from commfuse.comm import Communicator
from commfuse.fused import all_gather_gemm as agg
from commfuse.fused import baselines
from commfuse.fused import gemm_reduce_scatter as grs
from commfuse.fused.chunking import ChunkConfig, agree_chunks, measure_overhead_us, split_sizes


def sequence_case(comm: Communicator, op: str, shape: tuple[int, ...]) -> FusedForms:
    if len(shape) != 3:
        raise ValueError(f"{op} shape is (sequence, in_features, out_features), got {shape}")
    seq, k_in, n_out = shape
    world, rank, dev = comm.world_size, comm.rank, comm.device
    splits = split_sizes(seq, world)
    gen = torch.Generator().manual_seed(rank)
    if op == "all_gather_gemm":
        x = torch.randint(-2, 3, (splits[rank], k_in), generator=gen, device="cpu").float().to(dev)
        w = (
            torch.randint(
                -2, 3, (split_sizes(n_out, world)[rank], k_in), generator=gen, device="cpu"
            )
            .float()
            .to(dev)
        )
        shard = torch.zeros(max(splits), k_in, device=dev)
        gathered = torch.zeros(world * max(splits), k_in, device=dev)

        def measure() -> tuple[float, float]:
            return agg.measure_all_gather_gemm(comm, x, w, splits)

        def fused(k: int) -> torch.Tensor:
            return agg.all_gather_gemm(comm, x, w, splits=splits, chunks=k)[0]

        return FusedForms(
            compute=lambda: torch.matmul(gathered[:seq], w.t()),
            comm=lambda: all_gather(comm, gathered, shard, algo=baselines.SEQUENCE),
            unfused=lambda: agg.all_gather_gemm_reference(comm, x, w, splits=splits)[0],
            fused=fused,
            max_chunks=world,
            choose=lambda: _choose(comm, measure),
        )
    a = (
        torch.randint(-2, 3, (seq, split_sizes(k_in, world)[rank]), generator=gen, device="cpu")
        .float()
        .to(dev)
    )
    v = torch.randint(-2, 3, (n_out, a.shape[1]), generator=gen, device="cpu").float().to(dev)
    out = torch.zeros(max(splits), n_out, device=dev)
    full = torch.zeros(world * max(splits), n_out, device=dev)
    return FusedForms(
        compute=lambda: torch.matmul(a, v.t()),
        comm=lambda: reduce_scatter(comm, out, full, algo=baselines.SEQUENCE),
        unfused=lambda: grs.gemm_reduce_scatter_reference(comm, a, v, splits=splits),
        fused=lambda k: grs.gemm_reduce_scatter(comm, a, v, splits=splits, chunks=k),
        max_chunks=world,
        choose=lambda: _choose(comm, lambda: grs.measure_gemm_reduce_scatter(comm, a, v, splits)),
    )


def _choose(comm: Communicator, measure: object) -> int:
    """``P`` (the ring) when the cost model gains at ``k = P``, else 1 (the reference)."""
    assert callable(measure)
    compute_us, comm_us = measure()
    world = comm.world_size
    config = ChunkConfig(max_chunks=world)
    k = agree_chunks(comm, compute_us, comm_us, measure_overhead_us(comm), config, limit=world)
    return world if k > 1 else 1
