"""LASP: linear-attention sequence parallelism along the chain of ranks.

Sun et al., "Linear Attention Sequence Parallelism" (arXiv 2404.02882). Rank ``r`` holds the
``n_r`` consecutive rows of its shard of the sequence (any lengths, an empty shard too); the
only thing a rank needs from the rows before it is the d x e key-value state ``S_in``
(``linear_attention.py``). Forward, on rank ``r``:

1. post the receive of ``S_in`` from rank ``r - 1`` (rank 0: ``S_in = 0``);
2. compute the shard's own attention and state ``KV_r`` while it travels (``local_attention``);
3. send ``S_out = lambda^n_r S_in + KV_r`` to rank ``r + 1``, then add the incoming term
   ``lambda^(i + 1) q_i S_in`` to the output while it travels.

Backward mirrors it from the last rank down: post the receive of ``dS_out`` from ``r + 1``,
compute the shard's own gradients (recomputing its attention) and ``dS_in = Q^T (a dO)``
while it travels, send ``dS_in + lambda^n_r dS_out`` to ``r - 1``, then add ``dS_out``'s
share to ``dK`` and ``dV``.

Cost: ``P - 1`` messages each way over the whole chain, one state ``B H d e`` elements per
message, whatever the sequence length; but the chain is serial (rank ``r`` waits for all ranks
before it), which LASP-2 (``lasp2.py``) removes with one all-gather.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.comm import Communicator, Handle
from commfuse.fused import linear_attention as la

#: Stats label of LASP's point-to-point traffic (exact bytes and messages).
LABEL = "lasp"
_FORWARD_TAG, _BACKWARD_TAG = 0, 1


class _LASP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor | None,
        comm: Communicator,
        block: int,
    ) -> torch.Tensor:
        rank, world = comm.rank, comm.world_size
        b, h, n, d = q.shape
        state_in = q.new_zeros((b, h, d, v.shape[-1]))
        recv: Handle | None = None
        if rank > 0:
            recv = comm.irecv(state_in, rank - 1, tag=_FORWARD_TAG, label=LABEL)
        o, kv = la.local_attention(q, k, v, decay, block=block)  # while S_in travels
        a, _, total = la.shard_factors(decay, n, q)
        if recv is not None:
            recv.wait()
        send: Handle | None = None
        if rank < world - 1:
            state_out = (total * state_in + kv).contiguous()
            send = comm.isend(state_out, rank + 1, tag=_FORWARD_TAG, label=LABEL)
        o = o + la.inter(q, a, state_in)  # while S_out travels
        if send is not None:
            send.wait()
        ctx.save_for_backward(q, k, v, state_in)
        ctx.decay, ctx.comm, ctx.block = decay, comm, block
        return o

    @staticmethod
    def backward(ctx: Any, grad_o: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, state_in = ctx.saved_tensors
        comm: Communicator = ctx.comm
        rank, world = comm.rank, comm.world_size
        grad_o = grad_o.contiguous()
        grad_out_state = torch.zeros_like(state_in)
        recv: Handle | None = None
        if rank < world - 1:
            recv = comm.irecv(grad_out_state, rank + 1, tag=_BACKWARD_TAG, label=LABEL)
        a, g, total = la.shard_factors(ctx.decay, q.shape[2], q)
        grad_state = la.state_grad(q, a, grad_o)
        grads = la.local_backward((q, k, v, state_in), ctx.decay, ctx.block, grad_o)
        if recv is not None:
            recv.wait()
        send: Handle | None = None
        if rank > 0:
            grad_in = (grad_state + total * grad_out_state).contiguous()
            send = comm.isend(grad_in, rank - 1, tag=_BACKWARD_TAG, label=LABEL)
        grad_q, grad_k, grad_v = grads
        if recv is not None:  # while dS_in travels
            la.add_state_grads(k, v, g, grad_out_state, grad_k, grad_v)
        if send is not None:
            send.wait()
        return grad_q, grad_k, grad_v, None, None, None


def lasp(
    comm: Communicator,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None = None,
    *,
    block: int = la.BLOCK,
    check: bool = True,
) -> torch.Tensor:
    """Causal linear attention of a sequence split over the ranks of ``comm`` in rank order,
    the state passed along the chain of ranks (LASP, module docstring); differentiable.

    Args:
        comm: the ranks that share the sequence; rank ``r`` holds the ``r``-th shard.
        q: this rank's queries [B, H, n_r, d] (shards may differ in length; empty is allowed).
        k: this rank's keys [B, H, n_r, d].
        v: this rank's values [B, H, n_r, e].
        decay: ``lambda`` per head [H] in (0, 1], the same on every rank; None: no decay.
        block: rows per block of the local chunked attention.
        check: first check with one tiny all-gather that every rank's state has the same shape
            and dtype (a mismatch would otherwise fail inside the exchange).

    Returns:
        This rank's rows of the output [B, H, n_r, e]: equal to ``causal_linear_attention`` of
        the whole sequence, rows of this shard.

    Raises:
        ValueError: bad shapes or decay (``check_inputs``); ranks whose B, H, d, e or dtype
            differ (``InconsistentInputError``, naming each rank's shape).
        CommTimeoutError: a neighbour's state did not arrive within the communicator's deadline.

    Example:
        ```python
        o = lasp(comm, q_shard, k_shard, v_shard, torch.tensor([0.99, 0.95]))
        o.sum().backward()  # dS passes back from the last rank to the first
        ```
    """
    la.check_inputs(q, k, v, decay, block)
    if check:
        la.check_same_state(comm, q, v, LABEL)
    out: torch.Tensor = _LASP.apply(q, k, v, decay, comm, block)  # type: ignore[no-untyped-call]
    return out
