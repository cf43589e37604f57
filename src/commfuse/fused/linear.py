"""Megatron's tensor-parallel linear pair, each collective fused with the GEMM beside it.

Megatron-LM (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", arXiv 1909.08053) splits a transformer's MLP and attention into a
``ColumnParallelLinear`` (rank ``r`` keeps rows ``out_range`` of the ``[out, in]`` weight: output
features sharded) followed by a ``RowParallelLinear`` (columns ``in_range``: input features
sharded, partial products summed over ranks). Per block that is one collective in forward and
one in backward, which SC24's decomposition (Punniyamurthy, Hamidouche and Beckmann, arXiv
2305.06942) overlaps with the GEMM that produces or consumes it:

=================  ==========================================  ==========================================
layer              ``sequence_parallel=False``                 ``sequence_parallel=True`` (Korthikanti
                                                               et al., arXiv 2205.05198)
=================  ==========================================  ==========================================
Column forward     local GEMM on the replicated ``x``          AllGather + GEMM of the sequence shards
Column backward    GEMM + AllReduce of ``grad_x``              GEMM + ReduceScatter of ``grad_x``
Row forward        GEMM + AllReduce, replicated output         GEMM + ReduceScatter, sequence shards
Row backward       local GEMM                                  AllGather + GEMM of ``grad_z``
=================  ==========================================  ==========================================

Sequence-parallel activations are sequence-first (``[S, ...]``, Megatron's ``[s, b, h]``): rank
``r`` holds rows ``S_r`` of the sequence, every leading dimension after the first is flattened
into rows, and ``forward(x, splits)`` takes ``S_r`` of every rank (None: equal shards).

Design notes: ``docs/fused.md``, "The tensor-parallel linear pair: which fused operator serves
which".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from commfuse.comm import Communicator, check_consistent
from commfuse.fused import all_gather_gemm as agg
from commfuse.fused import baselines
from commfuse.fused import gemm_all_reduce as gar
from commfuse.fused import gemm_reduce_scatter as grs
from commfuse.fused.chunking import ChunkConfig, agree_chunks, measure_overhead_us
from commfuse.fused.modules import sharded_linear
from commfuse.fused.ops import (
    all_gather_gemm_op,
    gemm_all_reduce_op,
    gemm_reduce_scatter_op,
)
from commfuse.fused.sequence_parallel import check_splits

#: ``(compute_us, comm_us)`` of one unfused run of a sequence-parallel ring's operator, its
#: collective run with the given algorithm.
Measure = Callable[[Communicator, torch.Tensor, torch.Tensor, list[int], str], tuple[float, float]]


class _TensorParallel(nn.Module):
    """What both layers share: the communicator (its operators take ``comm.key``), the sharded weight
    (``_along``: the features it is sharded on), and the number of chunks per input shape."""

    _along: ClassVar[str]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        along = self._along
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.chunk_config = chunk_config or ChunkConfig()
        self.chunk_config.require_chunks(type(self).__name__, reference_algo=sequence_parallel)
        shard, self.weight, self.bias = sharded_linear(
            in_features, out_features, comm, along=along, bias=bias, dtype=dtype, seed=seed
        )
        if along == "out":
            self.out_range = shard
        else:
            self.in_range = shard
        self._chunks: dict[tuple[Any, ...], int] = {}
        self.reference_algo = self.chunk_config.reference_algo or baselines.SEQUENCE
        """The algorithm of the AllGather / ReduceScatter that the sequence-parallel unfused
        reference runs (``ChunkConfig.reference_algo``)."""

    def chosen_chunks(self) -> list[int]:
        """The number of chunks chosen so far, one per input shape seen (1: unfused)."""
        return list(self._chunks.values())

    def _check_splits(self, splits: list[int] | None) -> None:
        if splits is not None and not self.sequence_parallel:
            raise ValueError(
                f"{type(self).__name__}: splits= is for sequence_parallel=True; without "
                "sequence parallelism every rank holds the whole sequence"
            )

    def _sequence_input(
        self, x: torch.Tensor, splits: list[int] | None, *, local: bool
    ) -> tuple[list[int], int, list[int], torch.Tensor]:
        """``(splits, inner, rows, x2)`` of a sequence-first input: the sequence rows per rank,
        the elements of the dimensions between the sequence and the features, the rows per
        rank once those are flattened into rows, and ``x`` as ``[rows, features]``. ``local``:
        ``x`` is this rank's shard (else the whole sequence)."""
        if x.dim() < 2 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"x must be [{'S_r' if local else 'S'}, ..., {self.weight.shape[1]}], "
                f"got {tuple(x.shape)}"
            )
        inner = math.prod(x.shape[1:-1])
        seq = check_splits(self.comm, splits, x.shape[0], local=local)
        rows = [s * inner for s in seq]
        return seq, inner, rows, x.reshape(x.shape[0] * inner, x.shape[-1])

    def _ring_chunks(
        self,
        seq: list[int],
        inner: int,
        dtype: torch.dtype,
        width: int,
        measure: Measure,
        x2: torch.Tensor,
        rows: list[int],
    ) -> int:
        """Chunks of a sequence-parallel ring for a sequence of ``seq`` rows per rank (``width``
        features on the side every rank agrees on): ``P`` when the cost model gains at
        ``k = P`` pieces on the times ``measure(comm, x2, weight, rows, reference_algo)`` gives, agreed across
        ranks, else 1 (the unfused reference)."""
        key = (tuple(seq), inner, dtype)
        if key not in self._chunks:
            if self.chunk_config.num_chunks is not None:
                self._chunks[key] = self.chunk_config.num_chunks
            else:
                meta = torch.empty((sum(seq), inner, width), dtype=dtype, device="meta")
                check_consistent(self.comm, meta, type(self).__name__)
                with torch.no_grad():
                    compute_us, comm_us = measure(
                        self.comm, x2, self.weight, rows, self.reference_algo
                    )
                overhead = self.chunk_config.overhead_us
                if overhead is None:
                    overhead = measure_overhead_us(self.comm)
                world = self.comm.world_size
                config = ChunkConfig(max_chunks=world, min_gain=self.chunk_config.min_gain)
                k = agree_chunks(self.comm, compute_us, comm_us, overhead, config, limit=world)
                self._chunks[key] = world if k > 1 else 1
        return self._chunks[key]

    def _all_reduce_chunks(self, x: torch.Tensor, weight: torch.Tensor) -> int:
        """Chunks of the GEMM + AllReduce ``x @ weight^T`` (chosen on first use per shape)."""
        return gar.cached_chunks(self._chunks, self.comm, x, weight, self.chunk_config)


class _ColumnGemm(torch.autograd.Function):
    """``y = x @ W_r^T`` for a replicated ``x``; backward ``grad_x = sum_r grad_y_r @ W_r`` as the
    fused GEMM + AllReduce (on ``(grad_y_r, W_r^T)``); the weight gradient is local."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: ColumnParallelLinear
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        module: ColumnParallelLinear = ctx.module
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


class ColumnParallelLinear(_TensorParallel):
    """``y = x @ W_r^T + b_r``: rank ``r`` keeps rows ``out_range`` of the full ``[out, in]``
    weight and returns its output features ``[..., out_shard]``.

    Args:
        in_features: the full layer's input features.
        out_features: the full layer's output features.
        comm: the tensor-parallel group.
        sequence_parallel: ``x`` is this rank's sequence shard ``[S_r, ..., in]`` and the layer
            gathers the sequence (fused AllGather + GEMM; output ``[S, ..., out_shard]``);
            else ``x`` is replicated and the forward is local.
        bias: add a bias, as ``nn.Linear`` does.
        dtype: of the weight and bias.
        chunk_config: how the fused operators choose their chunks (module docstring).
        seed: every rank draws the same full weight from it (``full_linear_weight``) and keeps
            its shard, so the model is the single-process one at any world size.

    Raises:
        ValueError: bad sizes, an input of the wrong shape, ``splits`` that do not match.

    Example::

        col = ColumnParallelLinear(1024, 4096, comm, sequence_parallel=True)
        h = col(x_shard, splits)  # [S, batch, 4096 / P]
    """

    _along = "out"

    def chunks_for(self, grad: torch.Tensor, weight_t: torch.Tensor) -> int:
        """Chunks of the backward GEMM + AllReduce for gradients shaped like ``grad``
        (``sequence_parallel=False``; chosen on first use, as ``RowParallelLinear`` chooses its
        forward's)."""
        return self._all_reduce_chunks(grad, weight_t)

    def forward(self, x: torch.Tensor, splits: list[int] | None = None) -> torch.Tensor:
        self._check_splits(splits)
        if not self.sequence_parallel:
            if x.dim() < 1 or x.shape[-1] != self.weight.shape[1]:
                raise ValueError(f"x must be [..., {self.weight.shape[1]}], got {tuple(x.shape)}")
            y: torch.Tensor = _ColumnGemm.apply(x, self.weight, self)  # type: ignore[no-untyped-call]
            return y if self.bias is None else y + self.bias
        seq, inner, rows, x2 = self._sequence_input(x, splits, local=True)
        measure = agg.measure_all_gather_gemm
        chunks = self._ring_chunks(seq, inner, x.dtype, x.shape[-1], measure, x2, rows)
        y, _ = all_gather_gemm_op(x2, self.weight, rows, self.comm.key, chunks, self.reference_algo)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(sum(seq), *x.shape[1:-1], self.weight.shape[0])


class RowParallelLinear(_TensorParallel):
    """``y = sum_r x_r @ W[:, in_range_r]^T + b``: rank ``r`` keeps columns ``in_range`` of the
    full weight and receives its slice of ``x``'s last dimension (the output of a
    ``ColumnParallelLinear``, or ``x[..., in_range]``).

    Args:
        in_features: the full layer's input features.
        out_features: the full layer's output features.
        comm: the tensor-parallel group.
        bias: add a bias, as ``nn.Linear`` does (replicated on every rank).
        dtype: of the weight and bias.
        chunk_config: how the fused operators choose their chunks (module docstring).
        seed: every rank draws the same full weight from it, as ``ColumnParallelLinear``.
        sequence_parallel: the sum is reduce-scattered along the sequence (fused GEMM +
            ReduceScatter; ``forward(x, splits)`` with ``x`` ``[S, ..., in_shard]`` returns
            ``[S_r, ..., out]``, ``S_r`` from ``splits`` or the sequence split as evenly as
            possible, larger shards first); else it is all-reduced (fused GEMM + AllReduce)
            and every rank gets the full, replicated ``y``.

    Raises:
        ValueError: bad sizes, an input of the wrong shape, ``splits`` that do not match.

    Example::

        row = RowParallelLinear(4096, 1024, comm)
        y = row(h)  # [..., 1024] on every rank
    """

    _along = "in"

    def chunks_for(self, x: torch.Tensor) -> int:
        """The number of chunks of the forward GEMM + AllReduce for inputs shaped like ``x``
        (``sequence_parallel=False``; measured on first use)."""
        return self._all_reduce_chunks(x, self.weight)

    def forward(self, x: torch.Tensor, splits: list[int] | None = None) -> torch.Tensor:
        self._check_splits(splits)
        if not self.sequence_parallel:
            y: torch.Tensor = gemm_all_reduce_op(x, self.weight, self.comm.key, self.chunks_for(x))
            return y if self.bias is None else y + self.bias
        seq, inner, rows, a2 = self._sequence_input(x, splits, local=False)
        measure = grs.measure_gemm_reduce_scatter
        chunks = self._ring_chunks(seq, inner, x.dtype, self.weight.shape[0], measure, a2, rows)
        z: torch.Tensor = gemm_reduce_scatter_op(
            a2, self.weight, rows, self.comm.key, chunks, self.reference_algo
        )
        if self.bias is not None:
            z = z + self.bias
        return z.reshape(seq[self.comm.rank], *x.shape[1:-1], self.weight.shape[0])
