"""``ExpertParallelMoE``: a Mixture-of-Experts feed-forward layer with experts sharded across
ranks, whose two All-to-Alls are fused with the expert GEMMs next to them.

One forward, on every rank for its own tokens ``x [T_r, D]``:

1. Gate (replicated, data-parallel): ``p = softmax(x W_g^T)``; each token picks its top ``k``
   experts; with ``normalize`` their weights are rescaled to sum to 1 (Mixtral), else they are
   the raw probabilities (GShard, Switch).
2. Capacity (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): with ``capacity_factor``
   set, each rank sends expert ``e`` at most ``ceil(capacity_factor * T_r * k / E)`` rows.
   Assignments are admitted choice-major (every token's first choice before any second choice,
   tokens in order); an assignment over capacity is dropped: the token gets no contribution from
   that expert (the residual connection, the caller's, carries it). Capacity is per sending
   rank, so it needs no communication. ``None`` keeps every assignment (no dropped tokens; the
   All-to-All splits are then as uneven as the routing).
3. The routed rows, sorted by expert, and the counts define the exchange. A rank needs only
   its own counts row (what it sends) and every rank's counts for its own experts (what it
   receives), so each rank sends each peer that peer's columns of its row, with its ``d_model``
   and dtype (checked on arrival), in one message: one hop, where an all-gather of the whole
   ``[P, E]`` matrix is a ring of ``P - 1`` hops, each waiting for the rank before it. The
   routed rows are gathered while the counts travel.
4. ``all_to_all_gemm`` (dispatch + the experts' first GEMM ``x W1_e^T``), the activation,
   ``gemm_all_to_all`` (the experts' second GEMM ``h W2_e^T`` + combine), then each token's
   outputs are summed with their gate weights.

Design notes: ``docs/fused.md``, "The MoE layer: how experts are sharded".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.comm import Communicator, Handle
from commfuse.fused import gemm_all_to_all as ga
from commfuse.fused.chunking import ChunkConfig, measure_overhead_us, split_sizes
from commfuse.fused.fallback import choose_fused_chunks, fewest_pieces_that_pay
from commfuse.fused.moe_ops import all_to_all_gemm_op, gemm_all_to_all_op

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Routed:
    """One rank's routing: assignments sorted by expert (stable), and rows per expert."""

    token: torch.Tensor
    """Token index of each kept assignment."""
    expert: torch.Tensor
    """Global expert of each kept assignment (non-decreasing)."""
    weight: torch.Tensor
    """Gate weight of each kept assignment (float32, differentiable)."""
    counts: torch.Tensor
    """Rows sent to each global expert ``[E]``."""


def route_tokens(
    logits: torch.Tensor, top_k: int, *, capacity_factor: float | None, normalize: bool
) -> Routed:
    """Steps 1-2 of the module docstring on gate logits ``[T, E]``."""
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_e = probs.topk(top_k, dim=-1)
    if normalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    expert = top_e.t().reshape(-1)  # choice-major: all first choices, then all second, ...
    token = torch.arange(tokens, device=logits.device).repeat(top_k)
    weight = top_w.t().reshape(-1)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
        position = F.one_hot(expert, num_experts).cumsum(0).gather(1, expert[:, None])[:, 0] - 1
        keep = position < capacity
        expert, token, weight = expert[keep], token[keep], weight[keep]
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=num_experts)
    return Routed(token[order], expert[order], weight[order], counts)


def dense_moe_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    capacity_factor: float | None = None,
    normalize: bool = True,
    activation: str = "gelu",
) -> torch.Tensor:
    """The same layer in one process with all experts (``w1 [E, H, D]``, ``w2 [E, D, H]``) on one
    rank's tokens ``x [T, D]``: the exact maths the distributed layer must reproduce."""
    r = route_tokens(x @ gate.t(), top_k, capacity_factor=capacity_factor, normalize=normalize)
    rows = x[r.token]
    h = ACTIVATIONS[activation](torch.einsum("td,thd->th", rows, w1[r.expert]))
    y = torch.einsum("th,tdh->td", h, w2[r.expert])
    return torch.zeros_like(x).index_add(0, r.token, y * r.weight[:, None].to(y.dtype))


def choose_moe_chunks(
    comm: Communicator,
    rt: ga.Routing,
    h: torch.Tensor,
    weight: torch.Tensor,
    config: ChunkConfig,
    *,
    trial_runs: int = 5,
    run: Callable[[int], object] | None = None,
) -> int:
    """Chunks for both MoE operators, the same on every rank. The model's ``k`` comes from the
    combine side (expert GEMM + All-to-All): measured C, gloo's M, the fused path's own M
    (``fallback.py``); 1 (unfused, gloo's All-to-All) when it predicts no gain. Otherwise a
    timed trial (``fallback.fewest_pieces_that_pay``, ``trial_runs`` rounds) runs ``run(k)``
    (default: the combine operator; the layer passes its dispatch, activation and combine) for
    ``k`` = 2 and the model's ``k`` beside the unfused form, in wall and CPU time, and keeps the
    fewest pieces that pay for themselves: each dispatch piece is one more message and wakeup
    per source and a smaller GEMM, CPU that ranks sharing cores pay in wall time. The trial
    falls back to 1 where the kept ``k`` is measurably no faster than unfused; where it cannot
    tell the two apart it keeps ``k``: on a loaded machine a few rounds often cannot, and the
    model already asked for a gain of ``config.min_gain``."""
    limit = max(max(rt.recv_rows), 1) * max(rt.world - 1, 1)
    if config.num_chunks is not None or rt.world == 1:
        return max(1, min(config.num_chunks or 1, limit))
    with torch.no_grad():
        compute_us, unfused_us, fused_us = ga.measure(comm, rt, h, weight)
        model = choose_fused_chunks(
            comm,
            config,
            compute_us=compute_us,
            fused_comm_us=fused_us,
            unfused_comm_us=unfused_us,
            overhead_us=measure_overhead_us(comm),
            limit=limit,
        )
        if model == 1:
            return 1

        def combine(k: int) -> object:
            return ga.gemm_all_to_all(comm, rt, h, weight, chunks=k)

        trial = run or combine
        return fewest_pieces_that_pay(
            comm,
            [k for k in (2, model) if k <= limit],
            trial,
            lambda: trial(1),
            runs=trial_runs,
            min_gain=config.min_gain,
            unclear_keeps=True,
        )


#: Tag and stats label of the counts exchange (the data pieces use tags from 0).
COUNTS_TAG = 1 << 20
COUNTS_LABEL = "moe_counts"


class PendingCounts:
    """A counts exchange in flight (``ExpertParallelMoE.exchange_counts``)."""

    def __init__(
        self,
        rank: int,
        expert_range: tuple[int, int],
        mine: torch.Tensor,
        features: torch.Tensor,
        received: dict[int, torch.Tensor],
        handles: list[Handle],
    ) -> None:
        self.rank, self.expert_range, self.mine, self.features = rank, expert_range, mine, features
        self.received, self.handles = received, handles

    def wait(self) -> torch.Tensor:
        """The ``[P, E]`` counts this rank's routing reads: its own row (what it sends) and every
        rank's counts for its own experts (what it receives); the rest is zero (no rank reads
        another pair's counts). ValueError, naming every rank's features, where a peer's token
        features or dtype differ from this rank's."""
        for handle in self.handles:
            handle.wait()
        world, lo, hi = len(self.received) + 1, *self.expert_range
        # host metadata: the routing turns the counts into split sizes (Python ints)
        table = torch.zeros((world, self.mine.numel()), dtype=torch.int64, device="cpu")
        table[self.rank] = self.mine.cpu()
        seen = {self.rank: self.features.tolist()}
        for src, message in self.received.items():
            table[src, lo:hi] = message[:-2].cpu()
            seen[src] = message[-2:].tolist()
        if any(f != seen[self.rank] for f in seen.values()):
            described = "; ".join(
                f"rank {r}: {d} features {_DTYPES[c] if c >= 0 else 'other dtype'}"
                for r, (d, c) in sorted(seen.items())
            )
            raise ValueError(
                f"ExpertParallelMoE: ranks passed different token features ({described}); "
                f"every rank must pass [..., d_model] of the same dtype"
            )
        return table


class ExpertParallelMoE(nn.Module):
    """Top-k gated MoE feed-forward layer, experts sharded across ``comm``'s ranks (module
    docstring). ``forward(x [..., D]) -> [..., D]``; every rank must call it together.

    Both fused operators use one number of chunks, chosen on the first forward of each dtype from
    that step's routing (``choose_moe_chunks``: measured, agreed, confirmed against the unfused
    operator, else 1) and kept; ``ChunkConfig(num_chunks=k)`` fixes it (``k = 1``: unfused).

    Args:
        d_model: the token width D.
        d_hidden: each expert's hidden width.
        num_experts: experts in all, at least one per rank (contiguous blocks of near-equal size
            per rank).
        comm: the expert-parallel group.
        top_k: experts per token.
        capacity_factor: tokens an expert takes, as a multiple of the even share; None: no cap.
        normalize: renormalise the top-k gate weights to sum to 1.
        activation: the experts' activation, ``"gelu"`` or ``"relu"``.
        dtype: the parameters' dtype.
        chunk_config: how the fused dispatch and combine choose their chunks; None: measured.
        seed: every rank draws the same full layer from it and keeps its experts.

    Raises:
        ValueError: sizes under 1, fewer experts than ranks, ``top_k`` outside
            ``[1, num_experts]``, a capacity factor that is not positive, or an unknown
            activation or dtype.

    Example:
        ```python
        moe = ExpertParallelMoE(512, 2048, num_experts=8, comm=comm, top_k=2)
        y = moe(x)  # [..., 512]; every rank calls it together
        ```
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        comm: Communicator,
        *,
        top_k: int = 2,
        capacity_factor: float | None = None,
        normalize: bool = True,
        activation: str = "gelu",
        dtype: torch.dtype = torch.float32,
        chunk_config: ChunkConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        world = comm.world_size
        if d_model < 1 or d_hidden < 1:
            raise ValueError(f"d_model and d_hidden must be >= 1, got {d_model}, {d_hidden}")
        if num_experts < world:
            raise ValueError(
                f"num_experts ({num_experts}) must be >= world size ({world}): one or more experts per rank"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
        self.comm = comm
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor, self.normalize, self.activation = (
            capacity_factor,
            normalize,
            activation,
        )
        self.chunk_config = chunk_config or ChunkConfig()
        self.chunk_config.require_chunks(type(self).__name__)
        self.experts_per_rank = split_sizes(num_experts, world)
        #: expert_bounds[j]: the first global expert of rank j (and the number of experts last).
        self.expert_bounds = [sum(self.experts_per_rank[:j]) for j in range(world + 1)]
        self.expert_range = (self.expert_bounds[comm.rank], self.expert_bounds[comm.rank + 1])
        gen = torch.Generator().manual_seed(seed)

        def uniform(*shape: int, fan_in: int) -> torch.Tensor:
            # the CPU generator: the same weights on every device (the module moves them)
            return (torch.rand(shape, generator=gen, device="cpu") * 2 - 1) / math.sqrt(fan_in)

        self.gate = nn.Parameter(uniform(num_experts, d_model, fan_in=d_model).to(dtype))
        w1 = uniform(num_experts, d_hidden, d_model, fan_in=d_model)
        w2 = uniform(num_experts, d_model, d_hidden, fan_in=d_hidden)
        lo, hi = self.expert_range
        self.w1 = nn.Parameter(w1[lo:hi].to(dtype).contiguous())
        self.w2 = nn.Parameter(w2[lo:hi].to(dtype).contiguous())
        self._chunks: dict[torch.dtype, int] = {}

    def exchange_counts(self, counts: torch.Tensor, x: torch.Tensor) -> PendingCounts:
        """Start the counts exchange (step 3 of the module docstring): every rank sends each
        peer only that peer's columns of its counts row, with its features and dtype, in one
        message per peer; ``PendingCounts.wait`` returns the ``[P, E]`` matrix this rank needs."""
        comm, world, rank = self.comm, self.comm.world_size, self.comm.rank
        code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
        features = torch.tensor([x.shape[-1], code], dtype=torch.int64, device=comm.device)
        mine = counts.to(device=comm.device, dtype=torch.int64)
        lo, hi = self.expert_range
        received: dict[int, torch.Tensor] = {}
        handles: list[Handle] = []
        for step in range(1, world):
            src = (rank - step) % world
            received[src] = torch.empty(hi - lo + 2, dtype=torch.int64, device=comm.device)
            handles.append(comm.irecv(received[src], src, tag=COUNTS_TAG, label=COUNTS_LABEL))
        for step in range(1, world):
            dst = (rank + step) % world
            a, b = self.expert_bounds[dst], self.expert_bounds[dst + 1]
            message = torch.cat([mine[a:b], features])
            handles.append(comm.isend(message, dst, tag=COUNTS_TAG, label=COUNTS_LABEL))
        return PendingCounts(rank, (lo, hi), mine, features, received, handles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model or x.dtype != self.w1.dtype:
            raise ValueError(
                f"rank {self.comm.rank}: expected [..., {self.d_model}] {self.w1.dtype}, "
                f"got {tuple(x.shape)} {x.dtype}"
            )
        x2 = x.reshape(-1, self.d_model)
        r = route_tokens(
            x2 @ self.gate.t(),
            self.top_k,
            capacity_factor=self.capacity_factor,
            normalize=self.normalize,
        )
        pending = self.exchange_counts(r.counts, x2)
        rows = x2[r.token]  # token side: routed rows sorted by expert, while the counts travel
        counts = pending.wait()
        flat, epr = counts.reshape(-1).tolist(), list(self.experts_per_rank)
        chunks = self.chunks_for(counts, rows)
        h, _ = all_to_all_gemm_op(rows, self.w1, flat, epr, self.comm.key, chunks)
        h = ACTIVATIONS[self.activation](h)
        y = gemm_all_to_all_op(h, self.w2, flat, epr, self.comm.key, chunks)
        out = torch.zeros_like(x2).index_add(0, r.token, y * r.weight[:, None].to(y.dtype))
        return out.reshape(x.shape)

    def chunks_for(self, counts: torch.Tensor, rows: torch.Tensor) -> int:
        """Chunks for this dtype, measured on the first forward's routing (then reused)."""
        if rows.dtype not in self._chunks:
            rt = ga.Routing(self.comm, counts, list(self.experts_per_rank))
            if self.chunk_config.num_chunks is not None:
                self._chunks[rows.dtype] = self.chunk_config.num_chunks
            else:
                comm, act = self.comm, ACTIVATIONS[self.activation]
                w1, w2, x = self.w1.detach(), self.w2.detach(), rows.detach()

                def forward(k: int) -> torch.Tensor:  # dispatch + GEMM, activation, GEMM + combine
                    hidden, _ = ga.all_to_all_gemm(comm, rt, x, w1, chunks=k)
                    return ga.gemm_all_to_all(comm, rt, act(hidden), w2, chunks=k)

                with torch.no_grad():
                    h, _ = ga.all_to_all_gemm_reference(comm, rt, x, w1)
                    h = act(h)
                    self._chunks[rows.dtype] = choose_moe_chunks(
                        comm, rt, h, w2, self.chunk_config, run=forward
                    )
        return self._chunks[rows.dtype]
