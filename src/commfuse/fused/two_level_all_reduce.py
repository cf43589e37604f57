"""A sum-AllReduce of a stream of pieces in two levels (inside each host, then across hosts),
progressed from the caller's thread between its kernels.

On H hosts of L ranks each (P = HL, ranks host-major) the 2D all-reduce of Mikami et al.
(arXiv 1811.05233; ``collectives/hierarchical.py`` runs it as a collective) crosses each host
link with ``2 ((H - 1) / H) n`` bytes per direction, where a flat all-reduce crosses it with
``2 ((P - 1) / P) n`` (a ring) or ``2 L ((H - 1) / H) n`` (every rank posting to every rank,
``direct_all_reduce.py``): on 2 hosts x 2 ranks ``n`` against ``1.5 n`` and ``2 n``. Here every
phase is direct (all of a phase's messages posted at once, moved by the kernel and gloo's event
loop while the caller computes), and a piece advances one phase per call of ``advance``, so the
caller interleaves the phases of several pieces with its own GEMMs:

1. ``start``: reduce-scatter inside the host: the piece is L shards, shard ``l`` goes to local
   rank ``l``;
2. sum the shard over the host (local-rank order), then reduce-scatter it across hosts: the
   shard is H blocks, block ``h`` goes to the rank of this local rank on host ``h``;
3. sum the block over the hosts (host order), then all-gather it across hosts;
4. all-gather the shard inside the host;
5. ``finish`` (or a later ``advance``) waits for the last messages.

Every element is summed by exactly one rank and copied to every other, so all ranks hold the
same result. Each level's sum accumulates in at least float32 and is rounded to the piece's
dtype once per level (a bfloat16 piece is rounded twice, once after the host sum and once
after the cross-host sum). With L = 1 (or H = 1) the empty level posts nothing and this is the
flat direct all-reduce.

Bytes per rank and piece of ``n`` elements: ``2 ((L - 1) / L) n`` inside the host and
``2 ((H - 1) / H) n / L`` across hosts (``sent_bytes``, exact for uneven splits).
"""

from __future__ import annotations

from collections import deque

import torch

from commfuse.comm import Communicator, Handle
from commfuse.fused.chunking import split_sizes

Block = tuple[int, int]


def blocks_of(start: int, stop: int, parts: int) -> list[Block]:
    """``[start, stop)`` cut into ``parts`` ranges as ``split_sizes`` cuts it."""
    out, lo = [], start
    for size in split_sizes(stop - start, parts):
        out.append((lo, lo + size))
        lo += size
    return out


class _Piece:
    __slots__ = ("block", "buf", "handles", "phase", "received", "shard", "tag")

    def __init__(self, buf: torch.Tensor, shard: Block, block: Block, tag: int) -> None:
        self.buf, self.shard, self.block, self.tag = buf, shard, block, tag
        self.handles: list[Handle] = []
        self.received: list[torch.Tensor] = []
        self.phase = 0


class TwoLevelAllReduce:
    """``start(piece)`` posts a piece's host reduce-scatter; ``advance()`` moves every piece that
    has phases left one phase on (module docstring); ``finish()`` completes everything.
    ``intra`` is this rank's host group, ``inter`` the group of its local rank on every host
    (``Communicator.split_by_host``); None for a level of one rank (one rank per host: no
    ``intra``; one host: no ``inter``), so a flat layout needs no sub-groups. Every rank must
    start the same pieces in the same order."""

    #: Phases a piece goes through after ``start`` before it only waits for its last messages.
    PHASES = 3

    def __init__(self, intra: Communicator | None, inter: Communicator | None, label: str) -> None:
        self.intra, self.inter, self.label = intra, inter, label
        self._sizes = [(0, 1) if c is None else (c.rank, c.world_size) for c in (intra, inter)]
        self._pieces: deque[_Piece] = deque()
        self._tags = 0

    @property
    def in_flight(self) -> int:
        """Pieces with phases left to post."""
        return sum(1 for p in self._pieces if p.phase < self.PHASES)

    def start(self, piece: torch.Tensor) -> None:
        """Post the host reduce-scatter of ``piece`` (contiguous; reduced in place)."""
        if not piece.is_contiguous():
            raise ValueError("TwoLevelAllReduce needs contiguous pieces")
        flat = piece.view(-1)
        shards = blocks_of(0, flat.numel(), self._sizes[0][1])
        shard = shards[self._sizes[0][0]]
        block = blocks_of(*shard, self._sizes[1][1])[self._sizes[1][0]]
        item = _Piece(flat, shard, block, self._tags)
        self._tags += 4  # one tag per phase: a pair may carry two phases of a piece at once
        self._scatter(self.intra, item, shards)
        self._pieces.append(item)
        if not item.handles:  # one host rank: the host level has nothing to send
            self._step(item)

    def _scatter(self, comm: Communicator | None, item: _Piece, blocks: list[Block]) -> None:
        """Post: block ``j`` of ``item.buf`` to rank ``j`` of ``comm``, mine from every peer."""
        if comm is None:
            return
        rank, world, tag = comm.rank, comm.world_size, item.tag + item.phase
        lo, hi = blocks[rank]
        item.received = []
        for step in range(1, world):
            src = (rank - step) % world
            buf = item.buf.new_empty(hi - lo)
            item.received.append(buf)
            item.handles.append(comm.irecv(buf, src, tag=tag, label=self.label))
        for step in range(1, world):
            dst = (rank + step) % world
            b_lo, b_hi = blocks[dst]
            item.handles.append(comm.isend(item.buf[b_lo:b_hi], dst, tag=tag, label=self.label))

    def _gather(self, comm: Communicator | None, item: _Piece, blocks: list[Block]) -> None:
        """Post: my block of ``item.buf`` to every peer of ``comm``, theirs into place."""
        if comm is None:
            return
        rank, world, tag = comm.rank, comm.world_size, item.tag + item.phase
        lo, hi = blocks[rank]
        for step in range(1, world):
            dst = (rank + step) % world
            item.handles.append(comm.isend(item.buf[lo:hi], dst, tag=tag, label=self.label))
        for step in range(1, world):
            src = (rank - step) % world
            s_lo, s_hi = blocks[src]
            item.handles.append(comm.irecv(item.buf[s_lo:s_hi], src, tag=tag, label=self.label))

    @staticmethod
    def _sum(item: _Piece, comm: Communicator | None, lo: int, hi: int) -> None:
        """``item.buf[lo:hi]`` += the received blocks, summed in ``comm``'s rank order."""
        for handle in item.handles:  # our sends too: the next phase overwrites what they send
            handle.wait()
        item.handles = []
        if comm is None or comm.world_size == 1:
            return
        acc_dtype = torch.promote_types(item.buf.dtype, torch.float32)
        by_src = {(comm.rank - s) % comm.world_size: b for s, b in enumerate(item.received, 1)}
        acc = torch.zeros(hi - lo, dtype=acc_dtype, device=item.buf.device)
        for src in range(comm.world_size):
            acc += (item.buf[lo:hi] if src == comm.rank else by_src[src]).to(acc_dtype)
        item.buf[lo:hi].copy_(acc)
        item.received = []

    def advance(self) -> None:
        """Move every piece with phases left on by one phase (the oldest first)."""
        for item in [p for p in self._pieces if p.phase < self.PHASES]:
            self._step(item)

    def _step(self, item: _Piece) -> None:
        """One phase of ``item``; a phase whose level has no peers (L or H = 1) posts nothing,
        so the next one follows at once."""
        shards = blocks_of(0, item.buf.numel(), self._sizes[0][1])
        blocks = blocks_of(*item.shard, self._sizes[1][1])
        phase = item.phase
        item.phase += 1  # before posting: the messages' tag is the phase they belong to
        if phase == 0:
            self._sum(item, self.intra, *item.shard)
            self._scatter(self.inter, item, blocks)
        elif phase == 1:
            self._sum(item, self.inter, *item.block)
            self._gather(self.inter, item, blocks)
        else:
            for handle in item.handles:
                handle.wait()
            item.handles = []
            self._gather(self.intra, item, shards)
        if not item.handles and item.phase < self.PHASES:
            self._step(item)

    def finish(self) -> None:
        """Complete every started piece."""
        while self.in_flight:
            self.advance()
        for item in self._pieces:
            for handle in item.handles:
                handle.wait()
        self._pieces.clear()


def sent_bytes(
    piece_numels: list[int], hosts: int, ranks_per_host: int, rank: int, element_size: int
) -> tuple[int, int]:
    """(bytes inside the host, bytes across hosts) this rank sends for pieces of these sizes:
    at each level the peers' blocks once (reduce-scatter) and its own ``peers`` times
    (all-gather)."""
    host_rank, local = divmod(rank, ranks_per_host)
    intra = inter = 0
    for n in piece_numels:
        shard = split_sizes(n, ranks_per_host)
        mine = shard[local]
        intra += n - mine + (ranks_per_host - 1) * mine
        block = split_sizes(mine, hosts)[host_rank]
        inter += mine - block + (hosts - 1) * block
    return intra * element_size, inter * element_size
