"""An MoE layer workload: a pre-norm residual block around ``ExpertParallelMoE`` (top-k gating,
experts sharded across ranks) and a linear classifier, on synthetic tokens.

Data (deterministic from ``(seed, step, rank)``, as ``workloads.base.batch_generator`` makes
it): each rank draws ``tokens_per_rank`` Gaussian tokens of ``d_model`` features; the label of a
token is the class of a fixed random "teacher" projection (``argmax x T^T``), so the task is
learnable and the loss falls as the model trains.

Parallelism: the experts are model-parallel (each rank owns ``split_sizes(num_experts, P)`` of
them; their gradients arrive complete through the backward All-to-Alls), everything else (the
norm, the gate, the classifier) is replicated and data-parallel: ``train_step`` averages those
gradients in two allreduces, the head's during the MoE backward and the rest after it (by
recursive doubling: a few kilobytes that every rank waits for). The loss is each rank's mean
over its tokens, so expert gradients are scaled by ``1 / P`` to match the data-parallel
average: the step equals one step of the dense model on the global batch with the mean loss.

``fused=False`` runs both All-to-Alls unfused (one chunk: the whole GEMM, then gloo's
All-to-All); ``fused=True`` lets the layer choose its chunks (``ChunkConfig``), or use
``num_chunks``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.collectives import all_reduce
from commfuse.comm import Communicator, Handle
from commfuse.fused.chunking import ChunkConfig
from commfuse.fused.moe import ExpertParallelMoE
from commfuse.workloads.base import batch_generator


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of the MoE workload."""

    d_model: int = 256
    """Token features."""
    d_hidden: int = 512
    """Hidden features of each expert's two-layer MLP."""
    num_experts: int = 8
    """Experts in total (at least one per rank)."""
    top_k: int = 2
    """Experts per token."""
    capacity_factor: float | None = None
    """Per-rank expert capacity factor (None: no token is dropped)."""
    tokens_per_rank: int = 1024
    """Tokens in each rank's batch."""
    num_classes: int = 16
    """Classes of the synthetic labels."""
    lr: float = 0.05
    """SGD learning rate."""

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_experts", "top_k", "tokens_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_classes < 2 or self.lr <= 0:
            raise ValueError(f"need num_classes >= 2 and lr > 0, got {self.num_classes}, {self.lr}")


class MoEModel(nn.Module):
    """``logits = head(x + moe(norm(x)))``."""

    def __init__(
        self, options: MoEConfig, comm: Communicator, *, chunk_config: ChunkConfig, seed: int
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(options.d_model)
        self.moe = ExpertParallelMoE(
            options.d_model,
            options.d_hidden,
            options.num_experts,
            comm,
            top_k=options.top_k,
            capacity_factor=options.capacity_factor,
            chunk_config=chunk_config,
            seed=seed,
        )
        gen = torch.Generator().manual_seed(seed + 1)
        bound = 1.0 / math.sqrt(options.d_model)
        self.head = nn.Linear(options.d_model, options.num_classes)
        with torch.no_grad():  # the same head on every rank (and device)
            self.head.weight.copy_(
                (torch.rand(self.head.weight.shape, generator=gen, device="cpu") * 2 - 1) * bound
            )
            self.head.bias.zero_()
        self.to(comm.device)  # the norm and the head join the experts on the rank's device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x + self.moe(self.norm(x)))
        return out

    def replicated(self) -> list[nn.Parameter]:
        """The data-parallel parameters (everything but this rank's experts)."""
        experts = {id(self.moe.w1), id(self.moe.w2)}
        return [p for p in self.parameters() if id(p) not in experts]


class MoEWorkload:
    """Build, feed and step the MoE model on ``comm``'s ranks."""

    name = "moe"

    def __init__(self, options: MoEConfig | None = None) -> None:
        self.options = options or MoEConfig()

    def build_model(
        self, comm: Communicator, seed: int, *, fused: bool = True, num_chunks: int | None = None
    ) -> MoEModel:
        """The model (same full parameters on any world size); ``fused=False`` means one chunk."""
        if comm.world_size > self.options.num_experts:
            raise ValueError(
                f"num_experts ({self.options.num_experts}) must be >= world size ({comm.world_size})"
            )
        config = ChunkConfig(num_chunks=num_chunks if fused else 1)
        return MoEModel(self.options, comm, chunk_config=config, seed=seed)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.options.lr)

    def batch(
        self, step: int, rank: int, *, seed: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s (tokens, labels) at ``step`` on ``device`` (drawn from seeded CPU
        generators, then moved: the same tokens on every device)."""
        o = self.options
        gen = batch_generator(seed, step, rank)
        x = torch.randn((o.tokens_per_rank, o.d_model), generator=gen, device="cpu")
        teacher = torch.randn(
            (o.num_classes, o.d_model),
            generator=torch.Generator().manual_seed(seed + 7),
            device="cpu",
        )
        y = (x @ teacher.t()).argmax(-1)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def train_step(
        self,
        comm: Communicator,
        model: MoEModel,
        optimizer: torch.optim.Optimizer,
        batch: tuple[torch.Tensor, torch.Tensor],
    ) -> float:
        """One step: forward, backward (through the fused All-to-Alls), average the replicated
        gradients, scale the expert gradients by 1/P, update. Returns this rank's loss.

        The replicated gradients are averaged in two all-reduces: the head's, started as soon
        as autograd has accumulated them (the head is the last layer, so before the MoE
        backward begins) and travelling during it, and the rest (the gate's and the norm's,
        complete only at the end of the backward) after it."""
        optimizer.zero_grad(set_to_none=False)
        loss = self.loss(model, batch)
        early = ReplicatedBucket(comm, list(model.head.parameters()))
        hooks = [
            p.register_post_accumulate_grad_hook(early.ready)  # type: ignore[no-untyped-call]
            for p in early.params
        ]
        try:
            torch.autograd.backward(loss)
        finally:
            for hook in hooks:
                hook.remove()
        heads = {id(p) for p in early.params}
        rest = [p for p in model.replicated() if id(p) not in heads]
        # Every rank waits for this one with nothing left to do: recursive doubling takes
        # lg P steps where gloo's ring takes 2 (P - 1), and these few kilobytes are all latency.
        late = ReplicatedBucket(comm, rest, algo=LATE_ALL_REDUCE)
        late.start()
        early.start()  # a no-op where the hooks started it
        early.finish()
        late.finish()
        world = comm.world_size
        for p in (model.moe.w1, model.moe.w2):
            if p.grad is not None:
                p.grad /= world
        optimizer.step()
        return float(loss.detach())


#: The algorithm of the all-reduce after the backward (``commfuse.collectives``).
LATE_ALL_REDUCE = "doubling"


class ReplicatedBucket:
    """Data-parallel parameters whose gradients are averaged in one all-reduce, started as soon
    as the last of them is ready (``ready``, a post-accumulate-grad hook) or when asked
    (``start``), waited and copied back by ``finish``. ``algo``: ``"native"`` (gloo's ring, on
    its own threads) or an algorithm of ``commfuse.collectives.all_reduce``."""

    def __init__(
        self, comm: Communicator, params: list[nn.Parameter], *, algo: str = "native"
    ) -> None:
        self.comm, self.params, self.algo = comm, params, algo
        self.waiting = {id(p) for p in params}
        self.flat: torch.Tensor | None = None
        self.handle: Handle | None = None

    def ready(self, param: torch.Tensor) -> None:
        self.waiting.discard(id(param))
        if not self.waiting:
            self.start()

    def start(self) -> None:
        if self.flat is not None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            self.flat = torch.empty(0, device=self.comm.device)
            return
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        if self.algo == "native":
            self.handle = self.comm.all_reduce(self.flat, "sum", async_op=True)
        else:
            self.handle = all_reduce(self.comm, self.flat, "sum", algo=self.algo, async_op=True)

    def finish(self) -> None:
        if self.handle is None or self.flat is None:
            return
        self.handle.wait()
        self.flat /= self.comm.world_size
        offset = 0
        for p in self.params:
            if p.grad is not None:
                g = p.grad
                g.copy_(self.flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
