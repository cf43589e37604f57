"""Graph aggregation fused with its halo exchange: ``A @ H`` on a node-partitioned graph.

Full-graph GNN training partitions the nodes; rank ``r`` owns rows ``V_r`` of the features
``H`` and of the (normalised) adjacency ``A``. Its aggregation ``(A @ H)[V_r]`` needs, besides
its own rows, the *halo*: the rows of other ranks' nodes adjacent to its own. Only those
boundary rows travel (a sparse All-to-All), never the whole ``H``. Fused, as MGG does on GPUs
(Wang et al., OSDI 2023):

1. Post the receives of every peer's boundary rows, then send each peer the rows it needs.
2. Aggregate over the local columns, ``A_loc @ H_r``, while the halos travel: interior nodes
   (no remote neighbour) are done.
3. As peer ``j``'s rows land, add ``A_j @ halo_j`` (boundary nodes).

Backward (``HaloAggregate``): ``grad_H_r = A_loc^T G`` plus, for each peer ``j``, the gradient
``A_j^T G`` of the rows ``j`` sent, which travels back to ``j`` (the same bytes in reverse) and is
added to the rows it came from.

Modes (``HaloMode``): ``Exact()``; ``Stale()`` (PipeGCN, Wan et al., ICLR 2022): use the halo
and the halo gradients of the previous step, so this step's exchange overlaps the whole layer
(the first step is exact; ``Stale(steps=k)``: DistGNN's delayed updates, Vasimuddin et al., SC21, the
halo of ``k`` steps before); ``Sample(p)`` (BNS-GCN, Wan et al., MLSys 2022): each step send a
random fraction ``p`` of the boundary rows, the receiver scaling them by ``1 / p`` (unbiased), so
bytes fall by ``p``. Cost per layer and direction: boundary rows x ``d`` x element size (times
``p`` when sampled) in ``P - 1`` messages; the plan (``HaloPlan``) comes from an offline
partitioner (``commfuse.workloads.graph``). ``halo_aggregate_reference`` is the unfused
reference: one All-to-All of the same rows, then the whole product.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, TypeAlias

import torch

from commfuse.comm import Communicator, Handle
from commfuse.fused import baselines

#: Stats label of the halo exchange's point-to-point traffic (exact bytes and messages).
LABEL = "graph_halo"
_FORWARD_TAG, _BACKWARD_TAG = 11, 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exact:
    """Every step exchanges this step's halo and its gradients."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stale:
    """PipeGCN (``steps=1``): aggregate with the previous step's halo (and add the previous
    step's halo gradients) while this step's travel; DistGNN's delayed updates for
    ``steps > 1``: those of step ``max(0, t - steps)``. The first step is exact."""

    steps: int = 1
    """How many steps old the halo (and its gradients) may be; >= 1."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Stale.steps must be an int >= 1, got {self.steps!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """BNS-GCN: each step, each rank sends a random fraction of its boundary rows."""

    p: float = 0.1
    """Probability that a boundary row is sent (and its gradient returned); in ``(0, 1]``."""
    seed: int = 0
    """Seeds the masks: sender and receiver draw the same one from (seed, step, pair)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"Sample.p must be in (0, 1], got {self.p}")


HaloMode: TypeAlias = Exact | Stale | Sample
"""How a layer exchanges its halo: ``Exact()``, ``Stale()`` or ``Sample(p=...)``."""


@dataclasses.dataclass(eq=False)
class HaloPlan:
    """One rank's share of a partitioned graph: what it sends, receives and aggregates.

    Halo rows from peer ``j`` arrive in the order of ``j``'s ``send_rows[r]``; the partitioner
    makes both sides agree (by global node id)."""

    send_rows: list[torch.Tensor]
    """Per peer, the local rows (int64) that peer needs; empty for this rank itself."""
    recv_counts: list[int]
    """Per peer, the halo rows it sends this rank (0 for this rank itself)."""
    local_adj: torch.Tensor
    """Sparse ``[n_local, n_local]``: the adjacency among this rank's own nodes."""
    halo_adj: list[torch.Tensor]
    """Per peer ``j``, sparse ``[n_local, recv_counts[j]]``: edges to ``j``'s halo rows."""

    def __post_init__(self) -> None:
        world = len(self.send_rows)
        if len(self.recv_counts) != world or len(self.halo_adj) != world:
            raise ValueError("send_rows, recv_counts and halo_adj need one entry per rank")
        for j, (adj, count) in enumerate(zip(self.halo_adj, self.recv_counts, strict=True)):
            if tuple(adj.shape) != (self.num_local, count):
                raise ValueError(
                    f"halo_adj[{j}] is {tuple(adj.shape)}, want ({self.num_local}, {count})"
                )
        self.local_adj_t = self.local_adj.t().coalesce()
        self.halo_adj_t = [a.t().coalesce() for a in self.halo_adj]

    @property
    def num_local(self) -> int:
        """This rank's own nodes (rows of its output)."""
        return int(self.local_adj.shape[0])

    def boundary_rows(self) -> int:
        """Rows this rank sends per exact exchange (its boundary rows, counted per peer)."""
        return sum(int(rows.numel()) for rows in self.send_rows)


class HaloState:
    """What a layer carries from step to step: the step count (``Sample``'s masks) and, for
    ``Stale(steps=k)``, the halos and halo gradients of the last ``k`` steps, oldest first
    (each a list of one tensor per peer). One per layer."""

    def __init__(self) -> None:
        self.step = 0
        self.halo: deque[list[torch.Tensor]] = deque()
        self.grads: deque[list[torch.Tensor]] = deque()

    @staticmethod
    def keep(history: deque[list[torch.Tensor]], new: list[torch.Tensor], steps: int) -> None:
        """Append ``new`` and drop what is older than ``steps`` steps: the oldest kept is the
        one step ``t + 1`` uses."""
        history.append(new)
        while len(history) > steps:
            history.popleft()


def exchange_masks(
    comm: Communicator, plan: HaloPlan, mode: HaloMode, step: int
) -> list[torch.Tensor]:
    """Per peer ``j``, the positions (int64) among the rows ``r`` sends ``j`` that go this step,
    and among those ``j`` sends ``r``: ``out[2 j]`` and ``out[2 j + 1]``. Every row for
    ``Exact`` and ``Stale``; for ``Sample``, drawn on the host from (seed, step, pair), so both
    ends draw the same without a message (callers move them to the input's device)."""
    world, rank = comm.world_size, comm.rank
    out = []
    for j in range(world):
        for src, dst, n in ((rank, j, plan.send_rows[j].numel()), (j, rank, plan.recv_counts[j])):
            if not isinstance(mode, Sample) or mode.p >= 1.0:
                out.append(torch.arange(int(n), device="cpu"))
                continue
            gen = torch.Generator().manual_seed(
                (mode.seed * 1_000_003 + (step * world + src) * world + dst) % (2**63)
            )
            out.append(
                torch.nonzero(torch.rand(int(n), generator=gen, device="cpu") < mode.p).flatten()
            )
    return out


def _exchange(
    comm: Communicator, outgoing: list[torch.Tensor], sizes: list[int], like: torch.Tensor, tag: int
) -> tuple[list[torch.Tensor], list[Handle]]:
    """Post receives of ``sizes[j]`` rows from each peer, then send ``outgoing[j]`` to each."""
    rank, world, dim = comm.rank, comm.world_size, like.shape[1]
    bufs = [like.new_empty((sizes[j] if j != rank else 0, dim)) for j in range(world)]
    handles = []
    for step in range(1, world):
        src = (rank - step) % world
        handles.append(comm.irecv(bufs[src], src, tag=tag, label=LABEL))
    for step in range(1, world):
        dst = (rank + step) % world
        handles.append(comm.isend(outgoing[dst].contiguous(), dst, tag=tag, label=LABEL))
    return bufs, handles


def _expand(rows: torch.Tensor, where: torch.Tensor, count: int, scale: float) -> torch.Tensor:
    """The ``count`` rows of which ``rows`` are those at ``where``, the rest zero, scaled."""
    if rows.shape[0] == count:
        return rows if scale == 1.0 else rows * scale
    full = rows.new_zeros((count, rows.shape[1]))
    full[where.to(rows.device)] = rows * scale
    return full


class HaloAggregate(torch.autograd.Function):
    """``(A @ H)[V_r]`` with the halo exchange fused in (module docstring); differentiable in
    ``h``."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        comm: Communicator,
        plan: HaloPlan,
        mode: HaloMode,
        state: HaloState,
    ) -> torch.Tensor:
        world, rank = comm.world_size, comm.rank
        masks = exchange_masks(comm, plan, mode, state.step)
        scale = 1.0 / mode.p if isinstance(mode, Sample) else 1.0
        ctx.comm, ctx.plan, ctx.mode, ctx.state, ctx.masks, ctx.scale = (
            comm, plan, mode, state, masks, scale
        )  # fmt: skip
        state.step += 1
        dev = h.device
        outgoing = [h[plan.send_rows[j].to(dev)[masks[2 * j].to(dev)]] for j in range(world)]
        sizes = [int(masks[2 * j + 1].numel()) for j in range(world)]
        stale = isinstance(mode, Stale) and len(state.halo) > 0
        bufs, handles = _exchange(comm, outgoing, sizes, h, _FORWARD_TAG)
        out: torch.Tensor = torch.sparse.mm(
            plan.local_adj.to(device=dev, dtype=h.dtype), h
        )  # interior nodes: while halos travel
        for step in range(1, world):
            src = (rank - step) % world
            if not stale:
                handles[step - 1].wait()
            halo = state.halo[0][src] if stale else bufs[src]
            full = _expand(halo, masks[2 * src + 1], plan.recv_counts[src], scale)
            out = out + torch.sparse.mm(plan.halo_adj[src].to(device=dev, dtype=h.dtype), full)
        for handle in handles:
            handle.wait()
        if isinstance(mode, Stale):
            state.keep(state.halo, bufs, mode.steps)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        comm: Communicator = ctx.comm
        plan: HaloPlan = ctx.plan
        state: HaloState = ctx.state
        masks: list[torch.Tensor] = ctx.masks
        world, rank, dev = comm.world_size, comm.rank, grad.device
        grad = grad.contiguous()
        outgoing = [
            (
                torch.sparse.mm(plan.halo_adj_t[j].to(device=dev, dtype=grad.dtype), grad)
                * ctx.scale
            )[masks[2 * j + 1].to(dev)]
            if j != rank
            else grad.new_empty((0, grad.shape[1]))
            for j in range(world)
        ]
        sizes = [int(masks[2 * j].numel()) for j in range(world)]
        stale = isinstance(ctx.mode, Stale) and len(state.grads) > 0
        bufs, handles = _exchange(comm, outgoing, sizes, grad, _BACKWARD_TAG)
        grad_h: torch.Tensor = torch.sparse.mm(
            plan.local_adj_t.to(device=dev, dtype=grad.dtype), grad
        )  # while the gradients travel
        for step in range(1, world):
            src = (rank - step) % world
            if not stale:
                handles[step - 1].wait()
            back = state.grads[0][src] if stale else bufs[src]
            rows = plan.send_rows[src].to(dev)[masks[2 * src].to(dev)]
            grad_h = grad_h.index_add(0, rows, back)
        for handle in handles:
            handle.wait()
        if isinstance(ctx.mode, Stale):
            state.keep(state.grads, bufs, ctx.mode.steps)
        return grad_h, None, None, None, None


def _all_to_all_rows(
    comm: Communicator, blocks: list[torch.Tensor], sizes: list[int], like: torch.Tensor
) -> list[torch.Tensor]:
    """One All-to-All (``baselines.ALL_TO_ALL``) of ``blocks[j]`` to each rank ``j``; returns
    the ``sizes[j]`` rows received from each."""
    from commfuse.collectives import all_to_all

    send = torch.cat([b.reshape(-1, like.shape[1]) for b in blocks])
    recv = like.new_empty((sum(sizes), like.shape[1]))
    in_splits = [int(b.shape[0]) for b in blocks]
    all_to_all(comm, recv, send, list(sizes), in_splits, algo=baselines.ALL_TO_ALL)
    return list(torch.split(recv, sizes))


class _UnfusedHalo(torch.autograd.Function):
    """The unfused reference: one All-to-All of the boundary rows, then the whole aggregation;
    backward: the whole transposed product, then one All-to-All of the halo gradients."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, comm: Communicator, plan: HaloPlan) -> torch.Tensor:
        ctx.comm, ctx.plan = comm, plan
        dev = h.device
        sent = [h[rows.to(dev)] for rows in plan.send_rows]
        halos = _all_to_all_rows(comm, sent, plan.recv_counts, h)
        out: torch.Tensor = torch.sparse.mm(plan.local_adj.to(device=dev, dtype=h.dtype), h)
        for adj, halo in zip(plan.halo_adj, halos, strict=True):
            out = out + torch.sparse.mm(adj.to(device=dev, dtype=h.dtype), halo)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        comm: Communicator = ctx.comm
        plan: HaloPlan = ctx.plan
        grad, dev = grad.contiguous(), grad.device
        back = [torch.sparse.mm(a.to(device=dev, dtype=grad.dtype), grad) for a in plan.halo_adj_t]
        sizes = [int(rows.numel()) for rows in plan.send_rows]
        received = _all_to_all_rows(comm, back, sizes, grad)
        grad_h: torch.Tensor = torch.sparse.mm(
            plan.local_adj_t.to(device=dev, dtype=grad.dtype), grad
        )
        for rows, part in zip(plan.send_rows, received, strict=True):
            grad_h = grad_h.index_add(0, rows.to(dev), part)
        return grad_h, None, None


def halo_aggregate_reference(comm: Communicator, plan: HaloPlan, h: torch.Tensor) -> torch.Tensor:
    """``Exact`` unfused: one All-to-All of the boundary rows (``baselines.ALL_TO_ALL``, its
    bytes counted under that algorithm's label), then ``A_loc @ h + sum_j A_j @ halo_j``;
    differentiable, its backward the mirror All-to-All. The same bytes as ``halo_aggregate``."""
    if h.dim() != 2 or h.shape[0] != plan.num_local:
        raise ValueError(
            f"h must be [{plan.num_local}, d] (this rank's nodes), got {tuple(h.shape)}"
        )
    out: torch.Tensor = _UnfusedHalo.apply(h, comm, plan)  # type: ignore[no-untyped-call]
    return out


def halo_aggregate(
    comm: Communicator,
    plan: HaloPlan,
    h: torch.Tensor,
    *,
    mode: HaloMode | None = None,
    state: HaloState | None = None,
) -> torch.Tensor:
    """``(A @ H)[V_r]`` for this rank's rows ``h`` ``[n_local, d]`` (module docstring).

    Args:
        comm: the group the graph is partitioned over.
        plan: this rank's ``HaloPlan``.
        h: this rank's node rows, ``[plan.num_local, d]``; differentiable.
        mode: ``Exact()`` (default), ``Stale()`` or ``Sample(p=...)``; the same on every rank.
        state: the layer's ``HaloState`` (needed by ``Stale`` and ``Sample``, which carry it
            from step to step); every rank calls its layers equally often.

    Returns:
        ``[plan.num_local, d]``, on ``h``'s device.

    Raises:
        ValueError: ``h`` does not match the plan, or a stateful mode has no state.

    Example::

        out = halo_aggregate(comm, plan, h, mode=Sample(p=0.1), state=layer_state)
    """
    mode = mode if mode is not None else Exact()
    if h.dim() != 2 or h.shape[0] != plan.num_local:
        raise ValueError(
            f"h must be [{plan.num_local}, d] (this rank's nodes), got {tuple(h.shape)}"
        )
    if len(plan.send_rows) != comm.world_size:
        raise ValueError(f"the plan has {len(plan.send_rows)} ranks, the group {comm.world_size}")
    if state is None:
        if not isinstance(mode, Exact):
            raise ValueError(f"{type(mode).__name__} carries state: pass a HaloState per layer")
        state = HaloState()
    out: torch.Tensor = HaloAggregate.apply(h, comm, plan, mode, state)  # type: ignore[no-untyped-call]
    return out
