"""Megatron's column-parallel linear without sequence parallelism (Shoeybi et al., arXiv
1909.08053), with its backward's AllReduce fused into the GEMM that produces it (SC24).

Its input ``x`` is replicated on every rank of the tensor-parallel group; rank ``r`` keeps rows
``out_range`` of the full weight and computes its slice of the output locally (Megatron's ``f``
operator is the identity in forward). Backward, ``grad_x = sum_r grad_y_r @ W_r`` sums partial
products over ranks: a GEMM + AllReduce, run as ``gemm_all_reduce.gemm_all_reduce`` (chunk ``i``
is reduced while chunk ``i + 1`` is multiplied). The weight gradient ``grad_y_r^T x`` is local.
Paired with ``RowParallelLinear`` it makes a Megatron MLP or attention block: one fused
AllReduce in forward (the row-parallel output) and one in backward (this layer's input).
The sequence-parallel form is ``ColumnParallelLinear`` (AllGather + GEMM).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from commfuse.comm import Communicator
from commfuse.fused import gemm_all_reduce as gar
from commfuse.fused.chunking import ChunkConfig
from commfuse.fused.modules import sharded_linear


class _ColumnGemm(torch.autograd.Function):
    """``y = x @ W_r^T`` for a replicated ``x``; backward ``grad_x = sum_r grad_y_r @ W_r`` as the
    fused GEMM + AllReduce (the operator of ``RowParallelLinear``, on ``(grad_y_r, W_r^T)``)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: TensorParallelColumnLinear
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        module: TensorParallelColumnLinear = ctx.module
        rows = math.prod(x.shape[:-1])
        g2 = grad.reshape(rows, weight.shape[0])
        grad_x = None
        if ctx.needs_input_grad[0]:  # the same on every rank: all skip the collective or none
            w_t = weight.t()  # [in, out_r]: grad_y_r @ (W_r^T)^T, no copy (matmul transposes)
            grad_x = gar.gemm_all_reduce(
                module.comm, g2, w_t, chunks=module.chunks_for(g2, w_t)
            ).reshape(x.shape)
        grad_w = torch.matmul(g2.t(), x.reshape(rows, x.shape[-1]))
        return grad_x, grad_w, None


class TensorParallelColumnLinear(nn.Module):
    """Megatron's column-parallel linear without sequence parallelism: ``x`` is replicated, rank
    ``r`` keeps rows ``out_range`` of the full ``[out, in]`` weight and returns ``x @ W_r^T + b_r``
    (``[..., out_shard]``). Forward is local; backward sums the input gradients over ranks with
    the fused GEMM + AllReduce. (The sequence-parallel form is ``ColumnParallelLinear``.)"""

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
        super().__init__()
        self.comm = comm
        self.chunk_config = chunk_config or ChunkConfig()
        self.out_range, self.weight, self.bias = sharded_linear(
            in_features, out_features, comm, along="out", bias=bias, dtype=dtype, seed=seed
        )
        self._chunks: dict[tuple[int, torch.dtype], int] = {}

    def chunks_for(self, grad: torch.Tensor, weight_t: torch.Tensor) -> int:
        """Chunks of the backward GEMM + AllReduce for gradients shaped like ``grad`` (chosen on
        first use, as ``RowParallelLinear`` chooses its forward's)."""
        return gar.cached_chunks(self._chunks, self.comm, grad, weight_t, self.chunk_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must be [..., {self.weight.shape[1]}], got {tuple(x.shape)}")
        y: torch.Tensor = _ColumnGemm.apply(x, self.weight, self)  # type: ignore[no-untyped-call]
        return y if self.bias is None else y + self.bias
