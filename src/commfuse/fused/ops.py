"""The fused operators as PyTorch operators: ``torch.ops.commfuse.<name>``, with autograd.

``torch.library.custom_op`` makes each operator visible to the dispatcher (``torch.ops``),
``register_fake`` gives it a shape function (meta tensors can run it without communicating),
and ``register_autograd`` attaches the overlapped backward.

An operator's arguments must be tensors and plain values, so the communicator travels as its
name, ``comm.key``, which the operator resolves (``Communicator.resolve``), as torch's
functional collectives pass a process group's ``group_name``; the backward's context keeps the
name too, never the communicator. The modules pass it for you.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.fused import all_gather_gemm as agg
from commfuse.fused import embedding_all_to_all as emb
from commfuse.fused import gemm_all_reduce as gar
from commfuse.fused import gemm_reduce_scatter as grs
from commfuse.fused.chunking import BY_TABLE, ChunkSchedule


# -- GEMM + AllReduce -------------------------------------------------------------------------
@torch.library.custom_op("commfuse::gemm_all_reduce", mutates_args=())
def gemm_all_reduce_op(
    x: torch.Tensor, weight: torch.Tensor, comm_key: str, chunks: int
) -> torch.Tensor:
    """``all_reduce_sum(x @ weight^T)`` in ``chunks`` overlapped pieces (row-parallel linear)."""
    return gar.gemm_all_reduce(Communicator.resolve(comm_key), x, weight, chunks=chunks)


@gemm_all_reduce_op.register_fake
def _gemm_all_reduce_fake(
    x: torch.Tensor, weight: torch.Tensor, comm_key: str, chunks: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _gemm_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight)


def _gemm_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    grad_x, grad_w = gar.gemm_all_reduce_backward(grad, x, weight)
    return grad_x, grad_w, None, None


gemm_all_reduce_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# -- Embedding + All-to-All ---------------------------------------------------------------------
def anchor_for_backward(device: torch.device) -> torch.Tensor:
    """A zero-element leaf on ``device`` that requires grad while grad mode is on (see
    embedding_alltoall_op)."""
    return torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())


@torch.library.custom_op("commfuse::embedding_all_to_all", mutates_args=())
def embedding_all_to_all_op(
    tables: list[torch.Tensor],
    indices: list[torch.Tensor],
    offsets: list[torch.Tensor],
    batch_splits: list[int],
    tables_per_rank: list[int],
    dim: int,
    dtype: torch.dtype,
    mode: str,
    comm_key: str,
    chunks: int,
    by_table: bool,
    anchor: torch.Tensor,
) -> torch.Tensor:
    """Pooled lookups of the local tables for the global batch, exchanged so that each rank gets
    every table for its own samples: ``[B_r, T, D]`` (tables rank-major).

    The first eight arguments are the fields of ``emb.ShardedLookup``, in its order, passed one
    by one because an operator's arguments must be tensors and plain values. ``by_table``
    runs the by-table schedule (``chunks`` is then ignored).

    ``anchor`` is any tensor that requires grad when training (``anchor_for_backward()``): a rank
    that owns no table has no other input that does, and without it autograd would skip its
    backward while its peers wait for the gradients of its samples. When it requires grad and
    so does a table, the forward prepares the backward's table gradients while it waits for
    its exchange (``prepare_backward``)."""
    lookup = emb.ShardedLookup(
        tables, indices, offsets, batch_splits, tables_per_rank, dim, dtype, mode
    )
    schedule: ChunkSchedule = BY_TABLE if by_table else chunks
    training = anchor.requires_grad and any(t.requires_grad for t in tables)
    return emb.embedding_all_to_all(
        Communicator.resolve(comm_key), lookup, chunks=schedule, prepare_backward=training
    )


def embedding_schedule_args(chunks: ChunkSchedule) -> tuple[int, bool]:
    """``(chunks, by_table)`` of ``embedding_all_to_all_op`` for a schedule."""
    return (1, True) if chunks == BY_TABLE else (int(chunks), False)


def _unpack(inputs: tuple[Any, ...]) -> tuple[emb.ShardedLookup, str, ChunkSchedule, torch.Tensor]:
    """``embedding_all_to_all_op``'s arguments, in its registered order, as (lookup, comm_key,
    schedule, anchor): its first eight are the lookup's fields, in the lookup's order."""
    *fields, comm_key, chunks, by_table, anchor = inputs
    schedule: ChunkSchedule = BY_TABLE if by_table else chunks
    return emb.ShardedLookup(*fields), comm_key, schedule, anchor


@embedding_all_to_all_op.register_fake
def _embedding_fake(*inputs: Any) -> torch.Tensor:
    # torch calls the fake with the operator's arguments as registered; ``_unpack`` names them.
    lookup, comm_key, _, _ = _unpack(inputs)
    rank = Communicator.resolve(comm_key).rank
    shape = (lookup.batch_splits[rank], sum(lookup.tables_per_rank), lookup.dim)
    return torch.empty(shape, dtype=lookup.dtype, device=lookup.device)


def _embedding_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    lookup, comm_key, chunks, anchor = _unpack(inputs)
    # The tensors go through save_for_backward (version checks, saved-tensor hooks); the rest
    # of the lookup is kept without them and the tensors are put back in the backward.
    ctx.save_for_backward(*lookup.tables, *lookup.indices, *lookup.offsets)
    ctx.num_tables = len(lookup.tables)
    ctx.anchor_shape = anchor.shape
    ctx.lookup = dataclasses.replace(
        lookup,
        tables=[],
        indices=[],
        offsets=[],
        batch_splits=list(lookup.batch_splits),
        tables_per_rank=list(lookup.tables_per_rank),
    )
    ctx.meta = (comm_key, chunks)


def _embedding_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    n = ctx.num_tables
    lookup = dataclasses.replace(
        ctx.lookup,
        tables=list(saved[:n]),
        indices=list(saved[n : 2 * n]),
        offsets=list(saved[2 * n :]),
    )
    comm_key, chunks = ctx.meta
    grads = emb.embedding_all_to_all_backward(
        Communicator.resolve(comm_key), lookup, grad.contiguous(), chunks=chunks
    )
    none = [None] * n
    anchor_grad = grad.new_zeros(ctx.anchor_shape)
    return grads, none, list(none), None, None, None, None, None, None, None, None, anchor_grad


embedding_all_to_all_op.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# -- AllGather + GEMM and GEMM + ReduceScatter --------------------------------------------------
# Each ring's backward is the other ring, called as its operator (not as the Python function),
# so a traced backward holds operators and the communicator's name, never a process group.
@torch.library.custom_op("commfuse::all_gather_gemm", mutates_args=())
def all_gather_gemm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    comm_key: str,
    chunks: int,
    reference_algo: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AG(x) @ weight^T, AG(x))``; the second output (the gathered input) has no gradient.
    ``reference_algo``: the AllGather of the unfused reference (``chunks=1``)."""
    comm = Communicator.resolve(comm_key)
    y, gathered = agg.all_gather_gemm(
        comm, x, weight, splits=list(splits), chunks=chunks, reference_algo=reference_algo
    )
    return y, gathered


@all_gather_gemm_op.register_fake
def _all_gather_gemm_fake(
    x: torch.Tensor, weight: torch.Tensor, splits: list[int], *_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(splits)
    return x.new_empty((rows, weight.shape[0])), x.new_empty((rows, x.shape[1]))


def _ag_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _, weight, splits, comm_key, chunks, reference_algo = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.meta = (list(splits), comm_key, chunks, reference_algo)
    ctx.mark_non_differentiable(output[1])


def _ag_backward(ctx: Any, grad_y: torch.Tensor, _grad_gathered: Any) -> tuple[Any, ...]:
    """``grad_x = RS(grad_y @ W)`` (the GEMM + ReduceScatter ring), ``grad_W = grad_y^T AG(x)``."""
    gathered, weight = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    grad_x = gemm_reduce_scatter_op(grad_y, weight.t().contiguous(), *ctx.meta)
    return grad_x, torch.matmul(grad_y.t(), gathered), None, None, None, None


all_gather_gemm_op.register_autograd(_ag_backward, setup_context=_ag_setup)


@torch.library.custom_op("commfuse::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter_op(
    a: torch.Tensor,
    weight: torch.Tensor,
    splits: list[int],
    comm_key: str,
    chunks: int,
    reference_algo: str,
) -> torch.Tensor:
    """This rank's rows of ``sum_ranks(a @ weight^T)``. ``reference_algo``: the ReduceScatter of
    the unfused reference (``chunks=1``)."""
    comm = Communicator.resolve(comm_key)
    return grs.gemm_reduce_scatter(
        comm, a, weight, splits=list(splits), chunks=chunks, reference_algo=reference_algo
    )


@gemm_reduce_scatter_op.register_fake
def _gemm_reduce_scatter_fake(
    a: torch.Tensor, weight: torch.Tensor, splits: list[int], comm_key: str, *_: Any
) -> torch.Tensor:
    return a.new_empty((splits[Communicator.resolve(comm_key).rank], weight.shape[0]))


def _rs_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, weight, splits, comm_key, chunks, reference_algo = inputs
    ctx.save_for_backward(a, weight)
    ctx.meta = (list(splits), comm_key, chunks, reference_algo)


def _rs_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """``grad_a = AG(grad_z) @ W`` (the AllGather + GEMM ring), ``grad_W = AG(grad_z)^T a``."""
    a, weight = ctx.saved_tensors
    grad_a, gathered = all_gather_gemm_op(grad.contiguous(), weight.t().contiguous(), *ctx.meta)
    return grad_a, torch.matmul(gathered.t(), a), None, None, None, None


gemm_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)
