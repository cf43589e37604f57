"""Stochastic quantisers: QSGD (s levels) and TernGrad (three levels), unbiased.

QSGD (Alistarh et al. 2017): split the bucket into chunks of ``chunk_numel`` elements (the
paper's "bucket size", 512 by default: one norm per chunk keeps the variance low); for each
chunk send its L2 norm ``n`` and, per element, a sign and a level ``l in 0..s`` drawn by
stochastic rounding: ``l = floor(s |x| / n + u)``, ``u ~ U[0, 1)``. The decoded ``n l sign / s``
is unbiased (``E[x^] = x``) with ``E||x^ - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2`` per chunk of
``d`` elements, and each element is off by less than ``n / s``.

TernGrad (Wen et al. 2017): the same with ``s = 1`` and the chunk's max ``|x|`` as the norm, so
each element becomes ``max * {-1, 0, +1}`` (2 bits), off by less than ``max``.

Codes ``sign * l + s`` (``2s + 1`` of them) are packed into the narrowest of 1/2/4/8 bits:
TernGrad and QSGD with s = 1 use 2 bits, s <= 7 4 bits, s <= 127 8 bits. Both are unbiased,
so error feedback is off by default. ``ef=True`` is accepted only when the quantiser is a
contraction, ``s**2 > chunk_numel`` (e.g. ``QSGD(levels=16, chunk_numel=64, ef=True)``): with a
larger variance the residual grows without bound (never for TernGrad, whose s is 1). The rounding draws come from a
generator on the gradient's device seeded by (seed, step, bucket, rank): independent across
ranks, reproducible on the same kind of device.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from commfuse.compress.base import generator_for
from commfuse.compress.message import MessageCompressor
from commfuse.compress.wire import Layout, bits_for, pack_bits, packed_bytes, unpack_bits


@dataclasses.dataclass(kw_only=True)
class _StochasticQuantizer(MessageCompressor):
    levels: int = 1
    """Quantisation levels ``s`` per sign (1..127)."""
    chunk_numel: int = 512
    """Elements sharing one norm."""

    use_max_norm: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 127:
            raise ValueError(f"{self.name}: levels must be in 1..127, got {self.levels}")
        if self.chunk_numel < 1:
            raise ValueError(f"{self.name}: chunk_numel must be >= 1, got {self.chunk_numel}")
        if self.ef and self.levels**2 <= self.chunk_numel:
            # Error feedback needs E||Q(x) - x||^2 < ||x||^2; QSGD's bound min(d/s^2, sqrt(d)/s)
            # is below 1 only for s > sqrt(d). Measured: levels=7, chunk 512 with ef grew the
            # residual to 7x the sum of all gradients in 30 steps.
            raise ValueError(
                f"{self.name}: error feedback diverges unless levels**2 > chunk_numel "
                f"(the quantiser's variance must be below the gradient's), got levels={self.levels}, "
                f"chunk_numel={self.chunk_numel}; raise levels, lower chunk_numel or drop ef=1"
            )

    @property
    def bits(self) -> int:
        return bits_for(2 * self.levels + 1)

    def _num_chunks(self, numel: int) -> int:
        return -(-numel // self.chunk_numel)

    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        return Layout.of(
            (torch.float32, self._num_chunks(numel)),
            (torch.uint8, packed_bytes(numel, self.bits)),
        )

    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        numel, chunk, s = x.numel(), self.chunk_numel, self.levels
        chunks = torch.zeros(self._num_chunks(numel) * chunk, dtype=torch.float32, device=x.device)
        chunks[:numel] = x.float()
        chunks = chunks.view(-1, chunk)
        if self.use_max_norm:
            norms = chunks.abs().amax(dim=1)
        else:
            norms = torch.linalg.vector_norm(chunks, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(1)
        # A draw per element, on the gradient's device: drawn on the CPU and copied over, they
        # would put the CPU and a copy of the message's size on a GPU's every step.
        gen = generator_for(self.seed, step, bucket, rank, device=x.device)
        uniform = torch.rand(chunks.shape, generator=gen, device=x.device)
        # |x| / norm <= 1, so levels stay within 0..s (the clamp guards float rounding only).
        level = torch.floor(chunks.abs() / safe * s + uniform).clamp_(0, s)
        codes = (torch.sign(chunks) * level + s).reshape(-1)[:numel].to(torch.uint8)
        return [norms, pack_bits(codes, self.bits)]

    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        norms, packed = parts
        levels = unpack_bits(packed, self.bits, numel).float() - self.levels
        per_element = norms.repeat_interleave(self.chunk_numel, dim=1)[:, :numel]
        return (levels * per_element).sum(dim=0).div_(self.levels).to(dtype)


@dataclasses.dataclass(kw_only=True)
class QSGD(_StochasticQuantizer):
    """QSGD: L2 norm per chunk, ``levels`` levels, stochastic rounding."""

    name: ClassVar[str] = "qsgd"
    levels: int = 7


@dataclasses.dataclass(kw_only=True)
class TernGrad(_StochasticQuantizer):
    """TernGrad: max norm per chunk, values in {-1, 0, +1}."""

    name: ClassVar[str] = "terngrad"
    use_max_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.levels != 1:
            raise ValueError(f"terngrad has exactly 1 level per sign, got levels={self.levels}")
        super().__post_init__()
