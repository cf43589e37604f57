"""Sparsifiers: top-k (allgathered values + indices), random-k and random-block (allreduced).

Top-k (Aji and Heafield 2017; Stich et al. 2018 with memory): each rank sends the
``k = ceil(ratio * d)`` entries of largest magnitude, as values in the gradient's dtype plus
int32 indices; ranks pick different indices, so messages are allgathered and every rank
scatter-adds them. At 1% that is ``8 / (0.01 * 4) = 50x`` less than fp32 before the gather.
Round-trip error: ``||x - top_k(x)||^2 <= (1 - k/d) ||x||^2``.

Random-k and random-block (Stich et al. 2018; Shi et al. 2019): the k indices are drawn from a
generator seeded by (seed, step, bucket), the SAME on every rank (random-k draws one index per
stratum of d/k elements: each element kept with probability ~k/d, in O(k)), so the k values can simply be
allreduced (no indices on the wire, ``k`` values per rank). Random-block takes k consecutive
indices from a random start (wrapping around), a cheap contiguous copy. No ``d/k`` rescaling:
with error feedback (on by default) the unsent entries are delivered later instead, which is
what makes these converge (Stich et al.'s "memory").
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor, generator_for
from commfuse.compress.message import MessageCompressor
from commfuse.compress.wire import Layout, element_bytes


def num_kept(ratio: float, numel: int) -> int:
    """``ceil(ratio * numel)``, at least 1 (for a non-empty bucket) and at most ``numel``."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the k entries of ``x`` largest in magnitude."""
    indices = torch.topk(x.abs(), k, sorted=False).indices
    return x[indices], indices.to(torch.int32)


def _scatter_sum(
    values: torch.Tensor, indices: torch.Tensor, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """A dense vector holding the sum of every row's (values, indices) pairs."""
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1).to(dtype))
    return out


@dataclasses.dataclass(kw_only=True)
class TopK(MessageCompressor):
    """Top-k by magnitude with error feedback; values + int32 indices allgathered."""

    name: ClassVar[str] = "topk"
    ratio: float = 0.01
    """Fraction of the bucket's elements sent each step."""
    ef: bool = True

    def __post_init__(self) -> None:
        self._check_positive("ratio", self.ratio, at_most=1.0)

    def k_for(self, numel: int, step: int | None) -> int:
        return num_kept(self.ratio, numel)

    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        k = self.k_for(numel, step)
        return Layout.of((dtype, k), (torch.int32, k))

    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        values, indices = top_k(x, self.k_for(x.numel(), step))
        return [values, indices]

    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        values, indices = parts
        return _scatter_sum(values, indices, numel, dtype)


@dataclasses.dataclass(kw_only=True)
class RandomK(Compressor):
    """k shared random indices per (step, bucket); their values allreduced."""

    name: ClassVar[str] = "randomk"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"
    ratio: float = 0.01
    """Fraction of the bucket's elements sent each step."""
    ef: bool = True

    def __post_init__(self) -> None:
        self._check_positive("ratio", self.ratio, at_most=1.0)

    def indices(
        self, numel: int, *, step: int, bucket: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The k indices every rank uses at (step, bucket), sorted (a friendlier gather), on
        ``device`` (drawn on the CPU generator, so every device gets the same ones)."""
        k = num_kept(self.ratio, numel)
        # Stratified: one uniform index in each of k equal strata [i d/k, (i+1) d/k). Every
        # element is kept with probability ~k/d, as with a random permutation, but drawing
        # costs O(k) instead of a random permutation's O(d).
        bounds = torch.div(torch.arange(k + 1, device="cpu") * numel, k, rounding_mode="floor")
        gen = generator_for(self.seed, step, bucket)
        uniform = torch.rand(k, generator=gen, dtype=torch.float64, device="cpu")
        offsets = (uniform * (bounds[1:] - bounds[:-1])).long()
        return (bounds[:-1] + offsets).to(device)

    def compress(self, x: torch.Tensor, *, step: int = 0, bucket: int = 0) -> torch.Tensor:
        """The message: the values at the shared indices."""
        return x[self.indices(x.numel(), step=step, bucket=bucket, device=x.device)]

    def decompress(
        self, message: torch.Tensor, numel: int, *, step: int = 0, bucket: int = 0
    ) -> torch.Tensor:
        out = message.new_zeros(numel)
        out[self.indices(numel, step=step, bucket=bucket, device=message.device)] = message
        return out

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        key = self._state_key(bucket)
        x = self.feedback.corrected(key, grad) if self.ef else grad
        index = self.indices(grad.numel(), step=step, bucket=bucket, device=grad.device)
        message = x[index]
        if self.ef and commit:
            x[index] = 0  # x is the corrected copy: what stays behind is the residual
            self.feedback.update(key, x)
        C.all_reduce(comm, message, "avg", algo=self.algo)
        grad.zero_()
        grad[index] = message

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        return num_kept(self.ratio, numel) * element_bytes(dtype)


@dataclasses.dataclass(kw_only=True)
class RandomBlock(RandomK):
    """k consecutive elements from a shared random start (wrapping around)."""

    name: ClassVar[str] = "randblock"

    def indices(
        self, numel: int, *, step: int, bucket: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        k = num_kept(self.ratio, numel)
        gen = generator_for(self.seed, step, bucket)
        start = int(torch.randint(numel, (1,), generator=gen, device="cpu"))
        return (torch.arange(k, device=device) + start) % numel
