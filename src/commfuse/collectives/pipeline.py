"""Linear pipeline (LP) broadcast, reduce and all-reduce along a chain of ranks.

Wang et al., "Efficient Communications in Training Large Scale Neural Networks" (arXiv
1611.04255): when the message is large, a chain whose links all carry data at the same time
beats a tree, whose bandwidth term grows with lg P. The ranks form the chain root, root + 1, ...,
root + P - 1 (mod P) and the n-byte message is cut into k = ceil(n / b) blocks of b bytes.

1. **Broadcast.** The root sends blocks 0, 1, ..., k - 1 to its successor. Every other rank
   receives block i from its predecessor and forwards it to its successor while block i + 1 is
   already arriving (its receive is posted before block i is forwarded). After P - 1 steps to
   fill the chain, one block leaves the last link per step:
   ``(P - 1 + n/b)(alpha + b beta)``. The bandwidth term n beta does not grow with P.
2. **Reduce.** The same chain run backwards: the last rank sends its own blocks toward the
   root; each rank on the way receives the partial result of a block into a scratch buffer, adds
   its contribution and passes it on, so every non-root buffer is left unchanged. Cost
   ``(P - 1 + n/b)(alpha + b (beta + gamma))``.
3. **Allreduce.** A reduce toward rank 0 and a broadcast back from it, overlapped: rank 0
   starts broadcasting block i as soon as it has reduced it, so partial blocks flow down the
   chain while finished blocks flow up it, each link busy in both directions at once. Rank p
   handles its receives in the order they fall due in the ideal schedule (partial block i at
   step i - p, finished block i at step i + p, so finished blocks run 2p steps behind); every
   step only waits on steps before it, hence no deadlock. Cost about one reduce plus P - 1 more
   block steps: ``(2(P - 1) + n/b)(alpha + b beta) + n gamma``.

Every rank sends and receives at most n bytes per direction of each of its links (tested).

Tuning: ``block_bytes`` sets b. The default minimises the cost above, b* = sqrt(n alpha /
(D beta)) with D the chain's depth (P - 1, or 2(P - 1) for the all-reduce), from the link rate
in ``COMMFUSE_LINK_MBIT`` when the launcher exports it. Small blocks pay alpha k times; large
blocks leave the chain's far end idle while it fills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from commfuse.collectives.blocks import fixed_blocks
from commfuse.collectives.cost import PIPELINE_BLOCK_ALPHA_S, LinkCost, lp_best_block_bytes
from commfuse.collectives.reduce_ops import combine_
from commfuse.collectives.registry import label, register
from commfuse.comm import Communicator, Handle, ReduceOpName, wait_all

#: Receives kept posted ahead of the block being handled. gloo moves a message only once both
#: ends have posted it, so the next receive must already be posted when the current block is
#: forwarded, or every block would pay an extra handshake.
_LOOKAHEAD = 2

# Partial results flow toward the chain's head, finished blocks away from it. Distinct tags keep
# the two streams apart even on a two-rank chain, where both use the same pair of ranks.
_TAG_TOWARD_HEAD = 11
_TAG_AWAY_FROM_HEAD = 12


def pipeline_link(link_mbit: float | None) -> LinkCost:
    """The link the default block size is tuned for: ``CommConfig.link_mbit`` when known (the
    same on every rank, so every rank cuts the same blocks), else defaults; with the per-block
    cost of ``PIPELINE_BLOCK_ALPHA_S``."""
    link = LinkCost.from_link_gbit(link_mbit / 1000.0) if link_mbit else LinkCost()
    return dataclasses.replace(link, alpha_s=PIPELINE_BLOCK_ALPHA_S)


def block_ranges(
    buf: torch.Tensor, block_bytes: int | None, depth: int, link_mbit: float | None
) -> list[tuple[int, int]]:
    """``buf``'s element ranges of ``block_bytes`` each (rounded down to whole elements, at
    least one); ``depth`` is the number of hops the chain needs to fill and ``link_mbit`` the
    link rate (``CommConfig.link_mbit``), for the default size."""
    nbytes = buf.numel() * buf.element_size()
    if block_bytes is None:
        block_bytes = lp_best_block_bytes(nbytes, depth + 1, pipeline_link(link_mbit))
    elif isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
    return fixed_blocks(buf.numel(), max(1, block_bytes // buf.element_size()))


def _cut(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [tensor[start:stop] for start, stop in ranges]


class _Inbox:
    """Blocks arriving in order from one peer, with ``_LOOKAHEAD`` receives posted ahead of the
    one being waited on. ``before_post(i)`` runs before the receive into ``views[i]`` is posted
    (to wait for a send still reading that memory)."""

    def __init__(
        self,
        comm: Communicator,
        peer: int,
        views: list[torch.Tensor],
        *,
        tag: int,
        label: str,
        before_post: Callable[[int], None] | None = None,
    ) -> None:
        self._comm, self._peer, self._views = comm, peer, views
        self._tag, self._label, self._before_post = tag, label, before_post
        self._pending: dict[int, Handle] = {}
        self._posted = 0

    def take(self, i: int) -> torch.Tensor:
        """Wait for block ``i`` (taken in order) after posting the receives that follow it."""
        while self._posted < min(i + _LOOKAHEAD, len(self._views)):
            j = self._posted
            if self._before_post is not None:
                self._before_post(j)
            self._pending[j] = self._comm.irecv(
                self._views[j], self._peer, tag=self._tag, label=self._label
            )
            self._posted += 1
        self._pending.pop(i).wait()
        return self._views[i]


@register("broadcast", "pipeline")
def pipeline_broadcast(
    comm: Communicator, buf: torch.Tensor, root: int, *, block_bytes: int | None = None, **_: Any
) -> None:
    """LP broadcast from ``root`` along the chain root, root + 1, ... (see the module docstring)."""
    kind = label("broadcast", "pipeline")
    size = comm.world_size
    pos = (comm.rank - root) % size
    pred, succ = (comm.rank - 1) % size, (comm.rank + 1) % size
    views = _cut(buf, block_ranges(buf, block_bytes, size - 1, comm.config.link_mbit))
    sends: list[Handle] = []
    if pos == 0:
        # gloo sends a block only once the successor has posted its receive, so posting all of
        # them now just queues them in order.
        sends = [comm.isend(v, succ, tag=_TAG_AWAY_FROM_HEAD, label=kind) for v in views]
    else:
        inbox = _Inbox(comm, pred, views, tag=_TAG_AWAY_FROM_HEAD, label=kind)
        for i in range(len(views)):
            block = inbox.take(i)
            if pos < size - 1:
                sends.append(comm.isend(block, succ, tag=_TAG_AWAY_FROM_HEAD, label=kind))
    wait_all(sends)


@register("reduce", "pipeline")
def _pipeline_reduce(
    comm: Communicator,
    buf: torch.Tensor,
    root: int,
    op: ReduceOpName,
    *,
    block_bytes: int | None = None,
    **_: Any,
) -> None:
    """LP reduce into ``root``: partial blocks flow from the chain's end (root - 1) to the root."""
    kind = label("reduce", "pipeline")
    size = comm.world_size
    pos = (comm.rank - root) % size
    toward_root, away = (comm.rank - 1) % size, (comm.rank + 1) % size
    ranges = block_ranges(buf, block_bytes, size - 1, comm.config.link_mbit)
    views = _cut(buf, ranges)
    sends: list[Handle] = []
    if pos == size - 1:
        # The chain's end sends its own blocks, unchanged: no copy needed.
        sends = [comm.isend(v, toward_root, tag=_TAG_TOWARD_HEAD, label=kind) for v in views]
    else:
        # Partials land in scratch, so a non-root buffer is only read, never written.
        scratch = torch.empty_like(buf)
        partials = _Inbox(comm, away, _cut(scratch, ranges), tag=_TAG_TOWARD_HEAD, label=kind)
        for i, mine in enumerate(views):
            partial = partials.take(i)
            if pos == 0:
                combine_(mine, partial, op)
            else:
                combine_(partial, mine, op)
                sends.append(comm.isend(partial, toward_root, tag=_TAG_TOWARD_HEAD, label=kind))
    wait_all(sends)


@register("all_reduce", "pipeline")
def _pipeline_all_reduce(
    comm: Communicator,
    buf: torch.Tensor,
    op: ReduceOpName,
    *,
    block_bytes: int | None = None,
    **_: Any,
) -> None:
    """LP all-reduce: a pipelined reduce toward rank 0 overlapped with the pipelined broadcast of
    the blocks it has finished (see the module docstring)."""
    kind = label("all_reduce", "pipeline")
    size, pos = comm.world_size, comm.rank
    ranges = block_ranges(buf, block_bytes, 2 * (size - 1), comm.config.link_mbit)
    views = _cut(buf, ranges)
    k = len(views)
    sends: list[Handle] = []
    if pos == size - 1:
        # The chain's end starts the reduce with its own blocks, then receives the finished
        # ones into the same memory: each receive waits until the send reading it is done.
        partial_sends = [comm.isend(v, pos - 1, tag=_TAG_TOWARD_HEAD, label=kind) for v in views]
        results = _Inbox(
            comm,
            pos - 1,
            views,
            tag=_TAG_AWAY_FROM_HEAD,
            label=kind,
            before_post=lambda i: partial_sends[i].wait(),
        )
        for i in range(k):
            results.take(i)
        wait_all(partial_sends)
        return
    scratch = torch.empty_like(buf)
    partials = _Inbox(comm, pos + 1, _cut(scratch, ranges), tag=_TAG_TOWARD_HEAD, label=kind)
    finished = _Inbox(comm, pos - 1, views, tag=_TAG_AWAY_FROM_HEAD, label=kind) if pos else None
    for _step, is_finished, i in _schedule(k, pos):
        if is_finished:
            assert finished is not None
            sends.append(comm.isend(finished.take(i), pos + 1, tag=_TAG_AWAY_FROM_HEAD, label=kind))
        elif pos == 0:
            # The head completes block i and immediately starts it on its way back up.
            combine_(views[i], partials.take(i), op)
            sends.append(comm.isend(views[i], 1, tag=_TAG_AWAY_FROM_HEAD, label=kind))
        else:
            partial = partials.take(i)
            combine_(partial, views[i], op)
            sends.append(comm.isend(partial, pos - 1, tag=_TAG_TOWARD_HEAD, label=kind))
    wait_all(sends)


def _schedule(k: int, pos: int) -> list[tuple[int, bool, int]]:
    """(ideal step, is a finished block, block) of rank ``pos``'s receives, in step order:
    partial block i falls due at step i - pos, finished block i at step i + pos (head: none)."""
    events = [(i - pos, False, i) for i in range(k)]
    if pos > 0:
        events += [(i + pos, True, i) for i in range(k)]
    return sorted(events)
