"""A sum-AllReduce of a stream of pieces, progressed from the caller's thread between its kernels.

Why not ``comm.all_reduce(piece, async_op=True)``? On a machine whose cores the ranks' compute
fills, a native gloo all-reduce started before a matmul barely overlaps it (the pair takes about
C + M), while posted point-to-point sends do. gloo's ring is a chain of dependent steps run by
one of its worker threads, and a starved thread stalls the whole ring; a posted point-to-point
message is moved by the kernel and gloo's event loop without further help. So each piece is reduced in two direct
phases, every message posted at once:

1. reduce-scatter: piece = P blocks; block ``j`` goes to rank ``j`` (``isend``), and this rank
   receives its own block from every other rank (``irecv``);
2. (later, after the caller has computed the next piece) sum the received blocks in rank order
   (accumulated in at least float32, so every rank gets the same, well-rounded sum; float64
   stays float64), then
   all-gather: send the reduced block to every rank and receive theirs in place.

All ranks together send ``2 (P - 1)`` times every piece, as a ring all-reduce does (each rank
``2 (P - 1) / P`` of it when P divides it: the bandwidth lower bound), in ``2 (P - 1)`` messages
per rank and piece instead of the ring's chain of dependent steps.
"""

from __future__ import annotations

from collections import deque

import torch

from commfuse.comm import Communicator, Handle
from commfuse.fused.chunking import split_sizes


class _Piece:
    __slots__ = ("blocks", "buf", "handles", "received", "tag")

    def __init__(self, buf: torch.Tensor, blocks: list[tuple[int, int]], tag: int) -> None:
        self.buf, self.blocks, self.tag = buf, blocks, tag
        self.handles: list[Handle] = []
        self.received: dict[int, torch.Tensor] = {}


class DirectAllReduce:
    """``start(piece)`` posts a piece's reduce-scatter; ``advance()`` completes the oldest started
    piece's reduce-scatter and posts its all-gather; ``finish()`` completes everything. Every rank
    must start the same pieces (same sizes) in the same order."""

    def __init__(self, comm: Communicator, label: str) -> None:
        self.comm, self.label = comm, label
        self._scattering: deque[_Piece] = deque()
        self._gathering: list[Handle] = []
        self._tags = 0

    def _blocks(self, numel: int) -> list[tuple[int, int]]:
        out, start = [], 0
        for size in split_sizes(numel, self.comm.world_size):
            out.append((start, start + size))
            start += size
        return out

    def start(self, piece: torch.Tensor) -> None:
        """Post the reduce-scatter of ``piece`` (contiguous; reduced in place by ``finish``)."""
        if not piece.is_contiguous():
            raise ValueError("DirectAllReduce needs contiguous pieces")
        comm, rank, world = self.comm, self.comm.rank, self.comm.world_size
        flat = piece.view(-1)
        item = _Piece(flat, self._blocks(flat.numel()), self._tags)
        self._tags += 2
        lo, hi = item.blocks[rank]
        for step in range(1, world):
            src = (rank - step) % world
            item.received[src] = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            item.handles.append(comm.irecv(item.received[src], src, tag=item.tag, label=self.label))
        for step in range(1, world):
            dst = (rank + step) % world
            b_lo, b_hi = item.blocks[dst]
            item.handles.append(comm.isend(flat[b_lo:b_hi], dst, tag=item.tag, label=self.label))
        self._scattering.append(item)

    @property
    def in_flight(self) -> int:
        """Pieces whose reduce-scatter is posted but not yet completed by ``advance``."""
        return len(self._scattering)

    def advance(self) -> None:
        """Reduce the oldest piece's block and post its all-gather."""
        item = self._scattering.popleft()
        comm, rank, world = self.comm, self.comm.rank, self.comm.world_size
        for handle in item.handles:  # our sends too: the all-gather overwrites those blocks
            handle.wait()
        lo, hi = item.blocks[rank]
        # At least float32 (16-bit sums are rounded once, at the end), float64 kept as such.
        acc_dtype = torch.promote_types(item.buf.dtype, torch.float32)
        acc = torch.zeros(hi - lo, dtype=acc_dtype, device=item.buf.device)
        for src in range(world):
            acc += (item.buf[lo:hi] if src == rank else item.received[src]).to(acc_dtype)
        item.buf[lo:hi].copy_(acc)
        for step in range(1, world):
            dst = (rank + step) % world
            self._gathering.append(
                comm.isend(item.buf[lo:hi], dst, tag=item.tag + 1, label=self.label)
            )
        for step in range(1, world):
            src = (rank - step) % world
            s_lo, s_hi = item.blocks[src]
            self._gathering.append(
                comm.irecv(item.buf[s_lo:s_hi], src, tag=item.tag + 1, label=self.label)
            )

    def finish(self) -> None:
        """Complete every started piece."""
        while self._scattering:
            self.advance()
        for handle in self._gathering:
            handle.wait()
        self._gathering.clear()


def sent_bytes(piece_numels: list[int], world: int, rank: int, element_size: int) -> int:
    """Bytes this rank sends for pieces of these sizes: the other ranks' blocks once (reduce-
    scatter) and its own block ``P - 1`` times (all-gather); ``2 (P - 1) numel`` over all ranks."""
    if world == 1:
        return 0
    total = 0
    for n in piece_numels:
        own = split_sizes(n, world)[rank]
        total += (n - own + (world - 1) * own) * element_size
    return total
