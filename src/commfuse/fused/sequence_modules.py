"""Sequence-parallel linear layers on the fused rings of ``sequence_parallel.py``:
``torch.ops.commfuse.all_gather_gemm`` / ``gemm_reduce_scatter`` (with autograd), and the modules
``ColumnParallelLinear`` (AllGather + GEMM) and ``SequenceParallelRowLinear`` (GEMM +
ReduceScatter), Megatron's pair with sequence parallelism (Korthikanti et al., arXiv 2205.05198).

Activations are sequence-first (``[S, ...]``, Megatron's ``[s, b, h]``): rank ``r`` holds rows
``S_r`` of the sequence, and every leading dimension after the first is flattened into rows, so
rank blocks stay contiguous. Each module decides once per input shape whether the ring pays
(cost model of ``fused.chunking`` with ``k = P`` pieces, on compute and communication times
measured and agreed across ranks), and otherwise runs the unfused reference;
``ChunkConfig(num_chunks=1)`` forces the reference, ``num_chunks >= 2`` the ring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from commfuse.comm import Communicator, check_consistent
from commfuse.fused import sequence_parallel as sp
from commfuse.fused.chunking import ChunkConfig, agree_chunks, measure_overhead_us
from commfuse.fused.modules import sharded_linear
from commfuse.fused.ops import communicator, register_communicator


# -- AllGather + GEMM ----------------------------------------------------------------------------
@torch.library.custom_op("commfuse::all_gather_gemm", mutates_args=())
def all_gather_gemm_op(
    x: torch.Tensor, weight: torch.Tensor, splits: list[int], comm_id: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AG(x) @ weight^T, AG(x))``; the second output (the gathered input) has no gradient."""
    y, gathered = sp.all_gather_gemm(
        communicator(comm_id), x, weight, splits=list(splits), chunks=chunks
    )
    return y, gathered


@all_gather_gemm_op.register_fake
def _all_gather_gemm_fake(
    x: torch.Tensor, weight: torch.Tensor, splits: list[int], comm_id: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(splits)
    return x.new_empty((rows, weight.shape[0])), x.new_empty((rows, x.shape[1]))


def _ag_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _, weight, splits, comm_id, chunks = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.meta = (list(splits), comm_id, chunks)
    ctx.mark_non_differentiable(output[1])


def _ag_backward(ctx: Any, grad_y: torch.Tensor, _grad_gathered: Any) -> tuple[Any, ...]:
    gathered, weight = ctx.saved_tensors
    splits, comm_id, chunks = ctx.meta
    grad_x, grad_w = sp.all_gather_gemm_backward(
        communicator(comm_id), grad_y, gathered, weight, splits, chunks
    )
    return grad_x, grad_w, None, None, None


all_gather_gemm_op.register_autograd(_ag_backward, setup_context=_ag_setup)


# -- GEMM + ReduceScatter ------------------------------------------------------------------------
@torch.library.custom_op("commfuse::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter_op(
    a: torch.Tensor, weight: torch.Tensor, splits: list[int], comm_id: int, chunks: int
) -> torch.Tensor:
    """This rank's rows of ``sum_ranks(a @ weight^T)``."""
    return sp.gemm_reduce_scatter(
        communicator(comm_id), a, weight, splits=list(splits), chunks=chunks
    )


@gemm_reduce_scatter_op.register_fake
def _gemm_reduce_scatter_fake(
    a: torch.Tensor, weight: torch.Tensor, splits: list[int], comm_id: int, chunks: int
) -> torch.Tensor:
    return a.new_empty((splits[communicator(comm_id).rank], weight.shape[0]))


def _rs_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, splits, comm_id, chunks = inputs
    ctx.save_for_backward(a, weight)
    ctx.meta = (list(splits), comm_id, chunks)


def _rs_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    a, weight = ctx.saved_tensors
    splits, comm_id, chunks = ctx.meta
    grad_a, grad_w = sp.gemm_reduce_scatter_backward(
        communicator(comm_id), grad, a, weight, splits, chunks
    )
    return grad_a, grad_w, None, None, None


gemm_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)


# -- modules -------------------------------------------------------------------------------------
class _SequenceParallel(nn.Module):
    """Shared plumbing: communicator handle, chunk choice per (shape, dtype), input checks."""

    def __init__(self, comm: Communicator, chunk_config: ChunkConfig | None) -> None:
        super().__init__()
        self.comm = comm
        self.comm_id = register_communicator(comm)
        self.chunk_config = chunk_config or ChunkConfig()
        self._chunks: dict[tuple[Any, ...], int] = {}

    def _choose(self, key: tuple[Any, ...], meta: torch.Tensor, measure: Any) -> int:
        if key not in self._chunks:
            if self.chunk_config.num_chunks is not None:
                self._chunks[key] = self.chunk_config.num_chunks
            else:
                check_consistent(self.comm, meta, type(self).__name__)
                with torch.no_grad():
                    compute_us, comm_us = measure()
                overhead = self.chunk_config.overhead_us
                if overhead is None:
                    overhead = measure_overhead_us(self.comm)
                # The ring has exactly P pieces: fused when the model gains at k = P.
                world = self.comm.world_size
                config = ChunkConfig(max_chunks=world, min_gain=self.chunk_config.min_gain)
                k = agree_chunks(self.comm, compute_us, comm_us, overhead, config, limit=world)
                self._chunks[key] = world if k > 1 else 1
        return self._chunks[key]


class ColumnParallelLinear(_SequenceParallel):
    """``y = AG(x) @ W_r^T + b_r``: the input is sharded along the sequence, the output along
    features (rank ``r`` keeps rows ``out_range`` of the full ``[out, in]`` weight). The
    AllGather of the sequence is fused with the GEMM; backward is the fused GEMM +
    ReduceScatter. ``forward(x, splits=None)``: ``x`` is ``[S_r, ..., in]``; ``splits`` lists
    ``S_r`` of every rank (None: equal shards); the output is ``[S, ..., out_shard]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(comm, chunk_config)
        self.out_range, self.weight, self.bias = sharded_linear(
            in_features, out_features, comm, along="out", bias=bias, dtype=dtype, seed=seed
        )

    def forward(self, x: torch.Tensor, splits: list[int] | None = None) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must be [S_r, ..., {self.weight.shape[1]}], got {tuple(x.shape)}")
        inner = math.prod(x.shape[1:-1])
        seq = sp.check_splits(self.comm, splits, x.shape[0], local=True)
        rows = [s * inner for s in seq]
        x2 = x.reshape(x.shape[0] * inner, x.shape[-1])
        meta = torch.empty((sum(seq), inner, x.shape[-1]), dtype=x.dtype, device="meta")
        chunks = self._choose(
            (tuple(seq), inner, x.dtype),
            meta,
            lambda: sp.measure_all_gather_gemm(self.comm, x2, self.weight, rows),
        )
        y: torch.Tensor
        y, _ = all_gather_gemm_op(x2, self.weight, rows, self.comm_id, chunks)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(sum(seq), *x.shape[1:-1], self.weight.shape[0])


class SequenceParallelRowLinear(_SequenceParallel):
    """``z_r = RS(a @ W[:, in_range]^T) + b``: the input is sharded along features (the output
    of a ColumnParallelLinear), the output along the sequence. The ReduceScatter is fused with
    the GEMM; backward is the fused AllGather + GEMM. ``forward(a, splits=None)``: ``a`` is
    ``[S, ..., in_shard]``; the output is ``[S_r, ..., out]`` with ``S_r`` from ``splits``
    (None: the sequence split as evenly as possible, larger shards first)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(comm, chunk_config)
        self.in_range, self.weight, self.bias = sharded_linear(
            in_features, out_features, comm, along="in", bias=bias, dtype=dtype, seed=seed
        )

    def forward(self, a: torch.Tensor, splits: list[int] | None = None) -> torch.Tensor:
        if a.dim() < 2 or a.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"a must be [S, ..., {self.weight.shape[1]}], got {tuple(a.shape)}")
        inner = math.prod(a.shape[1:-1])
        seq = sp.check_splits(self.comm, splits, a.shape[0], local=False)
        rows = [s * inner for s in seq]
        a2 = a.reshape(a.shape[0] * inner, a.shape[-1])
        meta = torch.empty((sum(seq), inner, self.weight.shape[0]), dtype=a.dtype, device="meta")
        chunks = self._choose(
            (tuple(seq), inner, a.dtype),
            meta,
            lambda: sp.measure_gemm_reduce_scatter(self.comm, a2, self.weight, rows),
        )
        z: torch.Tensor = gemm_reduce_scatter_op(a2, self.weight, rows, self.comm_id, chunks)
        if self.bias is not None:
            z = z + self.bias
        return z.reshape(seq[self.comm.rank], *a.shape[1:-1], self.weight.shape[0])
