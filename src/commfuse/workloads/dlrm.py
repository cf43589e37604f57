"""A DLRM-style recommendation model: model-parallel embedding tables, data-parallel MLPs.

DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
Systems", arXiv 1906.00091) has two kinds of input per sample: dense features, fed to a bottom
MLP, and categorical (sparse) features, each a bag of ids pooled by its own embedding table. Its
hybrid parallelism, the reason for the fused operator:

1. the tables are too large to replicate, so they are sharded table-wise (model parallel):
   the owner of table ``t`` looks up ``t`` for the *global* batch;
2. an All-to-All turns those lookups into data-parallel input: each rank receives every table's
   pooled vector for its own ``B_r`` samples, ``[B_r, T, D]``;
3. the bottom MLP (data parallel) maps the dense features to ``D``; the feature interaction
   takes the pairwise dot products of the ``T + 1`` vectors (DLRM's ``dot``) or concatenates
   them (``cat``); the top MLP maps the result to one logit; the loss is binary cross-entropy;
4. backward: the reverse All-to-All brings each table's gradients back to its owner (see
   ``fused/embedding_all_to_all.py``), and the MLP gradients are summed with one allreduce.

``exchange="fused"`` uses the chunked embedding + All-to-All operator (``ShardedEmbeddingBag``);
``exchange="unfused"`` does every lookup, then one All-to-All (``baselines.ALL_TO_ALL``), and in
backward the All-to-All of the gradients, then the accumulation, table by table as the fused
by-table backward does it. Both accumulate the table gradients
in the same order (own samples first, then ranks ``r+1, r+2, ...``), so the two train the same
model to the same bits (tested).

Design notes: ``docs/fused.md``, "The DLRM workload's synthetic data".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.collectives import all_to_all
from commfuse.comm import Communicator
from commfuse.fused import baselines
from commfuse.fused import embedding_all_to_all as emb
from commfuse.fused.chunking import ChunkConfig
from commfuse.fused.modules import ShardedEmbeddingBag
from commfuse.fused.table_gradients import TableGradients
from commfuse.workloads.base import batch_generator

EXCHANGES = ("fused", "unfused")
INTERACTIONS = ("dot", "cat")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """Sizes of the model and of its synthetic data."""

    num_tables: int = 8
    """Embedding tables (categorical features), sharded table-wise (table t on rank t % P)."""
    rows_per_table: int = 1000
    """Rows (distinct ids) of every table."""
    embedding_dim: int = 16
    """D: width of every embedding and of the bottom MLP's output."""
    dense_features: int = 13
    """Dense inputs per sample (13 in the Criteo data sets)."""
    bottom_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the bottom MLP (its output is embedding_dim)."""
    top_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the top MLP (its output is one logit)."""
    interaction: str = "dot"
    """"dot": pairwise dot products of the T + 1 vectors (DLRM's default); "cat": concatenate."""
    pooling: int = 8
    """Ids per bag (lookups per sample and table), pooled by sum."""
    power_law_alpha: float = 1.2
    """Skew of the id distribution, p(i) ~ (i + 1)^-alpha; 0 is uniform."""
    batch_per_rank: int = 64
    """Samples per rank per step (the global batch is P times this)."""
    lr: float = 0.05
    """Plain SGD learning rate (tables and MLPs)."""

    def __post_init__(self) -> None:
        for name in ("num_tables", "rows_per_table", "embedding_dim", "dense_features"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pooling < 1 or self.batch_per_rank < 0:
            raise ValueError(
                f"pooling must be >= 1 and batch_per_rank >= 0, got {self.pooling}, {self.batch_per_rank}"
            )
        if any(w < 1 for w in (*self.bottom_mlp, *self.top_mlp)):
            raise ValueError(f"MLP widths must be >= 1, got {self.bottom_mlp}, {self.top_mlp}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.power_law_alpha < 0 or self.lr <= 0:
            raise ValueError(
                f"power_law_alpha must be >= 0 and lr > 0, got {self.power_law_alpha}, {self.lr}"
            )

    def interaction_width(self) -> int:
        n = self.num_tables + 1
        if self.interaction == "dot":
            return self.embedding_dim + n * (n - 1) // 2  # DLRM keeps the dense vector too
        return n * self.embedding_dim


def power_law_ids(count: int, rows: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``count`` ids in ``[0, rows)`` with ``p(i) ~ (i + 1)^-alpha``: the inverse CDF of the
    continuous power law on ``[1, rows + 1)``, floored (id 0 is the hottest)."""
    u = torch.rand(count, generator=gen, dtype=torch.float64, device="cpu")
    if alpha == 0:
        x = 1 + u * rows
    elif abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1))
    else:
        e = 1.0 - alpha
        x = (1 + u * ((rows + 1) ** e - 1)) ** (1.0 / e)
    return (x.floor().long() - 1).clamp_(0, rows - 1)


@dataclasses.dataclass
class DLRMBatch:
    """Rank r's view of one step: its own samples' dense features and labels, and the ids of
    the *global* batch for the tables it owns."""

    dense: torch.Tensor
    """[B_r, dense_features] float32."""
    labels: torch.Tensor
    """[B_r] float32 in {0, 1}."""
    indices: list[torch.Tensor]
    """Per local table: ids of every sample of the global batch (rank-major), int64."""
    offsets: list[torch.Tensor]
    """Per local table: start of each sample's bag in ``indices``."""
    batch_splits: list[int]
    """Samples per rank."""


def _sample_ids(config: DLRMConfig, seed: int, step: int, sample_rank: int, table: int) -> Any:
    # One stream per (step, rank whose samples, table): the same ids on whichever rank asks.
    gen = batch_generator(seed, step, (sample_rank * config.num_tables + table) * 2 + 1)
    count = config.batch_per_rank * config.pooling
    return power_law_ids(count, config.rows_per_table, config.power_law_alpha, gen)


def synthetic_batch(
    config: DLRMConfig,
    step: int,
    rank: int,
    world_size: int,
    *,
    seed: int = 0,
    device: torch.device,
) -> DLRMBatch:
    """Rank ``rank``'s batch at ``step`` (module docstring) on ``device``: a pure function of
    its arguments. Drawn from seeded CPU generators, then moved, so every device sees the same
    ids and features."""
    gen = batch_generator(seed, step, 2 * rank)
    b = config.batch_per_rank
    dense = torch.randn((b, config.dense_features), generator=gen, device="cpu")
    # A fixed "true" model makes labels learnable: dense projection + hot ids of table 0.
    w = torch.linspace(-1.0, 1.0, config.dense_features, device="cpu")
    hot = (_sample_ids(config, seed, step, rank, 0).view(b, config.pooling) < 3).float().sum(1)
    labels = ((dense @ w + hot - 0.5 * config.pooling * 0.3) > 0).float()
    local = [t for t in range(config.num_tables) if t % world_size == rank]
    indices = [
        torch.cat([_sample_ids(config, seed, step, j, t) for j in range(world_size)]).to(
            device, non_blocking=True
        )
        for t in local
    ]
    offsets = [
        torch.arange(0, b * world_size * config.pooling, config.pooling, device=device)
        for _ in local
    ]
    return DLRMBatch(
        dense.to(device, non_blocking=True),
        labels.to(device, non_blocking=True),
        indices,
        offsets,
        [b] * world_size,
    )


def _mlp(widths: list[int], gen: torch.Generator, *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        lin = nn.Linear(fan_in, fan_out)
        with torch.no_grad():  # DLRM's init: normal weights, std sqrt(2 / (fan_in + fan_out))
            weight = torch.randn((fan_out, fan_in), generator=gen, device="cpu")
            lin.weight.copy_(weight * math.sqrt(2.0 / (fan_in + fan_out)))
            lin.bias.copy_(
                torch.randn(fan_out, generator=gen, device="cpu") * math.sqrt(1.0 / fan_out)
            )
        layers.append(lin)
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _UnfusedExchange(torch.autograd.Function):
    """Lookups then one All-to-All; backward: the All-to-All, then the accumulation table by
    table."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        module: ShardedEmbeddingBag,
        batch: DLRMBatch,
        *tables: torch.Tensor,
    ) -> torch.Tensor:
        ctx.module, ctx.batch = module, batch
        ctx.save_for_backward(*tables)
        lookup = module.lookup(batch.indices, batch.offsets, batch.batch_splits, list(tables))
        return emb.embedding_all_to_all_reference(module.comm, lookup)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        module, batch = ctx.module, ctx.batch
        tables = ctx.saved_tensors
        comm, rank, world = module.comm, module.comm.rank, module.comm.world_size
        splits, per_rank, dim = batch.batch_splits, module.tables_per_rank, module.dim
        grad = grad.contiguous()
        lookup = module.lookup(batch.indices, batch.offsets, splits, list(tables))
        t_starts, starts = lookup.table_starts, lookup.sample_starts
        send = torch.cat(
            [grad[:, t_starts[j] : t_starts[j] + per_rank[j]].reshape(-1) for j in range(world)]
        )
        in_splits = [splits[rank] * per_rank[j] * dim for j in range(world)]
        out_splits = [splits[i] * per_rank[rank] * dim for i in range(world)]
        recv = torch.empty(sum(out_splits), dtype=grad.dtype, device=grad.device)
        all_to_all(comm, recv, send, out_splits, in_splits, algo=baselines.ALL_TO_ALL)
        blocks = torch.split(recv, out_splits)
        grads = TableGradients(list(tables), batch.indices, batch.offsets, module.mode)
        # Table by table (one table's rows stay in cache, the fastest accumulation commfuse
        # has), each in the fused backward's order: own samples first, then ranks r+1, r+2,
        # ... (same bits).
        order = [rank] + [(rank + s) % world for s in range(1, world)]
        received = {src: blocks[src].view(splits[src], len(tables), dim) for src in order}
        for t in range(len(tables)):
            for src in order:
                grads.add_table(t, starts[src], received[src][:, t])
        return (None, None, None, *grads.result(list(tables)))


class DLRM(nn.Module):
    """The model on one rank: its shard of the tables and a replica of both MLPs."""

    def __init__(
        self,
        config: DLRMConfig,
        comm: Communicator,
        *,
        exchange: str = "fused",
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        self.config, self.comm, self.exchange = config, comm, exchange
        gen = torch.Generator().manual_seed(seed)
        self.bottom = _mlp(
            [config.dense_features, *config.bottom_mlp, config.embedding_dim], gen, last_relu=True
        )
        self.top = _mlp([config.interaction_width(), *config.top_mlp, 1], gen, last_relu=False)
        self.embedding = ShardedEmbeddingBag(
            [config.rows_per_table] * config.num_tables,
            config.embedding_dim,
            comm,
            mode="sum",
            chunk_config=chunk_config,
            seed=seed + 1,
        )
        n = config.num_tables + 1
        self._pairs: torch.Tensor
        pairs = torch.triu_indices(n, n, offset=1, device=comm.device)
        self.register_buffer("_pairs", pairs, persistent=False)
        # The MLPs were initialised on the CPU (the seeded generator); the tables already sit
        # on comm.device. The whole model then lives there.
        self.to(comm.device)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The data-parallel parameters (both MLPs), whose gradients are summed over ranks."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def embed(self, batch: DLRMBatch) -> torch.Tensor:
        """``[B_r, T, D]``: every table's pooled vector for this rank's samples."""
        if self.exchange == "fused":
            out: torch.Tensor = self.embedding(batch.indices, batch.offsets, batch.batch_splits)
            return out
        anchor = torch.empty(0, device=batch.dense.device, requires_grad=torch.is_grad_enabled())
        rank_major: torch.Tensor = _UnfusedExchange.apply(  # type: ignore[no-untyped-call]
            anchor, self.embedding, batch, *self.embedding.tables
        )
        return rank_major.index_select(1, self.embedding.order)

    def forward(self, batch: DLRMBatch) -> torch.Tensor:
        """Logits ``[B_r]``."""
        # The exchange first, the bottom MLP second: autograd runs the later-created of two
        # ready nodes first, so in backward the bottom MLP's gradients are done before the
        # reverse exchange starts, and their allreduce travels with it (``train_step``).
        return self.dense_forward(batch, self.embed(batch))

    def dense_forward(self, batch: DLRMBatch, sparse: torch.Tensor) -> torch.Tensor:
        """Logits ``[B_r]`` from the exchanged vectors ``sparse`` (``[B_r, T, D]``): the bottom
        MLP, the feature interaction and the top MLP (data parallel; no communication)."""
        x = self.bottom(batch.dense)
        z = torch.cat([x.unsqueeze(1), sparse.to(x.dtype)], dim=1)  # [B_r, T + 1, D]
        if self.config.interaction == "dot":
            dots = torch.bmm(z, z.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
            features = torch.cat([x, dots], dim=1)
        else:
            features = z.flatten(1)
        logits: torch.Tensor = self.top(features).squeeze(1)
        return logits


def train_step(model: DLRM, optimizer: torch.optim.Optimizer, batch: DLRMBatch) -> float:
    """One step; returns the global mean loss. The loss is summed over this rank's samples and
    divided by the global batch, so the table gradients the reverse All-to-All sums and the MLP
    gradients one allreduce sums are both gradients of the global mean.

    The MLP gradients are summed with one coalesced allreduce (the loss riding along for the
    log), started from a gradient hook the moment the last of them is accumulated, so it runs
    while the reverse exchange of the embedding gradients does, and waited for before the
    update (wait-free backpropagation, as DDP does for its buckets)."""
    comm = model.comm
    optimizer.zero_grad(set_to_none=False)
    logits = model(batch)
    global_batch = max(sum(batch.batch_splits), 1)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / global_batch
    params = model.dense_parameters()
    pending: list[Any] = []  # [flat, handle] once started

    def start(_: torch.Tensor) -> None:
        counted[0] += 1
        if counted[0] == len(params):  # each parameter's hook fires once per backward
            flat = _mlp_grads_and_loss(params, loss)
            pending.extend((flat, comm.all_reduce(flat, "sum", async_op=True)))

    counted = [0]
    hooks = [
        p.register_post_accumulate_grad_hook(start)  # type: ignore[no-untyped-call]
        for p in params
    ]
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for hook in hooks:
            hook.remove()
    if not pending:  # some MLP parameter got no gradient this step: sum what there is now
        flat = _mlp_grads_and_loss(params, loss)
        comm.all_reduce(flat, "sum")
    else:
        flat, handle = pending
        handle.wait()
    offset = 0
    for p in params:
        assert p.grad is not None
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    optimizer.step()
    return float(flat[-1])


def _mlp_grads_and_loss(params: list[nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
    """Every MLP gradient (zeros where there is none) in one buffer, the loss last."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])


def make_optimizer(model: DLRM) -> torch.optim.Optimizer:
    """Plain SGD over every parameter (tables and MLPs), as DLRM's reference trainer."""
    return torch.optim.SGD(model.parameters(), lr=model.config.lr)
