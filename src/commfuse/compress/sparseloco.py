"""SparseLoCo: top-k of the outer pseudo-gradient per chunk, 2-bit values, decayed error feedback.

Sarfi, Therien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo"
(2025). DiLoCo's outer exchange sends the whole fp32 pseudo-gradient every H steps; SparseLoCo
sends about 1.5% of it in 2 bits a value. Per exchange and rank (the paper's Algorithm 1):

1. ``x = delta + decay e``: the pseudo-gradient plus the residual of earlier exchanges, decayed
   (the paper's beta, 0.95);
2. cut ``x`` into chunks of ``chunk_numel`` elements (4096) and keep the ``num_kept_per_chunk``
   (64) largest in magnitude of each, by their index inside the chunk (16 bits);
3. quantise each kept value to 2 bits: its sign, and whether its magnitude is at least the
   midpoint of the chunk's smallest and largest kept ones; each of the two groups decodes to
   its mean magnitude (sent as fp32), as the paper's quantiser decodes a bin to its mean;
4. ``e = x - decoded``: what was not sent, kept for the next exchange;
5. every rank gathers the messages and averages the decoded vectors.

The outer step is then the plain average, ``anchor -= 1.0 * avg`` (``outer_recipe``): the
decayed residual is the outer momentum, and ``diloco(compressor=SparseLoCo())`` applies this
unless its caller sets ``outer_lr`` or ``outer_momentum``. Where this differs from the paper
(flat chunks, the quantiser's bins) and why: docs/local-sgd.md.

Message per rank: per chunk 8 bytes of levels, ``2 k`` bytes of indices and ``k / 4`` bytes of
codes, padded to whole words: with the defaults 152 bytes for 16 KiB of fp32, 108x fewer.
Tuning: fewer kept per chunk cut bytes linearly; ``decay=1`` is plain error feedback.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from commfuse.compress.base import OuterRecipe
from commfuse.compress.chunked import ChunkTopKCompressor, as_rows
from commfuse.compress.wire import Layout, pack_bits, packed_bytes, unpack_bits


@dataclasses.dataclass(kw_only=True)
class SparseLoCo(ChunkTopKCompressor):
    """Top-k per chunk with 2-bit values and decayed error feedback, allgathered."""

    name: ClassVar[str] = "sparseloco"
    outer_recipe: ClassVar[OuterRecipe | None] = OuterRecipe(lr=1.0, momentum=0.0)
    """The paper's outer step: the plain average of the decoded updates, no momentum."""
    max_chunk_numel: ClassVar[int] = 1 << 16
    """Indices inside a chunk travel as 16-bit integers."""
    chunk_numel: int = 4096
    """Elements per chunk (at most 65536: indices are 16-bit)."""
    num_kept_per_chunk: int = 64
    """Values sent per chunk (k)."""
    decay: float = 0.95
    """The residual's decay per exchange (the paper's beta; 1 = plain error feedback)."""
    ef: bool = True

    def __post_init__(self) -> None:
        self._check_chunks()

    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        rows, _, k = self.shape(numel)
        return Layout.of(
            (torch.float32, 2 * rows),
            (torch.uint16, rows * k),
            (torch.uint8, packed_bytes(rows * k, 2)),
        )

    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        rows, chunk, k = self.shape(x.numel())
        matrix = as_rows(x, rows, chunk)
        index = torch.topk(matrix.abs(), k, dim=1, sorted=False).indices
        values = matrix.gather(1, index)
        magnitude = values.abs()
        lo, hi = magnitude.amin(dim=1, keepdim=True), magnitude.amax(dim=1, keepdim=True)
        high = magnitude * 2 >= lo + hi
        codes = (values >= 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
        # Each level is the mean magnitude of its group (the least-squares level for it), not
        # the group's extreme: decoding to lo and hi sent every value of a chunk with one
        # outlier as lo, and left the rest to the residual.
        num_high = high.sum(dim=1, keepdim=True)
        sum_high = torch.where(high, magnitude, 0.0).sum(dim=1, keepdim=True)
        sum_low = magnitude.sum(dim=1, keepdim=True) - sum_high
        level_hi = torch.where(num_high > 0, sum_high / num_high.clamp(min=1), hi)
        level_lo = torch.where(num_high < k, sum_low / (k - num_high).clamp(min=1), lo)
        bounds = torch.cat([level_lo, level_hi], dim=1).reshape(-1)
        return [bounds, index.to(torch.uint16).reshape(-1), pack_bits(codes.reshape(-1), 2)]

    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        bounds, index, packed = parts
        rows, chunk, k = self.shape(numel)
        ranks = bounds.shape[0]
        codes = unpack_bits(packed, 2, rows * k).view(ranks, rows, k)
        lo_hi = bounds.view(ranks, rows, 2)
        magnitude = torch.where(
            (codes >> 1).bool(),
            lo_hi[:, :, 1:].expand(-1, -1, k),
            lo_hi[:, :, :1].expand(-1, -1, k),
        )
        values = torch.where((codes & 1).bool(), magnitude, -magnitude)
        # Flat positions in the padded bucket: the row's start plus the index inside the row.
        starts = torch.arange(rows, device=values.device).view(1, rows, 1) * chunk
        positions = (index.view(ranks, rows, k).long() + starts).reshape(-1)
        out = values.new_zeros(rows * chunk)
        out.index_add_(0, positions, values.reshape(-1))
        return out[:numel].to(dtype)


def sparseloco_reference(c: SparseLoCo, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``c``'s message stands for, chunk by chunk in plain Python (float64): the decoded
    dense vector and the mask of kept elements. The batched ``compress`` must agree with it
    (ties in magnitude aside)."""
    numel = x.numel()
    _, chunk, k = c.shape(numel)
    flat = x.double().reshape(-1)
    decoded = torch.zeros(numel, dtype=torch.float64, device=x.device)
    kept = torch.zeros(numel, dtype=torch.bool, device=x.device)
    for start in range(0, numel, chunk):
        row = flat[start : start + chunk]
        order = sorted(range(row.numel()), key=lambda i: -abs(float(row[i])))[:k]
        # A short last row keeps padding zeros too: they count in the low group.
        magnitudes = [abs(float(row[i])) for i in order] + [0.0] * (k - len(order))
        lo, hi = min(magnitudes), max(magnitudes)
        high = [m for m in magnitudes if m * 2 >= lo + hi]
        low = [m for m in magnitudes if m * 2 < lo + hi]
        level_hi = sum(high) / len(high) if high else hi
        level_lo = sum(low) / len(low) if low else lo
        for i in order:
            value = float(row[i])
            level = level_hi if abs(value) * 2 >= lo + hi else level_lo
            decoded[start + i] = level if value >= 0 else -level
            kept[start + i] = True
    return decoded, kept
