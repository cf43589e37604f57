"""``charlm``: a character-level Transformer language model on the standard library's source.

A decoder-only Transformer (Vaswani et al., 2017, in the GPT-2 pre-norm arrangement): token and
learned position embeddings, ``layers`` blocks of causal multi-head self-attention and a GELU MLP,
a final LayerNorm and a linear head over the 98-symbol vocabulary (see ``corpus.py``). With the
defaults (dim 256, 4 layers, 4 heads, MLP 4x) it has about 3.2M parameters; each rank trains on
8 sequences of 64 symbols per step with AdamW (or SGD, ``optimizer="sgd"``), drawn from the whole
training corpus or, with ``replica_data="split"``, from the rank's own share of it.

There is no dropout, so a step is a deterministic function of parameters and batch; batches are
random windows of the training split drawn from (seed, step, rank) (``base.batch_generator``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.workloads import corpus
from commfuse.workloads.base import Workload, batch_generator


@dataclasses.dataclass(frozen=True, kw_only=True)
class CharLMConfig:
    """Options of ``--workload charlm:key=value,...``."""

    dim: int = 256
    """Model width (embedding size)."""
    layers: int = 4
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block (must divide dim)."""
    seq: int = 64
    """Symbols per sequence (context length)."""
    batch: int = 8
    """Sequences per rank per step."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """AdamW, or SGD with heavy-ball momentum (``momentum``; give it its own ``lr``, about
    0.1 to 0.5 here, not AdamW's)."""
    lr: float = 3e-3
    """The optimizer's learning rate."""
    weight_decay: float = 0.01
    """Weight decay (AdamW's decoupled; SGD's added to the gradient)."""
    momentum: float = 0.9
    """SGD's momentum (``optimizer="sgd"`` only)."""
    replica_data: Literal["shared", "split"] = "shared"
    """Where each rank's windows come from: the whole training corpus (``shared``), or the
    rank's own contiguous 1/world of it (``split``: other source files on every rank, data
    that differ between replicas, as between data centres)."""
    eval_batches: int = 4
    """Held-out batches (of ``batch`` x ``seq`` symbols) in ``evaluate``."""

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "seq", "batch", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class CharTransformer(nn.Module):
    """Token ids (batch, seq) -> next-symbol logits (batch, seq, vocab)."""

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


class CharLM(Workload):
    """See the module docstring."""

    name = "charlm"

    def __init__(self, options: CharLMConfig | None = None, *, device: torch.device) -> None:
        super().__init__(device=device)
        self.options = options or CharLMConfig()

    def build_model(self, seed: int) -> nn.Module:
        o = self.options
        torch.manual_seed(seed)  # initialised on the CPU, then moved: the same on every device
        model = CharTransformer(
            vocab=corpus.VOCAB_SIZE, dim=o.dim, layers=o.layers, heads=o.heads, seq=o.seq
        )
        return model.to(self.device)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        o = self.options
        if o.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
            )
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)

    def _windows(self, data: torch.Tensor, gen: torch.Generator, count: int) -> torch.Tensor:
        """``count`` random windows of the host corpus, cut on the CPU (the seeded generator
        and the corpus live there) and moved to the workload's device."""
        seq = self.options.seq
        starts = torch.randint(0, data.numel() - seq - 1, (count,), generator=gen, device="cpu")
        windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        return windows.to(self.device, non_blocking=True)

    def batch(self, step: int, rank: int, world_size: int, *, seed: int) -> torch.Tensor:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        gen = batch_generator(seed, step, rank)
        data = corpus.load_split("train")
        if self.options.replica_data == "split":
            share = data.numel() // world_size
            data = data[rank * share : (rank + 1) * share]
        return self._windows(data, gen, self.options.batch)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        # A fixed set of held-out windows (seed 0), identical for every run and strategy.
        gen = batch_generator(0, 0, 0)
        data = corpus.load_split("heldout")
        total_loss, correct, count = 0.0, 0, 0
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for _ in range(self.options.eval_batches):
                windows = self._windows(data, gen, self.options.batch)
                logits = model(windows[:, :-1])
                target = windows[:, 1:]
                total_loss += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
                ).item()
                correct += int((logits.argmax(-1) == target).sum())
                count += target.numel()
        model.train(was_training)
        return {"loss": total_loss / count, "accuracy": correct / count}

    def describe(self) -> str:
        o = self.options
        optimizer = "SGD" if o.optimizer == "sgd" else "AdamW"
        data = ", each rank its own share of the corpus" if o.replica_data == "split" else ""
        return (
            f"charlm (dim {o.dim}, {o.layers} layers, {o.batch}x{o.seq} symbols/rank/step, "
            f"{optimizer}{data})"
        )
