"""No compression, and casts to 16-bit floats (fp16, bf16): allreduce-compatible, 2x smaller.

A cast is the simplest compressor: the sum of fp16 numbers is an fp16 number, so the ranks'
messages are summed by an ordinary allreduce and nothing else changes (Micikevicius et al.
2018 use it for mixed precision; torch ships it as ``fp16_compress_hook``). As in torch's hook,
each rank divides by the world size BEFORE casting, so the sum cannot overflow fp16's 65504
when the gradients themselves fit; for world sizes that are powers of two the division is
exact, so integer-valued gradients come back exactly.

Round-trip error: relative ``2**-11`` for fp16 (within its normal range, |x| >= 6.1e-5; below
that, absolute 6e-8) and ``2**-8`` for bf16 (same range as fp32). Error feedback is off by
default (the error is at the level of fp32 rounding in most trainings); ``ef=True`` turns it on.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor, all_finite
from commfuse.compress.wire import divided_into, element_bytes


@dataclasses.dataclass(kw_only=True)
class NoCompression(Compressor):
    """The exact average with a commfuse allreduce: the baseline every compressor is held to."""

    nonfinite_reaches_every_rank: ClassVar[bool] = True
    name: ClassVar[str] = "none"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"

    def __post_init__(self) -> None:
        if self.ef:
            raise ValueError("none: error feedback needs a lossy compressor; drop ef=1")

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        C.all_reduce(comm, grad, "avg", algo=self.algo)

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        return numel * element_bytes(dtype)


@dataclasses.dataclass(kw_only=True)
class CastCompressor(Compressor):
    """Divide by the world size, cast to ``wire_dtype``, allreduce (sum), cast back."""

    #: NaN and Inf survive the cast and the sum (error feedback, if on, is only written by the
    #: rank's own finite input: what it records is that rank's own rounding error).
    nonfinite_reaches_every_rank: ClassVar[bool] = True

    wire_dtype: ClassVar[torch.dtype]

    def compress(self, x: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        """This rank's message: ``x / world_size`` in the wire dtype."""
        if world_size <= 1:
            return x.to(self.wire_dtype)
        return divided_into(x, world_size, self.wire_dtype)

    def decompress(self, message: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return message.to(dtype)

    @property
    def certifies_output(self) -> bool:
        """Without error feedback the output is the received sum, widened: finite exactly when
        the (half-size) message is, and there is no state to protect."""
        return not self.ef

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        key = self._state_key(bucket)
        world = comm.world_size
        x = self.feedback.corrected(key, grad) if self.ef else grad
        message = self.compress(x, world)
        if self.ef and commit:
            # What this rank contributes, scaled back to its own gradient's units.
            self.feedback.update(key, x - self.decompress(message, x.dtype) * world)
        C.all_reduce(comm, message, "sum", algo=self.algo)
        grad.copy_(message)
        if self.certifies_output:
            # Checked once widened, on the output the caller gets (its own-type sum overflows
            # only where the 16-bit message's would, which would send the check the exact way).
            self.output_finite = all_finite(grad)

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        return numel * element_bytes(self.wire_dtype)


@dataclasses.dataclass(kw_only=True)
class FP16(CastCompressor):
    """IEEE half precision on the wire (2x smaller than fp32)."""

    name: ClassVar[str] = "fp16"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclasses.dataclass(kw_only=True)
class BF16(CastCompressor):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa (2x smaller than fp32)."""

    name: ClassVar[str] = "bf16"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
