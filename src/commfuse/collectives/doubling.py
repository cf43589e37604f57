"""Recursive doubling and halving: all-reduce and all-gather in lg P steps (names ``"doubling"``,
``"rabenseifner"``, ``"halving"``).

Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), sections 4.3 and 4.5; Bruck et al., "Efficient Algorithms for All-to-All
Communications in Multiport Message-Passing Systems" (IEEE TPDS 1997) for the all-gather.

* **Recursive doubling all-reduce** (``doubling``): in step k rank r exchanges its whole buffer
  with ``r xor 2^k`` and reduces; after lg P steps everyone has the result. Cost
  ``lg P (alpha + n beta + n gamma)``: few messages, best for short buffers.
* **Recursive halving reduce-scatter** (``halving``): in the step with distance d (P/2, P/4, ...,
  1) rank r keeps the half of its current range that holds block r, sends the other half to
  ``r xor d`` and reduces what it receives into the kept half. Cost
  ``lg P alpha + ((P-1)/P) n (beta + gamma)``.
* **Rabenseifner all-reduce** (``rabenseifner``): recursive halving, then recursive doubling to
  gather the reduced blocks back (distance 1, 2, ..., P/2, the halves growing again). Cost
  ``2 lg P alpha + 2((P-1)/P) n beta + ((P-1)/P) n gamma``: the ring's bandwidth with lg P
  latency, best for medium and large buffers.
* **Allgather** (``doubling``): recursive doubling when P is a power of two; otherwise Bruck's
  algorithm (step k: send the 2^k blocks gathered so far to ``r - 2^k``, receive as many from
  ``r + 2^k``, rotate at the end). Both cost ``ceil(lg P) alpha + ((P-1)/P) n beta``; every rank
  sends exactly P - 1 blocks.

Blocks are ``even_blocks`` ranges, so any numel works, including numel < P (empty ranges cost no
message). Every exchange posts its receive before its send.

Design notes: ``docs/collectives.md``, "Recursive doubling and halving: non-powers of two".
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.collectives.blocks import even_blocks
from commfuse.collectives.reduce_ops import combine_
from commfuse.collectives.registry import label, register
from commfuse.comm import Communicator, ReduceOpName

Block = tuple[int, int]


def _fold_sizes(world: int) -> tuple[int, int]:
    """``(P', rem)``: the largest power of two <= P and how many ranks fold into it."""
    pof2 = 1 << (world.bit_length() - 1)
    return pof2, world - pof2


def _old_rank(new_rank: int, rem: int) -> int:
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def _exchange(
    comm: Communicator, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: str
) -> None:
    recv_handle = comm.irecv(recv, peer, label=tag)
    send_handle = comm.isend(send, peer, label=tag)
    send_handle.wait()
    recv_handle.wait()


def _fold_in(comm: Communicator, work: torch.Tensor, op: ReduceOpName, tag: str) -> int | None:
    """Fold the first 2 rem ranks pairwise; returns this rank's new rank, None if it idles."""
    rank = comm.rank
    _, rem = _fold_sizes(comm.world_size)
    if rank >= 2 * rem:
        return rank - rem
    if rank % 2 == 0:
        comm.send(work, rank + 1, label=tag)
        return None
    scratch = torch.empty_like(work)
    comm.recv(scratch, rank - 1, label=tag)
    combine_(work, scratch, op)
    return rank // 2


def _span(blocks: list[Block], first: int, count: int) -> Block:
    """The element range of ``count`` consecutive blocks from ``first``."""
    return blocks[first][0], blocks[first + count - 1][1]


def _halve(
    comm: Communicator,
    work: torch.Tensor,
    blocks: list[Block],
    new_rank: int,
    op: ReduceOpName,
    tag: str,
) -> None:
    """Recursive halving over ``len(blocks)`` (a power of two) new ranks: afterwards
    ``work[blocks[new_rank]]`` is reduced over all of them."""
    pof2, rem = len(blocks), comm.world_size - len(blocks)
    # The first step receives the most: the larger half, reused by every later (smaller) step.
    halves = (_span(blocks, 0, pof2 // 2), _span(blocks, pof2 // 2, pof2 // 2))
    scratch = work.new_empty(max(hi - lo for lo, hi in halves))
    dist = pof2 // 2
    while dist >= 1:
        # Within the aligned group of 2 dist blocks, keep the half that holds block new_rank.
        base = new_rank & ~(2 * dist - 1)
        mine = base if new_rank & dist == 0 else base + dist
        theirs = base + dist if mine == base else base
        keep_lo, keep_hi = _span(blocks, mine, dist)
        send_lo, send_hi = _span(blocks, theirs, dist)
        got = scratch[: keep_hi - keep_lo]
        peer = _old_rank(new_rank ^ dist, rem)
        _exchange(comm, work[send_lo:send_hi], got, peer, tag)
        combine_(work[keep_lo:keep_hi], got, op)
        dist //= 2


def _double(
    comm: Communicator, buf: torch.Tensor, blocks: list[Block], new_rank: int, tag: str
) -> None:
    """Recursive doubling gather over ``len(blocks)`` new ranks: each starts with
    ``buf[blocks[new_rank]]`` and ends with every block; received ranges land in place."""
    pof2, rem = len(blocks), comm.world_size - len(blocks)
    dist = 1
    while dist < pof2:
        partner = new_rank ^ dist
        mine_lo, mine_hi = _span(blocks, new_rank & ~(dist - 1), dist)
        their_lo, their_hi = _span(blocks, partner & ~(dist - 1), dist)
        peer = _old_rank(partner, rem)
        _exchange(comm, buf[mine_lo:mine_hi], buf[their_lo:their_hi], peer, tag)
        dist *= 2


def _fold_out(comm: Communicator, buf: torch.Tensor, tag: str) -> None:
    """Return the result to the ranks that idled during the algorithm."""
    rank = comm.rank
    _, rem = _fold_sizes(comm.world_size)
    if rank < 2 * rem:
        if rank % 2:
            comm.send(buf, rank - 1, label=tag)
        else:
            comm.recv(buf, rank + 1, label=tag)


@register("all_reduce", "doubling")
def _doubling_all_reduce(comm: Communicator, buf: torch.Tensor, op: ReduceOpName, **_: Any) -> None:
    """Recursive doubling all-reduce: lg P' full-buffer exchanges (plus the fold)."""
    tag = label("all_reduce", "doubling")
    pof2, rem = _fold_sizes(comm.world_size)
    new_rank = _fold_in(comm, buf, op, tag)
    if new_rank is not None:
        scratch = torch.empty_like(buf)
        dist = 1
        while dist < pof2:
            _exchange(comm, buf, scratch, _old_rank(new_rank ^ dist, rem), tag)
            # Both partners compute mine (op) theirs; IEEE sum, product, max and min are
            # commutative, so every rank ends with bitwise the same result.
            combine_(buf, scratch, op)
            dist *= 2
    _fold_out(comm, buf, tag)


@register("all_reduce", "rabenseifner")
def rabenseifner_all_reduce(
    comm: Communicator, buf: torch.Tensor, op: ReduceOpName, **_: Any
) -> None:
    """Rabenseifner: recursive-halving reduce-scatter, recursive-doubling all-gather."""
    tag = label("all_reduce", "rabenseifner")
    pof2 = _fold_sizes(comm.world_size)[0]
    new_rank = _fold_in(comm, buf, op, tag)
    if new_rank is not None:
        blocks = even_blocks(buf.numel(), pof2)
        _halve(comm, buf, blocks, new_rank, op, tag)
        _double(comm, buf, blocks, new_rank, tag)
    _fold_out(comm, buf, tag)


@register("reduce_scatter", "halving")
def _halving_reduce_scatter(
    comm: Communicator, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName, **_: Any
) -> None:
    """Recursive-halving reduce-scatter: rank r ends with block r of the reduction."""
    tag = label("reduce_scatter", "halving")
    rank, world = comm.rank, comm.world_size
    pof2, rem = _fold_sizes(world)
    size = out.numel()
    work = inp.clone()  # partial sums accumulate here: the input must stay unchanged
    new_rank = _fold_in(comm, work, op, tag)
    if new_rank is not None:
        # New rank i owns the blocks of its old ranks (2i and 2i + 1 when folded), contiguous.
        first = [2 * i if i < rem else i + rem for i in range(pof2)]
        last = [_old_rank(i, rem) for i in range(pof2)]
        blocks = [(first[i] * size, (last[i] + 1) * size) for i in range(pof2)]
        _halve(comm, work, blocks, new_rank, op, tag)
    if rank < 2 * rem and rank % 2:
        comm.send(work[(rank - 1) * size : rank * size], rank - 1, label=tag)
        out.copy_(work[rank * size : (rank + 1) * size])
    elif rank < 2 * rem:
        comm.recv(out, rank + 1, label=tag)
    else:
        out.copy_(work[rank * size : (rank + 1) * size])


@register("all_gather", "doubling")
def _doubling_all_gather(
    comm: Communicator, out: torch.Tensor, inp: torch.Tensor, **_: Any
) -> None:
    """Recursive doubling all-gather (P a power of two) or Bruck's algorithm (any other P)."""
    tag = label("all_gather", "doubling")
    rank, world = comm.rank, comm.world_size
    size = inp.numel()
    if world & (world - 1) == 0:
        out[rank * size : (rank + 1) * size].copy_(inp)
        _double(comm, out, even_blocks(out.numel(), world), rank, tag)
        return
    # Bruck: tmp holds blocks r, r + 1, ... (mod P) in that order, so what a rank has gathered
    # is always a prefix of tmp and each step sends one contiguous prefix.
    tmp = out.new_empty(out.numel())
    tmp[:size].copy_(inp)
    dist = 1
    while dist < world:
        count = min(dist, world - dist)
        recv = tmp[dist * size : (dist + count) * size]
        recv_handle = comm.irecv(recv, (rank + dist) % world, label=tag)
        send_handle = comm.isend(tmp[: count * size], (rank - dist) % world, label=tag)
        send_handle.wait()
        recv_handle.wait()
        dist *= 2
    # Rotate: tmp[i] is block (r + i) mod P.
    head = (world - rank) * size
    out[rank * size :].copy_(tmp[:head])
    out[: rank * size].copy_(tmp[head:])
