"""A tensor-parallel Transformer (Megatron-LM, Shoeybi et al., arXiv 1909.08053) whose collectives
are the fused operators of ``commfuse.fused`` (Punniyamurthy, Hamidouche and Beckmann, SC24,
arXiv 2305.06942).

Megatron splits each sublayer of a pre-norm block into a column-parallel linear followed by a
row-parallel one, so each sublayer costs one collective in forward and one in backward:

1. attention: the QKV projection is column-parallel *by heads* (rank ``r`` holds whole heads,
   their Q, K and V rows); each rank attends with its own heads, which needs no communication
   (heads are independent); the output projection is row-parallel (its input features are the
   head outputs rank ``r`` holds) and an AllReduce sums the ranks' partial products;
2. MLP: the first linear is column-parallel (rank ``r`` holds hidden units ``F_r``), GELU is
   elementwise, the second linear is row-parallel, then an AllReduce;
3. backward: the input of each column-parallel linear is replicated, so its gradient is the sum
   of every rank's ``grad_y_r @ W_r`` (Megatron's ``f`` operator), another GEMM + AllReduce; the
   row-parallel backward is local.

``fused=True`` runs every AllReduce as the fused GEMM + AllReduce (``RowParallelLinear`` forward,
``ColumnParallelLinear`` backward; chunks chosen by the modules, or ``num_chunks``);
``fused=False`` builds the same modules with ``ChunkConfig(num_chunks=1)``: the whole GEMM, then
gloo's allreduce. Same maths, same bytes (the fused pipeline sends what a ring allreduce does).

Design notes: ``docs/fused.md``, "The tensor-parallel Transformer: sequence parallelism, shards,
data".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.comm import Communicator
from commfuse.fused.chunking import ChunkConfig, shard_range, split_sizes
from commfuse.fused.linear import ColumnParallelLinear, RowParallelLinear
from commfuse.fused.modules import full_linear_weight
from commfuse.workloads.base import batch_generator


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPTransformerConfig:
    """Shape of the tensor-parallel Transformer and of its synthetic data."""

    d_model: int = 256
    """Token features (the residual stream's width)."""
    num_heads: int = 8
    """Attention heads; the world size must divide it."""
    d_ff: int = 1024
    """Hidden units of the MLP (sharded as evenly as possible)."""
    num_layers: int = 1
    """Transformer blocks in the stack."""
    seq_len: int = 128
    """Tokens per sequence (sharded across ranks with sequence parallelism)."""
    batch: int = 4
    """Sequences per step (the same on every rank of the group)."""
    num_classes: int = 16
    """Classes of the synthetic labels."""
    sequence_parallel: bool = False
    """Shard activations along the sequence (AllGather + GEMM, GEMM + ReduceScatter)."""
    lr: float = 0.05
    """SGD learning rate."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "d_ff", "num_layers", "seq_len", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.num_classes < 2 or self.lr <= 0:
            raise ValueError(f"need num_classes >= 2 and lr > 0, got {self.num_classes}, {self.lr}")


def causal_attention(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[S, B, h * 3 * head_dim]`` (head-major q, k, v) -> ``[S, B, h * head_dim]``: causal
    scaled dot-product attention of each of the ``h`` heads, outputs concatenated by head."""
    seq, batch = qkv.shape[0], qkv.shape[1]
    heads = qkv.shape[-1] // (3 * head_dim)
    q, k, v = qkv.reshape(seq, batch, heads, 3, head_dim).permute(3, 1, 2, 0, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, S, head_dim]
    return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)


class TPBlock(nn.Module):
    """``h = x + proj(attn(qkv(norm1(x))))``, ``out = h + fc2(gelu(fc1(norm2(h))))``, with
    ``qkv``/``fc1`` column-parallel and ``proj``/``fc2`` row-parallel (module docstring).
    ``x`` is ``[S, B, d]``, or this rank's ``[S_r, B, d]`` with sequence parallelism."""

    def __init__(
        self,
        options: TPTransformerConfig,
        comm: Communicator,
        *,
        chunk_config: ChunkConfig,
        seed: int,
    ) -> None:
        super().__init__()
        d, f = options.d_model, options.d_ff
        self.sequence_parallel = options.sequence_parallel
        self.head_dim = d // options.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        kw: dict[str, Any] = dict(
            chunk_config=chunk_config, sequence_parallel=self.sequence_parallel
        )
        self.qkv = ColumnParallelLinear(d, 3 * d, comm, seed=seed, **kw)
        self.proj = RowParallelLinear(d, d, comm, seed=seed + 1, **kw)
        self.fc1 = ColumnParallelLinear(d, f, comm, seed=seed + 2, **kw)
        self.fc2 = RowParallelLinear(f, d, comm, seed=seed + 3, **kw)

    def _linear(self, layer: nn.Module, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        out: torch.Tensor = layer(x, splits) if self.sequence_parallel else layer(x)
        return out

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        qkv = self._linear(self.qkv, self.norm1(x), splits)
        h = x + self._linear(self.proj, causal_attention(qkv, self.head_dim), splits)
        hidden = F.gelu(self._linear(self.fc1, self.norm2(h), splits))
        out: torch.Tensor = h + self._linear(self.fc2, hidden, splits)
        return out


class TPTransformer(nn.Module):
    """``logits = head(norm(blocks(x)))`` on one rank of the tensor-parallel group."""

    def __init__(
        self,
        options: TPTransformerConfig,
        comm: Communicator,
        *,
        chunk_config: ChunkConfig,
        seed: int,
    ) -> None:
        super().__init__()
        if options.num_heads % comm.world_size:
            raise ValueError(
                f"num_heads ({options.num_heads}) must be a multiple of the world size "
                f"({comm.world_size}): each rank holds whole heads"
            )
        self.options, self.comm = options, comm
        self.blocks = nn.ModuleList(
            TPBlock(options, comm, chunk_config=chunk_config, seed=seed + 10 * i)
            for i in range(options.num_layers)
        )
        self.norm = nn.LayerNorm(options.d_model)
        self.head = nn.Linear(options.d_model, options.num_classes)
        weight, bias = full_linear_weight(options.num_classes, options.d_model, seed + 7)
        with torch.no_grad():  # the same head on every rank
            self.head.weight.copy_(weight)
            self.head.bias.copy_(bias)
        self.to(comm.device)  # the norms and the head join the sharded linears' device

    def seq_splits(self) -> list[int]:
        """Sequence rows per rank with sequence parallelism (larger shards first)."""
        return split_sizes(self.options.seq_len, self.comm.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splits = self.seq_splits()
        for block in self.blocks:
            x = block(x, splits)
        out: torch.Tensor = self.head(self.norm(x))
        return out

    def replicated(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole: LayerNorms, row-parallel biases and the head."""
        sharded: set[int] = set()
        for block in self.blocks:
            assert isinstance(block, TPBlock)
            for column in (block.qkv, block.fc1):
                sharded.update(id(p) for p in column.parameters())
            for row in (block.proj, block.fc2):
                sharded.add(id(row.weight))
        return [p for p in self.parameters() if id(p) not in sharded]

    def chosen_chunks(self) -> int:
        """The largest number of chunks any fused module chose so far (1: all unfused)."""
        chosen = [
            k
            for block in self.blocks
            if isinstance(block, TPBlock)
            for layer in (block.qkv, block.proj, block.fc1, block.fc2)
            for k in layer.chosen_chunks()
        ]
        return max(chosen, default=1)


class TPTransformerWorkload:
    """Build, feed and step the tensor-parallel Transformer on ``comm``'s ranks."""

    name = "tp-transformer"

    def __init__(self, options: TPTransformerConfig | None = None) -> None:
        self.options = options or TPTransformerConfig()

    def build_model(
        self,
        comm: Communicator,
        seed: int,
        *,
        fused: bool = True,
        num_chunks: int | None = None,
        reference_algo: str | None = None,
    ) -> TPTransformer:
        """The model (the same full parameters on any world size); ``fused=False`` means one
        chunk everywhere, the unfused operators. ``reference_algo``: the collective algorithm
        of the sequence-parallel unfused references (``ChunkConfig.reference_algo``)."""
        config = ChunkConfig(
            num_chunks=num_chunks if fused else 1,
            reference_algo=reference_algo if self.options.sequence_parallel else None,
        )
        return TPTransformer(self.options, comm, chunk_config=config, seed=seed)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.options.lr)

    def full_batch(
        self, step: int, *, seed: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch at ``step`` on ``device``: tokens ``[S, B, d_model]`` and labels
        ``[S, B]`` (drawn from seeded CPU generators, then moved: the same on every device)."""
        o = self.options
        gen = batch_generator(seed, step, 0)
        x = torch.randn((o.seq_len, o.batch, o.d_model), generator=gen, device="cpu")
        teacher = torch.randn(
            (o.num_classes, o.d_model),
            generator=torch.Generator().manual_seed(seed + 11),
            device="cpu",
        )
        context = x.clone()
        context[1:] += x[:-1]  # the token and its predecessor
        y = (context @ teacher.t()).argmax(-1)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def batch(
        self, step: int, rank: int, world_size: int, *, seed: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s part of the batch: all of it, or its sequence rows with sequence
        parallelism."""
        x, y = self.full_batch(step, seed=seed, device=device)
        if not self.options.sequence_parallel:
            return x, y
        start, stop = shard_range(self.options.seq_len, world_size, rank)
        return x[start:stop], y[start:stop]

    def loss(self, model: TPTransformer, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """This rank's share of the mean cross-entropy over every token of the batch (the whole
        mean without sequence parallelism; summed over ranks with it)."""
        x, y = batch
        logits = model(x)
        total = self.options.seq_len * self.options.batch
        return (
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            / total
        )

    def sync_gradients(self, comm: Communicator, model: TPTransformer, loss: torch.Tensor) -> float:
        """After the backward: with sequence parallelism, one allreduce sums the replicated
        parameters' gradients (each rank saw only its rows) with the loss riding along; without,
        they are already whole. Returns the global mean loss."""
        if not self.options.sequence_parallel:
            return float(loss.detach())
        grads = [p.grad for p in model.replicated() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
        comm.all_reduce(flat, "sum")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return float(flat[-1])

    def train_step(
        self,
        comm: Communicator,
        model: TPTransformer,
        optimizer: torch.optim.Optimizer,
        batch: tuple[torch.Tensor, torch.Tensor],
    ) -> float:
        """One step: forward and backward through the fused (or unfused) collectives, the
        gradient sum of ``sync_gradients``, the update. Returns the global mean loss."""
        optimizer.zero_grad(set_to_none=False)
        loss = self.loss(model, batch)
        torch.autograd.backward(loss)
        value = self.sync_gradients(comm, model, loss)
        optimizer.step()
        return value
