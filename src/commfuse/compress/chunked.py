"""Shared parts of the outer-gradient compressors: fixed-size chunks and decayed error feedback.

The compressors made for the rare, large exchanges of the local-SGD family (SparseLoCo, DeMo,
int4) cut the flat bucket into rows of ``chunk`` elements (the last one zero-padded), so that a
per-chunk choice (the top k of each row, one scale per row) costs one batched operation and the
message's layout depends only on the bucket's size.

Their error feedback may decay: ``x = g + decay e`` then ``e = x - D(C(x))``. With
``decay = 1`` it is the plain error feedback of ``feedback.py`` (what was sent plus the residual
is exactly the sum of every input); below 1 the residual is also a momentum (SparseLoCo's and
DeMo's choice: old mass that was never sent fades instead of arriving late).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from commfuse.compress.message import MessageCompressor


def chunk_shape(numel: int, chunk_numel: int) -> tuple[int, int]:
    """``(rows, chunk)``: a bucket of ``numel`` elements as rows of ``chunk`` elements, where
    ``chunk = min(chunk_numel, numel)`` (a small bucket is one row, not a padded one)."""
    chunk = max(1, min(chunk_numel, numel))
    return -(-numel // chunk), chunk


def as_rows(x: torch.Tensor, rows: int, chunk: int) -> torch.Tensor:
    """``x`` (flat) zero-padded to ``rows * chunk`` elements, as a ``rows x chunk`` float32
    matrix on ``x``'s device."""
    padded = x.new_zeros(rows * chunk, dtype=torch.float32)
    padded[: x.numel()] = x.reshape(-1)
    return padded.view(rows, chunk)


@dataclasses.dataclass(kw_only=True)
class DecayedFeedbackCompressor(MessageCompressor):
    """A message compressor whose error feedback decays by ``decay`` per exchange."""

    decay: float = 1.0
    """Multiplies the residual before this exchange's input is added (1 = plain error
    feedback)."""

    def _check_decay(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"{self.name}: decay must be in (0, 1], got {self.decay}")

    def _corrected(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + decay e_key`` (a new tensor)."""
        return self.feedback.corrected(key, grad, decay=self.decay)


@dataclasses.dataclass(kw_only=True)
class ChunkTopKCompressor(DecayedFeedbackCompressor):
    """A decayed-feedback compressor that keeps ``num_kept_per_chunk`` entries of each chunk
    of ``chunk_numel`` elements (SparseLoCo's values, DeMo's DCT coefficients)."""

    max_chunk_numel: ClassVar[int]
    """The largest chunk whose indices the wire format can carry."""
    chunk_numel: int
    """Elements per chunk."""
    num_kept_per_chunk: int
    """Entries sent per chunk (k)."""

    def _check_chunks(self) -> None:
        if not 1 <= self.chunk_numel <= self.max_chunk_numel:
            raise ValueError(
                f"{self.name}: chunk_numel must be in 1..{self.max_chunk_numel}, "
                f"got {self.chunk_numel}"
            )
        if self.num_kept_per_chunk < 1:
            raise ValueError(
                f"{self.name}: num_kept_per_chunk must be >= 1, got {self.num_kept_per_chunk}"
            )
        self._check_decay()

    def shape(self, numel: int) -> tuple[int, int, int]:
        """``(rows, chunk, k)`` for a bucket of ``numel`` elements."""
        rows, chunk = chunk_shape(numel, self.chunk_numel)
        return rows, chunk, min(self.num_kept_per_chunk, chunk)
