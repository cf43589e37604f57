"""Pipelined ring all-reduce, reduce-scatter and all-gather (name ``"ring"``).

The ring is the bandwidth-optimal algorithm for large messages (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk and Yuan,
"Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations", JPDC 2009). The n-element
buffer is cut into P near-equal blocks (``even_blocks(n, P)``); every rank talks only to its
neighbours, sending to ``rank + 1`` and receiving from ``rank - 1``.

1. **Reduce-scatter**, P - 1 steps: in step s rank r sends its partial sum of block
   ``(r - s) mod P`` and receives block ``(r - s - 1) mod P``, which it reduces into its own.
   Afterwards rank r holds block ``(r + 1) mod P`` reduced over all ranks.
2. **Allgather**, P - 1 steps: the fully reduced blocks travel once more around the ring,
   each received block forwarded in the next step.

Cost (alpha: latency, beta: seconds per byte, gamma: reduction per byte):
all-reduce ``2(P-1) alpha + 2((P-1)/P) n beta + ((P-1)/P) n gamma``; reduce-scatter and
all-gather are one phase each, ``(P-1) alpha + ((P-1)/P) n beta`` (+ ``gamma`` for the former).
Every rank sends exactly the blocks it forwards: 2(P-1) blocks for all-reduce, P-1 otherwise.

Tuning: by default segments are at most ``_SEGMENT_BYTES`` (128 KiB). Smaller segments pay
Python's cost per message; larger ones, and unsegmented blocks, ran markedly slower over gloo's
TCP transport: re-measure before changing it.
``num_segments=1`` is the textbook ring, fewest messages, best for small buffers; the default
gives them one segment anyway.

Design notes: ``docs/collectives.md``, "The ring: why it is pipelined".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from commfuse.collectives.blocks import even_blocks
from commfuse.collectives.reduce_ops import combine_
from commfuse.collectives.registry import label, register
from commfuse.comm import Communicator, ReduceOpName

#: Largest segment message when ``num_segments`` is not given (see Tuning above).
_SEGMENT_BYTES = 128 * 1024
#: Upper bound of the default segment count: every segment of a step is posted at once, so this
#: bounds the receives in flight (a 128 MiB block still gets 128 KiB segments).
_MAX_SEGMENTS = 1024

Block = tuple[int, int]
_ViewFn = Callable[[int, int], torch.Tensor]


def default_num_segments(block_bytes: int) -> int:
    """Segments per ring block: at most ``_SEGMENT_BYTES`` each, between 1 and ``_MAX_SEGMENTS``."""
    return max(1, min(_MAX_SEGMENTS, math.ceil(block_bytes / _SEGMENT_BYTES)))


def _segments_for(num_segments: int | None, blocks: list[Block], element_size: int) -> int:
    # Every rank derives the count from the largest block (block 0), so all ranks agree.
    if num_segments is None:
        return default_num_segments((blocks[0][1] - blocks[0][0]) * element_size)
    if num_segments < 1:
        raise ValueError(f"ring num_segments must be >= 1, got {num_segments}")
    return num_segments


def _segment_ranges(block: Block, num_segments: int) -> list[Block]:
    """The element ranges of a block's segments (near-equal; empty ones when the block is short)."""
    start, stop = block
    return [(start + a, start + b) for a, b in even_blocks(stop - start, num_segments)]


def _ring_phase(
    comm: Communicator,
    num_segments: int,
    send_view: _ViewFn,
    recv_view: _ViewFn,
    after_recv: Callable[[int, int], None],
    tag: str,
) -> None:
    """P - 1 ring steps, pipelined per segment.

    ``send_view(s, j)`` / ``recv_view(s, j)`` give the tensors of segment j in step s;
    ``after_recv(s, j)`` runs once segment j of step s has arrived (a reduction or nothing) and
    must leave ``send_view(s + 1, j)`` ready to send.
    """
    rank, world = comm.rank, comm.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    steps = world - 1
    # Step 0: every receive is posted before any send, so no rank blocks on an unposted receive.
    recvs = [comm.irecv(recv_view(0, j), left, label=tag) for j in range(num_segments)]
    sends = [comm.isend(send_view(0, j), right, label=tag) for j in range(num_segments)]
    for step in range(steps):
        following = []
        for j in range(num_segments):
            recvs[j].wait()
            after_recv(step, j)
            if step + 1 < steps:
                # Flow control: one send in flight per segment; the earlier one has long left.
                sends[j].wait()
                following.append(comm.irecv(recv_view(step + 1, j), left, label=tag))
                sends[j] = comm.isend(send_view(step + 1, j), right, label=tag)
        recvs = following
    for handle in sends:
        handle.wait()


def _reduce_phase(
    comm: Communicator,
    acc: torch.Tensor,
    blocks: list[Block],
    op: ReduceOpName,
    num_segments: int,
    shift: int,
    tag: str,
) -> None:
    """Ring reduce-scatter in place on ``acc``: afterwards rank r holds block
    ``(r + 1 + shift) mod P`` reduced over all ranks (other blocks hold partial sums)."""
    rank, world = comm.rank, comm.world_size
    segs = [_segment_ranges(block, num_segments) for block in blocks]
    largest = max(b - a for a, b in segs[0]) if segs[0] else 0
    # One scratch row per segment: segment j of step s + 1 is received only after segment j of
    # step s has been reduced out of it (see _ring_phase).
    scratch = acc.new_empty((num_segments, largest))

    def seg(step: int, j: int, sending: bool) -> Block:
        return segs[(rank + shift - step - (0 if sending else 1)) % world][j]

    def send_view(step: int, j: int) -> torch.Tensor:
        a, b = seg(step, j, True)
        return acc[a:b]

    def recv_view(step: int, j: int) -> torch.Tensor:
        a, b = seg(step, j, False)
        return scratch[j, : b - a]

    def reduce(step: int, j: int) -> None:
        a, b = seg(step, j, False)
        combine_(acc[a:b], scratch[j, : b - a], op)

    _ring_phase(comm, num_segments, send_view, recv_view, reduce, tag)


def _gather_phase(
    comm: Communicator,
    buf: torch.Tensor,
    blocks: list[Block],
    num_segments: int,
    owner: int,
    tag: str,
) -> None:
    """Ring all-gather in place on ``buf``: rank r starts with block ``(r + owner) mod P`` and
    ends with all blocks; received segments land directly in ``buf`` (no copies)."""
    rank, world = comm.rank, comm.world_size
    segs = [_segment_ranges(block, num_segments) for block in blocks]

    def view(step: int, j: int, sending: bool) -> torch.Tensor:
        a, b = segs[(rank + owner - step - (0 if sending else 1)) % world][j]
        return buf[a:b]

    _ring_phase(
        comm,
        num_segments,
        lambda s, j: view(s, j, True),
        lambda s, j: view(s, j, False),
        lambda s, j: None,
        tag,
    )


@register("all_reduce", "ring")
def ring_all_reduce(
    comm: Communicator,
    buf: torch.Tensor,
    op: ReduceOpName,
    *,
    num_segments: int | None = None,
    **_: Any,
) -> None:
    """Pipelined ring all-reduce: reduce-scatter, then all-gather of the reduced blocks."""
    blocks = even_blocks(buf.numel(), comm.world_size)
    segments = _segments_for(num_segments, blocks, buf.element_size())
    tag = label("all_reduce", "ring")
    _reduce_phase(comm, buf, blocks, op, segments, 0, tag)
    _gather_phase(comm, buf, blocks, segments, 1, tag)


@register("reduce_scatter", "ring")
def ring_reduce_scatter(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    op: ReduceOpName,
    *,
    num_segments: int | None = None,
    **_: Any,
) -> None:
    """Pipelined ring reduce-scatter: rank r ends with block r of the reduction."""
    blocks = even_blocks(inp.numel(), comm.world_size)
    segments = _segments_for(num_segments, blocks, inp.element_size())
    # The input must stay unchanged, so partial sums accumulate in a copy; shift -1 makes the
    # block each rank finishes with its own (r) rather than r + 1.
    work = inp.clone()
    _reduce_phase(comm, work, blocks, op, segments, -1, label("reduce_scatter", "ring"))
    start, stop = blocks[comm.rank]
    out.copy_(work[start:stop])


@register("all_gather", "ring")
def ring_all_gather(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    num_segments: int | None = None,
    **_: Any,
) -> None:
    """Pipelined ring all-gather: each rank's block travels P - 1 hops around the ring."""
    blocks = even_blocks(out.numel(), comm.world_size)
    segments = _segments_for(num_segments, blocks, out.element_size())
    start, stop = blocks[comm.rank]
    out[start:stop].copy_(inp)
    _gather_phase(comm, out, blocks, segments, 0, label("all_gather", "ring"))
