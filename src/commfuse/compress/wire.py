"""The bytes a compressed message occupies on the wire: field layouts and bit packing.

An allgather-based compressor sends ONE message per bucket, so each bucket costs one collective
start-up (alpha) instead of one per field: the scale(s), the values and the indices are laid
end to end in a byte buffer, padded to a multiple of 4 bytes and handed to the collective as
int32 words (the commfuse collectives move float and int32/int64 tensors, not bytes). Every
rank's message has the same layout, because the layout depends only on the bucket's size, the
dtype and the step, which all ranks share.

Low-precision codes (1, 2, 4 or 8 bits) are packed 8/bits per byte, little end first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

WORD_BYTES = 4
"""The wire unit: messages travel as int32 words, so they are padded to a multiple of 4 bytes."""


def element_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def divided_into(x: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``x / world_size`` as a new ``dtype`` tensor, divided in ``x``'s precision and rounded
    once: the same bits as ``(x / world_size).to(dtype)`` without the full-size temporary in
    ``x``'s type (a third less time for a 16-bit message). Pre-dividing before a 16-bit sum
    makes the sum overflow only where the average itself would."""
    message = torch.empty_like(x, dtype=dtype)
    torch.div(x, world_size, out=message)
    return message


@dataclasses.dataclass(frozen=True)
class Layout:
    """The fields of one message, in order: ``(dtype, numel)`` each."""

    fields: tuple[tuple[torch.dtype, int], ...]

    @classmethod
    def of(cls, *fields: tuple[torch.dtype, int]) -> Layout:
        return cls(tuple(fields))

    @property
    def nbytes(self) -> int:
        """Bytes of the fields themselves."""
        return sum(element_bytes(dtype) * numel for dtype, numel in self.fields)

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: ``nbytes`` padded to whole int32 words."""
        return -(-self.nbytes // WORD_BYTES) * WORD_BYTES

    def pack(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The message as int32 words (``wire_bytes / 4`` of them)."""
        if len(parts) != len(self.fields):
            raise ValueError(f"layout has {len(self.fields)} fields, got {len(parts)} parts")
        chunks = []
        for part, (dtype, numel) in zip(parts, self.fields, strict=True):
            if part.dtype != dtype or part.numel() != numel:
                raise ValueError(
                    f"message field must be {numel} x {dtype}, got {part.numel()} x {part.dtype}"
                )
            chunks.append(part.reshape(-1).contiguous().view(torch.uint8))
        device = parts[0].device if parts else None
        chunks.append(torch.zeros(self.wire_bytes - self.nbytes, dtype=torch.uint8, device=device))
        return torch.cat(chunks).view(torch.int32)

    def unpack(self, words: torch.Tensor) -> list[torch.Tensor]:
        """Split ``words`` (ranks x wire words, int32) into fields, each ``ranks x numel``."""
        rows = words.reshape(-1, self.wire_bytes // WORD_BYTES).view(torch.uint8)
        out, offset = [], 0
        for dtype, numel in self.fields:
            size = element_bytes(dtype) * numel
            # A fresh buffer (offset 0, contiguous) so the bytes can be reinterpreted as dtype.
            field = rows.new_empty((rows.shape[0], size))
            field.copy_(rows[:, offset : offset + size])
            out.append(field.view(dtype))
            offset += size
        return out


def bits_for(num_codes: int) -> int:
    """The narrowest of 1, 2, 4, 8 bits that holds ``num_codes`` distinct codes."""
    for bits in (1, 2, 4, 8):
        if num_codes <= 1 << bits:
            return bits
    raise ValueError(f"{num_codes} codes do not fit in 8 bits")


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy packed."""
    return -(-numel * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (each < 2**bits) 8/bits per byte; the tail byte is zero-padded."""
    per_byte = 8 // bits
    numel = codes.numel()
    padded = codes.new_zeros(packed_bytes(numel, bits) * per_byte, dtype=torch.uint8)
    padded[:numel] = codes.reshape(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # Codes occupy disjoint bit ranges, so the sum of the shifted codes is their bitwise or.
    return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack_bits`` over rows: ``ranks x bytes`` -> ``ranks x numel`` uint8 codes."""
    rows = packed if packed.dim() == 2 else packed.reshape(1, -1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (rows.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(rows.shape[0], -1)[:, :numel]
