"""LASP-2: linear-attention sequence parallelism with one all-gather of the states.

Sun et al., "LASP-2: Rethinking Sequence Parallelism for Linear Attention and Its Hybrid"
(arXiv 2502.07563). LASP (``lasp.py``) passes the state along the chain, so rank ``r`` waits
for every rank before it. LASP-2 lets every rank compute its shard's own state contribution
``KV_r = sum_j lambda^(n_r - 1 - j) k_j^T v_j`` at once and gathers them all; each rank then
combines the states of the ranks before it (a prefix with the decays):

    S_in(r) = sum_{j < r} lambda^(n_{j+1} + ... + n_{r-1}) KV_j.

Forward, on rank ``r``:

1. compute ``KV_r`` (one d x e product) and start the all-gather of every rank's;
2. compute the shard's own (intra) attention while it travels;
3. combine ``S_in(r)`` and add ``lambda^(i + 1) q_i S_in`` to the output.

Backward: compute ``dS_in(r) = Q^T (a dO)`` and start the all-gather of every rank's; recompute
the shard's own gradients while it travels; then the gradient of ``KV_r`` is the suffix
``sum_{m > r} lambda^(n_{r+1} + ... + n_{m-1}) dS_in(m)``, added to ``dK`` and ``dV``.

Cost: one all-gather of ``B H d e`` elements per rank each way, whatever the sequence length,
and no serial chain. With a decay every rank needs every shard's length: ``splits``.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.fused import linear_attention as la
from commfuse.fused.sequence_parallel import check_splits


def _gather(comm: Communicator, state: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start the all-gather of every rank's ``state``: ``(gathered [P, *state.shape], handle)``."""
    flat = state.new_empty((comm.world_size * state.shape[0], *state.shape[1:]))
    handle = comm.all_gather(flat, state, async_op=True)
    assert handle is not None
    return flat.view(comm.world_size, *state.shape), handle


def _weights(
    decay: torch.Tensor | None, splits: list[int], pairs: list[tuple[int, int]], like: torch.Tensor
) -> torch.Tensor:
    """``lambda^(rows strictly between j and m)`` for each ``(j, m)`` in ``pairs``: [H, len, 1, 1]."""
    rows = [sum(splits[j + 1 : m]) for j, m in pairs]
    between = torch.tensor(rows, device=like.device)
    return la.powers(decay, between, like).view(-1, len(pairs), 1, 1)


def _combine(
    gathered: torch.Tensor,
    decay: torch.Tensor | None,
    splits: list[int],
    pairs: list[tuple[int, int]],
    pick: int,
) -> torch.Tensor:
    """``sum over (j, m) in pairs of lambda^(between) gathered[pair[pick]]`` [B, H, d, e]."""
    out = torch.zeros_like(gathered[0])
    if not pairs:
        return out
    weights = _weights(decay, splits, pairs, gathered)
    for i, pair in enumerate(pairs):
        out += weights[:, i] * gathered[pair[pick]]
    return out


class _LASP2(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor | None,
        comm: Communicator,
        splits: list[int],
        block: int,
    ) -> torch.Tensor:
        rank = comm.rank
        a, g, _ = la.shard_factors(decay, q.shape[2], q)
        kv = torch.matmul((k * g).transpose(-1, -2), v).contiguous()
        gathered, handle = _gather(comm, kv)
        o, _ = la.local_attention(q, k, v, decay, block=block)  # while the states travel
        handle.wait()
        state_in = _combine(gathered, decay, splits, [(j, rank) for j in range(rank)], 0)
        ctx.save_for_backward(q, k, v, state_in)
        ctx.decay, ctx.comm, ctx.splits, ctx.block = decay, comm, splits, block
        return o + la.inter(q, a, state_in)

    @staticmethod
    def backward(ctx: Any, grad_o: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, state_in = ctx.saved_tensors
        comm: Communicator = ctx.comm
        rank, world = comm.rank, comm.world_size
        grad_o = grad_o.contiguous()
        a, g, _ = la.shard_factors(ctx.decay, q.shape[2], q)
        gathered, handle = _gather(comm, la.state_grad(q, a, grad_o))
        grad_q, grad_k, grad_v = la.local_backward(
            (q, k, v, state_in), ctx.decay, ctx.block, grad_o
        )  # while the state gradients travel
        handle.wait()
        later = [(rank, m) for m in range(rank + 1, world)]
        if later:
            grad_kv = _combine(gathered, ctx.decay, ctx.splits, later, 1)
            la.add_state_grads(k, v, g, grad_kv, grad_k, grad_v)
        return grad_q, grad_k, grad_v, None, None, None, None


def lasp2(
    comm: Communicator,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None = None,
    *,
    splits: list[int] | None = None,
    block: int = la.BLOCK,
    check: bool = True,
) -> torch.Tensor:
    """Causal linear attention of a sequence split over the ranks of ``comm`` in rank order,
    by one all-gather of the shards' states each way (LASP-2, module docstring); differentiable.

    Args:
        comm: the ranks that share the sequence; rank ``r`` holds the ``r``-th shard.
        q: this rank's queries [B, H, n_r, d] (shards may differ in length; empty is allowed).
        k: this rank's keys [B, H, n_r, d].
        v: this rank's values [B, H, n_r, e].
        decay: ``lambda`` per head [H] in (0, 1], the same on every rank; None: no decay.
        splits: every rank's shard length ``n_j``, the same list on every rank; None: every
            shard as long as this one. Only a decay needs it.
        block: rows per block of the local chunked attention.
        check: first check with one tiny all-gather that every rank's state has the same shape
            and dtype and the sequence the same total length.

    Returns:
        This rank's rows of the output [B, H, n_r, e]: equal to ``causal_linear_attention`` of
        the whole sequence, rows of this shard.

    Raises:
        ValueError: bad shapes or decay (``check_inputs``), ``splits`` of the wrong length or
            that disagree with this shard; ranks whose B, H, d, e, dtype or total length
            differ (``InconsistentInputError``, naming each rank's shape).
        CommTimeoutError: the all-gather did not finish within the communicator's deadline.

    Example:
        ```python
        o = lasp2(comm, q_shard, k_shard, v_shard, torch.tensor([0.99, 0.95]), splits=[5, 4])
        o.sum().backward()  # one all-gather of the state gradients
        ```
    """
    la.check_inputs(q, k, v, decay, block)
    splits = check_splits(comm, splits, q.shape[2], local=True)
    if check:
        la.check_same_state(comm, q, v, "lasp2", sum(splits))
    out: torch.Tensor = _LASP2.apply(q, k, v, decay, comm, splits, block)  # type: ignore[no-untyped-call]
    return out
