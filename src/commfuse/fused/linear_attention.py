"""Causal linear attention, chunked, with an optional per-head decay (lightning attention).

Linear attention (Katharopoulos et al., "Transformers are RNNs", ICML 2020) drops the softmax:
with a decay ``lambda`` per head (Qin et al., "Lightning Attention-2", arXiv 2401.04658; the
decay of RetNet and TransNormerLLM), row ``t`` of the output is

    o_t = q_t S_t,    S_t = lambda S_{t-1} + k_t^T v_t,    S_0 = 0,

so ``o_t = sum_{s <= t} lambda^(t - s) (q_t . k_s) v_s``; ``lambda = 1`` is plain causal linear
attention. ``S`` is the d x e key-value state. Computed in blocks of ``block`` rows (lightning
attention's tiling), each block ``b`` of rows ``i = 0 .. c-1`` with the state ``S`` before it:

1. intra-block: ``((Q_b K_b^T) * M) V_b`` with the masked decay ``M_ij = lambda^(i - j)``
   for ``j <= i`` (0 above the diagonal);
2. inter-block: ``lambda^(i + 1) q_i S``;
3. the state after the block: ``lambda^c S + sum_j lambda^(c - 1 - j) k_j^T v_j``.

The sequence-parallel forms split the sequence over ranks and pass only the state between
them: LASP (``lasp.py``) along the chain of ranks, LASP-2 (``lasp2.py``) by one all-gather.
Both use ``local_attention`` for their shard (zero incoming state), then add the incoming
state's term ``lambda^(i + 1) q_i S_in`` (``inter``), whose gradients are closed forms.

Shapes: ``q``, ``k`` [B, H, N, d], ``v`` [B, H, N, e], ``decay`` [H] in (0, 1] or None; every
buffer is made on the inputs' device and dtype.
"""

from __future__ import annotations

import torch

from commfuse.comm import Communicator, check_consistent

#: Rows per block of the chunked computation (lightning attention's tile).
BLOCK = 64


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None, block: int
) -> None:
    """ValueError naming the problem: shapes, dtypes, the decay's range, ``block < 1``."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "linear attention needs q, k [B, H, N, d] and v [B, H, N, e], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if block < 1:
        raise ValueError(f"block must be >= 1 rows, got {block}")
    if decay is not None:
        if decay.shape != (q.shape[1],):
            raise ValueError(
                f"decay needs one value per head ({q.shape[1]}), got {tuple(decay.shape)}"
            )
        if not bool(((decay > 0) & (decay <= 1)).all()):
            raise ValueError(f"decay must lie in (0, 1], got {decay.tolist()}")


def powers(decay: torch.Tensor | None, exponents: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``decay[h] ** exponents`` as [H, *exponents.shape] in ``like``'s dtype and device (ones
    of shape [1, ...] without a decay), computed in at least float32: a half-precision
    exponent would round sequence positions past 256."""
    if decay is None:
        return torch.ones((1, *exponents.shape), dtype=like.dtype, device=like.device)
    wide = torch.promote_types(like.dtype, torch.float32)
    exponents = exponents.to(device=like.device, dtype=wide)
    lam = decay.to(device=like.device, dtype=wide)
    return torch.pow(lam.view(-1, *([1] * exponents.dim())), exponents).to(like.dtype)


def shard_factors(
    decay: torch.Tensor | None, rows: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, g, total)`` of a shard of ``rows`` rows: ``a_i = lambda^(i + 1)`` [H, rows, 1] (the
    incoming state's weight on row ``i``), ``g_j = lambda^(rows - 1 - j)`` [H, rows, 1] (row
    ``j``'s weight in the outgoing state) and ``total = lambda^rows`` [H, 1, 1]."""
    i = torch.arange(rows, device=like.device)
    a = powers(decay, i + 1, like).unsqueeze(-1)
    g = powers(decay, rows - 1 - i, like).unsqueeze(-1)
    total = powers(decay, torch.tensor([rows], device=like.device), like).view(-1, 1, 1)
    return a, g, total


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, S)``: causal linear attention of one sequence in blocks (module docstring), from the
    incoming state ``state`` [B, H, d, e] (None: zero), and the state after its last row.
    Plain torch operations: autograd differentiates it."""
    b, h, n, _ = q.shape
    s = q.new_zeros((b, h, q.shape[-1], v.shape[-1])) if state is None else state
    # One block's factors serve every block; a shorter last block takes their tail.
    width = min(block, n)
    a, g, _ = shard_factors(decay, width, q)
    i = torch.arange(width, device=q.device)
    lags = i.view(-1, 1) - i.view(1, -1)
    mask = powers(decay, lags.clamp(min=0), q) * (lags >= 0).to(q.dtype)
    outs = []
    for start in range(0, n, block):
        qb, kb, vb = (t[:, :, start : start + block] for t in (q, k, v))
        c = qb.shape[2]
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * mask[..., :c, :c]
        outs.append(torch.matmul(scores, vb) + a[:, :c] * torch.matmul(qb, s))
        # lambda^c S + sum_j lambda^(c - 1 - j) k_j^T v_j, with lambda^c = a[c - 1]
        s = a[:, c - 1 : c] * s + torch.matmul((kb * g[:, width - c :]).transpose(-1, -2), vb)
    o = torch.cat(outs, dim=2) if outs else q.new_zeros((b, h, 0, v.shape[-1]))
    return o, s


def causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """Causal linear attention ``o_t = q_t S_t``, ``S_t = lambda S_{t-1} + k_t^T v_t``, on one
    process, in blocks of ``block`` rows (module docstring); differentiable by autograd.

    Args:
        q: queries [B, H, N, d].
        k: keys [B, H, N, d].
        v: values [B, H, N, e].
        decay: ``lambda`` per head [H], each in (0, 1]; None: no decay (``lambda = 1``).
        block: rows per block of the intra-block masked product.

    Returns:
        The output [B, H, N, e].

    Raises:
        ValueError: shapes that do not fit, mixed dtypes, a decay outside (0, 1].

    Example:
        ```python
        q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
        o = causal_linear_attention(q, k, v, torch.tensor([0.99, 0.9]))
        ```
    """
    check_inputs(q, k, v, decay, block)
    return local_attention(q, k, v, decay, block=block)[0]


def inter(q: torch.Tensor, a: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """The incoming state's term of a shard's output: ``a_i q_i S_in``."""
    return a * torch.matmul(q, state_in)


def state_grad(q: torch.Tensor, a: torch.Tensor, grad_o: torch.Tensor) -> torch.Tensor:
    """The incoming state's gradient from this shard's output: ``Q^T (a dO)`` [B, H, d, e]."""
    return torch.matmul(q.transpose(-1, -2), a * grad_o).contiguous()


def local_backward(
    saved: tuple[torch.Tensor, ...],
    decay: torch.Tensor | None,
    block: int,
    grad_o: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_q, grad_k, grad_v)`` of a shard's output ``local_attention(q, k, v)[0] +
    inter(q, a, S_in)`` for ``saved = (q, k, v, S_in)``, without the outgoing state's share
    (``add_state_grads``).

    The local attention's forward is recomputed under autograd (as activation checkpointing
    does); the incoming state's term adds the closed form ``grad_q += a dO S_in^T``."""
    q, k, v, state_in = saved
    a, _, _ = shard_factors(decay, q.shape[2], q)
    if q.shape[2] == 0:  # an empty shard: only the state passes through
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    else:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            o, _ = local_attention(leaves[0], leaves[1], leaves[2], decay, block=block)
            grad_q, grad_k, grad_v = torch.autograd.grad(o, leaves, grad_o)
    grad_q = grad_q + a * torch.matmul(grad_o, state_in.transpose(-1, -2))
    return grad_q, grad_k, grad_v


def add_state_grads(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    grad_out_state: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
) -> None:
    """Add the outgoing state's share ``S_out = ... + sum_j g_j k_j^T v_j`` to the gradients, in
    place: ``grad_k += g (V dS^T)``, ``grad_v += g (K dS)``."""
    grad_k.add_(g * torch.matmul(v, grad_out_state.transpose(-1, -2)))
    grad_v.add_(g * torch.matmul(k, grad_out_state))


def check_same_state(
    comm: Communicator, q: torch.Tensor, v: torch.Tensor, what: str, *extra: int
) -> None:
    """InconsistentInputError (a ValueError) naming every rank's shapes unless all ranks hold the
    same state shape [B, H, d, e] and dtype (and the same ``extra`` sizes): one tiny all-gather."""
    b, h, _, d = q.shape
    meta = torch.empty((b, h, d, v.shape[-1], *extra), dtype=q.dtype, device="meta")
    check_consistent(comm, meta, what)
