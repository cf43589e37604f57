"""signSGD and EF-signSGD: one bit per element plus one scale, 32x smaller than fp32.

Each rank sends ``sign(x)`` packed 8 per byte (``x_i >= 0`` -> bit 1) and the scale
``||x||_1 / d``, so its message decodes to ``C(x) = (||x||_1 / d) sign(x)``, the scaled sign of
Karimireddy et al. 2019 ("Error Feedback Fixes SignSGD and other Gradient Compression
Schemes"), which keeps the gradient's magnitude where plain signSGD (Bernstein et al. 2018)
would make every step as large as the learning rate. Every rank gathers the messages and
averages the decoded vectors (rather than a majority vote: the average is what error feedback
and any optimizer expect of a gradient).

Round-trip error, exactly: ``||x - C(x)||^2 = ||x||^2 - ||x||_1^2 / d``, at most
``(1 - 1/d) ||x||^2``. ``sign`` runs without error feedback (biased: it may not converge);
``ef-sign`` with it (Karimireddy et al.'s EF-signSGD, which converges like SGD).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from commfuse.compress.message import MessageCompressor
from commfuse.compress.wire import Layout, pack_bits, packed_bytes, unpack_bits


@dataclasses.dataclass(kw_only=True)
class Sign(MessageCompressor):
    """Scaled sign, bits packed 8 per byte, no error feedback."""

    name: ClassVar[str] = "sign"

    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        return Layout.of((torch.float32, 1), (torch.uint8, packed_bytes(numel, 1)))

    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        x32 = x.float()
        scale = x32.abs().mean().reshape(1)
        return [scale, pack_bits((x32 >= 0).to(torch.uint8), 1)]

    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        scales, packed = parts
        signs = unpack_bits(packed, 1, numel).float().mul_(2).sub_(1)
        return (signs * scales).sum(dim=0).to(dtype)


@dataclasses.dataclass(kw_only=True)
class EFSign(Sign):
    """EF-signSGD: the scaled sign with error feedback."""

    name: ClassVar[str] = "ef-sign"
    ef: bool = True
