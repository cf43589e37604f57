"""``ShardedEmbeddingBag``, the module of the fused embedding exchange, and the sharded weights
of the tensor-parallel linears (``linear.py``).

Each module chooses its number of chunks once per input shape: the first call with a new shape
runs the unfused operator once more, timing computation and communication apart, measures the
per-chunk overhead, and picks ``k`` from the cost model (``fused.chunking``) on times agreed
across ranks. That first call also checks that every rank passes compatible shapes. Pass
``ChunkConfig(num_chunks=k)`` to fix ``k`` instead (no measurement, no check), or
``ChunkConfig(schedule="by_table")`` for the exchange table by table.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from commfuse.comm import Communicator
from commfuse.fused import embedding_all_to_all as emb
from commfuse.fused.chunking import (
    ChunkConfig,
    ChunkSchedule,
    shard_range,
    split_sizes,
)
from commfuse.fused.ops import (
    anchor_for_backward,
    embedding_all_to_all_op,
    embedding_schedule_args,
)


def full_linear_weight(
    out_features: int, in_features: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded weight and bias every rank draws alike (nn.Linear's uniform bound), so the
    sharded model is the single-process model whatever the world size; each rank keeps its
    slice."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    # the CPU generator: the same weights on every device (the module moves them)
    weight = (torch.rand((out_features, in_features), generator=gen, device="cpu") * 2 - 1) * bound
    bias = (torch.rand(out_features, generator=gen, device="cpu") * 2 - 1) * bound
    return weight, bias


def check_linear_features(in_features: int, out_features: int) -> None:
    """ValueError unless both sizes of a linear layer are positive."""
    if in_features < 1 or out_features < 1:
        raise ValueError(
            f"in_features and out_features must be >= 1, got {in_features}, {out_features}"
        )


def sharded_linear(
    in_features: int,
    out_features: int,
    comm: Communicator,
    *,
    along: str,
    bias: bool,
    dtype: torch.dtype,
    seed: int,
) -> tuple[tuple[int, int], nn.Parameter, nn.Parameter | None]:
    """This rank's ``(range, weight, bias)`` of the linear ``full_linear_weight(out, in, seed)``:
    ``along="out"`` (column-parallel) keeps rows ``range`` of the weight and of the bias,
    ``along="in"`` (row-parallel) columns ``range`` of the weight and the whole bias."""
    check_linear_features(in_features, out_features)
    weight, b = full_linear_weight(out_features, in_features, seed)
    if along == "out":
        start, stop = shard_range(out_features, comm.world_size, comm.rank)
        shard, kept = weight[start:stop], b[start:stop]
    elif along == "in":
        start, stop = shard_range(in_features, comm.world_size, comm.rank)
        shard, kept = weight[:, start:stop], b
    else:
        raise ValueError(f"along must be 'out' or 'in', got {along!r}")
    return (
        (start, stop),
        nn.Parameter(shard.to(dtype).contiguous()),
        nn.Parameter(kept.to(dtype)) if bias else None,
    )


class ShardedEmbeddingBag(nn.Module):
    """``T`` pooled embedding tables sharded table-wise (table ``t`` on rank ``t % P``), whose
    lookups for the global batch are fused with the All-to-All that gives each rank every table
    for its own samples (DLRM's model-parallel to data-parallel switch).

    ``forward(indices, offsets, batch_splits)`` takes, for each *local* table (``local_tables``
    lists their global ids), the EmbeddingBag inputs of the global batch, and returns
    ``[B_r, T, D]`` with tables in global order.

    Args:
        num_embeddings: the rows of each table, in global table order.
        embedding_dim: the width D of every table.
        comm: the model-parallel group the tables are sharded over.
        mode: the pooling of a bag, as ``nn.EmbeddingBag``'s (``"sum"``, ``"mean"``).
        dtype: the tables' dtype.
        chunk_config: how the fused lookup + All-to-All chooses its chunks or its by-table
            schedule; None: measured and chosen on first use.
        seed: every rank draws the same full tables from it and keeps its own, so the model is
            the single-process one at any world size.

    Raises:
        ValueError: no table, a table or ``embedding_dim`` under 1, or an unknown ``mode``;
            in ``forward``, inputs or ``batch_splits`` that do not match the tables.

    Example:
        ```python
        emb = ShardedEmbeddingBag([20000] * 32, 64, comm)  # table t on rank t % P
        pooled = emb(indices, offsets, batch_splits)  # [B_r, 32, 64]: every table, own samples
        ```
    """

    def __init__(
        self,
        num_embeddings: list[int],
        embedding_dim: int,
        comm: Communicator,
        *,
        mode: str = "sum",
        dtype: torch.dtype = torch.float32,
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not num_embeddings or any(n < 1 for n in num_embeddings) or embedding_dim < 1:
            raise ValueError(
                f"need at least one table of >= 1 rows and embedding_dim >= 1, got {num_embeddings}, {embedding_dim}"
            )
        if mode not in emb.MODES:
            raise ValueError(f"mode must be one of {emb.MODES}, got {mode!r}")
        world = comm.world_size
        self.comm, self.mode, self.dim, self.dtype = (
            comm,
            mode,
            embedding_dim,
            dtype,
        )
        self.chunk_config = chunk_config or ChunkConfig()
        self.chunk_config.require_chunks(type(self).__name__, by_table=True)
        self.owner = [t % world for t in range(len(num_embeddings))]
        self.local_tables = [t for t, o in enumerate(self.owner) if o == comm.rank]
        self.tables_per_rank = [self.owner.count(r) for r in range(world)]
        rank_major = [t for r in range(world) for t, o in enumerate(self.owner) if o == r]
        # Position of global table t in the operator's rank-major output.
        self.order = torch.tensor(
            [rank_major.index(t) for t in range(len(num_embeddings))], device=comm.device
        )
        tables = []
        for t in self.local_tables:
            gen = torch.Generator().manual_seed(seed + t)
            bound = 1.0 / math.sqrt(num_embeddings[t])  # DLRM's uniform initialisation
            w = torch.rand((num_embeddings[t], embedding_dim), generator=gen, device="cpu")
            w = (w * 2 - 1) * bound  # DLRM's init, drawn on the CPU: the same on every device
            tables.append(nn.Parameter(w.to(device=comm.device, dtype=dtype)))
        self.tables = nn.ParameterList(tables)
        self._chunks: dict[tuple[int, ...], ChunkSchedule] = {}

    def lookup(
        self,
        indices: list[torch.Tensor],
        offsets: list[torch.Tensor],
        batch_splits: list[int],
        tables: list[torch.Tensor] | None = None,
    ) -> emb.ShardedLookup:
        """The operator's inputs for one batch (``forward``'s arguments) on this module's
        tables, or on ``tables`` where a caller has its own handles on them (an autograd
        function's inputs)."""
        return emb.ShardedLookup(
            tables=list(self.tables) if tables is None else tables,
            indices=indices,
            offsets=offsets,
            batch_splits=batch_splits,
            tables_per_rank=self.tables_per_rank,
            dim=self.dim,
            dtype=self.dtype,
            mode=self.mode,
        )

    def chunks_for(
        self, indices: list[torch.Tensor], offsets: list[torch.Tensor], batch_splits: list[int]
    ) -> ChunkSchedule:
        """The exchange's schedule for this batch layout: the config's, or chosen on first
        use (``embedding_all_to_all.choose_chunks_for``)."""
        key = tuple(batch_splits)
        if key not in self._chunks:
            fixed = self.chunk_config.fixed()
            if fixed is not None:
                self._chunks[key] = fixed
            else:
                spec = torch.empty(
                    (sum(batch_splits), len(self.owner), self.dim), dtype=self.dtype, device="meta"
                )
                from commfuse.comm import check_consistent

                check_consistent(self.comm, spec, "embedding_all_to_all batch")
                self._chunks[key] = emb.choose_chunks_for(
                    self.comm,
                    self.lookup(indices, offsets, batch_splits),
                    config=self.chunk_config,
                    backward=torch.is_grad_enabled() and any(t.requires_grad for t in self.tables),
                )
        return self._chunks[key]

    def forward(
        self,
        indices: list[torch.Tensor],
        offsets: list[torch.Tensor],
        batch_splits: list[int] | None = None,
    ) -> torch.Tensor:
        world = self.comm.world_size
        if batch_splits is None:
            if not offsets:
                raise ValueError(
                    f"rank {self.comm.rank} owns no table: pass batch_splits (samples per rank)"
                )
            batch_splits = split_sizes(offsets[0].numel(), world)
        chunks = self.chunks_for(indices, offsets, batch_splits)
        out: torch.Tensor = embedding_all_to_all_op(
            list(self.tables),
            indices,
            offsets,
            list(batch_splits),
            self.tables_per_rank,
            self.dim,
            self.dtype,
            self.mode,
            self.comm.key,
            *embedding_schedule_args(chunks),
            anchor_for_backward(self.comm.device),
        )
        return out.index_select(1, self.order)
