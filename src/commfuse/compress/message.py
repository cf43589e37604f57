"""The allgather-based compressors' common path: encode, gather every rank's message, decode.

Messages whose sum is not a message of the same kind (top-k's values with their indices,
packed sign bits with a scale) cannot ride an allreduce: every rank gathers every other
rank's message and decodes their average itself. Per bucket and step:

1. ``x = g + e`` with error feedback, else ``g``;
2. ``parts = compress(x)``: the message's fields (see ``layout``);
3. with error feedback, ``e = x - decompress(parts)``, this rank's own loss;
4. the fields are packed into one int32 buffer (``wire.Layout``) and allgathered: ONE
   collective per bucket, ``layout.wire_bytes`` contributed per rank;
5. ``g = (1/P) sum_r decompress(parts_r)``.

An allgather moves ``(P - 1)`` messages into every rank, so these compressors pay off when the
message is at least ``P / 2`` times smaller than the gradient (an allreduce moves about two
gradients per rank); the tuner's allgather algorithm still applies (``gather_algo``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor
from commfuse.compress.wire import Layout


@dataclasses.dataclass(kw_only=True)
class MessageCompressor(Compressor):
    """An allgather-based compressor: subclasses give ``layout``, ``compress`` and
    ``decompress_sum`` (pure functions of the settings and their arguments)."""

    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_gather"

    @abc.abstractmethod
    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        """The fields of the message for a bucket of ``numel`` elements at ``step``."""

    @abc.abstractmethod
    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        """This rank's message for the flat ``x``: one tensor per layout field."""

    @abc.abstractmethod
    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        """The sum over ranks of the decoded messages; each part has a leading rank dim."""

    def decompress(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None = 0
    ) -> torch.Tensor:
        """One message decoded (the inverse of ``compress`` up to the compression error)."""
        return self.decompress_sum([p.reshape(1, -1) for p in parts], numel, dtype, step)

    def _exchange(
        self, comm: Communicator, layout: Layout, parts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Every rank's message fields (rank x numel each), with one allgather."""
        words = layout.pack(parts)
        gathered = words.new_empty(comm.world_size * words.numel())
        C.all_gather(comm, gathered, words, algo=self.gather_algo)
        return layout.unpack(gathered)

    def _corrected(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """This exchange's input: ``grad`` plus the residual of ``key`` (a new tensor)."""
        return self.feedback.corrected(key, grad)

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        key = self._state_key(bucket)
        numel = grad.numel()
        x = self._corrected(key, grad) if self.ef else grad
        parts = self.compress(x, step=step, bucket=bucket, rank=comm.rank)
        if self.ef and commit:
            self.feedback.update(key, x - self.decompress(parts, numel, grad.dtype, step))
        gathered = self._exchange(comm, self.layout(numel, grad.dtype, step), parts)
        total = self.decompress_sum(gathered, numel, grad.dtype, step)
        grad.copy_(total.div_(comm.world_size))

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        return self.layout(numel, dtype, step).wire_bytes
