"""The MoE operators as PyTorch operators: ``torch.ops.commfuse.gemm_all_to_all`` (combine side)
and ``torch.ops.commfuse.all_to_all_gemm`` (dispatch side), with autograd.

Same conventions as ``ops.py``: the communicator travels as its name ``comm.key``,
``register_fake`` gives the shapes without communicating, ``register_autograd`` the overlapped
backward (``gemm_all_to_all.py`` says which collective each backward is). The
routing travels as ``counts`` (the ``[P, E]`` matrix, flattened row-major) and
``experts_per_rank``.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.fused import gemm_all_to_all as ga


def routing(comm_key: str, counts: list[int], experts_per_rank: list[int]) -> ga.Routing:
    comm = Communicator.resolve(comm_key)
    num_experts = sum(experts_per_rank)
    if len(counts) != comm.world_size * num_experts:
        raise ValueError(
            f"counts must hold world_size x num_experts = {comm.world_size} x {num_experts} "
            f"entries, got {len(counts)}"
        )
    # host metadata: Routing turns the counts into split sizes (Python ints)
    matrix = torch.tensor(counts, dtype=torch.int64, device="cpu").view(
        comm.world_size, num_experts
    )
    return ga.Routing(comm, matrix, list(experts_per_rank))


# -- combine: GEMM + All-to-All -------------------------------------------------------------------
@torch.library.custom_op("commfuse::gemm_all_to_all", mutates_args=())
def gemm_all_to_all_op(
    h: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    experts_per_rank: list[int],
    comm_key: str,
    chunks: int,
) -> torch.Tensor:
    """Expert GEMM of the expert-side rows ``h``, each destination's rows sent as soon as they
    are computed: the token-side result ``[S_r, N]``."""
    rt = routing(comm_key, counts, experts_per_rank)
    return ga.gemm_all_to_all(Communicator.resolve(comm_key), rt, h, weight, chunks=chunks)


@gemm_all_to_all_op.register_fake
def _gemm_all_to_all_fake(
    h: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    experts_per_rank: list[int],
    comm_key: str,
    chunks: int,
) -> torch.Tensor:
    rt = routing(comm_key, counts, experts_per_rank)
    return h.new_empty((rt.send_start[-1], weight.shape[1]))


def _keep_routing(ctx: Any, inputs: tuple[Any, ...]) -> None:
    """The routing and the communicator's key, for the backward (both operators' arguments
    after the two tensors are ``counts, experts_per_rank, comm_key, chunks``)."""
    counts, experts_per_rank, comm_key, chunks = inputs[2:]
    ctx.meta = (list(counts), list(experts_per_rank), comm_key, chunks)


def _routed_backward(ctx: Any, grad: torch.Tensor, backward: Any) -> tuple[Any, ...]:
    """``backward(comm, routing, grad, saved, weight, chunks=)`` on the saved rows and weight;
    no gradient for the routing, the key or the chunks."""
    saved, weight = ctx.saved_tensors
    counts, experts_per_rank, comm_key, chunks = ctx.meta
    rt = routing(comm_key, counts, experts_per_rank)
    comm = Communicator.resolve(comm_key)
    grad_in, grad_w = backward(comm, rt, grad.contiguous(), saved, weight, chunks=chunks)
    return grad_in, grad_w, None, None, None, None


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])  # h, weight
    _keep_routing(ctx, inputs)


def _combine_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return _routed_backward(ctx, grad, ga.gemm_all_to_all_backward)


gemm_all_to_all_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# -- dispatch: All-to-All + GEMM ------------------------------------------------------------------
@torch.library.custom_op("commfuse::all_to_all_gemm", mutates_args=())
def all_to_all_gemm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    experts_per_rank: list[int],
    comm_key: str,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-side rows ``x`` sent to their experts, each source's rows multiplied as soon as they
    arrive: (expert-side output ``[R_r, N]``, received rows ``[R_r, K]``, not differentiable)."""
    rt = routing(comm_key, counts, experts_per_rank)
    return ga.all_to_all_gemm(Communicator.resolve(comm_key), rt, x, weight, chunks=chunks)


@all_to_all_gemm_op.register_fake
def _all_to_all_gemm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    experts_per_rank: list[int],
    comm_key: str,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    rt = routing(comm_key, counts, experts_per_rank)
    rows = rt.recv_start[-1]
    return x.new_empty((rows, weight.shape[1])), x.new_empty((rows, x.shape[1]))


def _dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], inputs[1])  # the received rows, weight
    _keep_routing(ctx, inputs)


def _dispatch_backward(
    ctx: Any, grad: torch.Tensor, grad_recv: torch.Tensor | None
) -> tuple[Any, ...]:
    return _routed_backward(ctx, grad, ga.all_to_all_gemm_backward)


all_to_all_gemm_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
