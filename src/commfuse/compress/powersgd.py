"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): rank-r factors, allreduced.

A gradient matrix ``M`` (m x c) is approximated by ``P Q^T`` with ``P`` m x r and ``Q`` c x r,
found by one step of power iteration that starts from the previous step's ``Q`` (warm start:
the gradient changes slowly, so one iteration per step tracks its top subspace). Both factors
are sums of the ranks' own factors, so they ride plain allreduces. Per bucket and step:

1. ``M = g + e`` (error feedback), reshaped to a matrix;
2. ``P = M Q``; allreduce(P, avg); orthonormalise ``P`` (QR, identical on every rank);
3. ``Q = M^T P``; this rank's own loss is ``e = M - P Q^T`` (error feedback);
4. allreduce(Q, avg); the output is ``P Q^T`` = the average of the ranks' ``P P^T M_r``.

Shape: torch's ``powerSGD_hook`` compresses each parameter's own matrix, which needs the
parameter shapes inside the bucket; the engine hands compressors a flat bucket, so this one
lays the bucket out as a square-ish ``m x c`` matrix (``c = ceil(sqrt(d))``, ``m = ceil(d/c)``,
zero-padded). That costs ``(m + c) r`` elements per rank, about ``2 r sqrt(d)``, instead of
``d``: a 1M-element bucket at rank 4 sends 8000 (125x less). A bucket for which
``(m + c) r >= d`` is sent uncompressed (as torch's ``min_compression_rate``), and so are all
buckets during the first ``warmup`` steps (torch's ``start_powerSGD_iter``): early gradients
change too fast for a warm-started low rank to follow.

Tuning (as in torch's docs): raise ``rank`` until accuracy matches the uncompressed run
(1-4 is often enough); ``warmup`` of about 10% of training. Q starts from a normal draw
seeded by (seed, bucket), the same on all ranks. Factors are computed in fp32 for 16-bit
buckets (CPU QR needs it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import GradientCompressor, generator_for
from commfuse.compress.wire import element_bytes


def matrix_shape(numel: int) -> tuple[int, int]:
    """The square-ish ``(m, c)`` a flat bucket of ``numel`` elements is laid out as."""
    cols = max(1, math.isqrt(numel - 1) + 1) if numel else 1
    return -(-numel // cols), cols


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic on identical inputs)."""
    q: torch.Tensor = torch.linalg.qr(p, mode="reduced").Q
    return q


@dataclasses.dataclass(kw_only=True)
class PowerSGDCompressor(GradientCompressor):
    """Rank-``rank`` power iteration with warm start and error feedback."""

    name: ClassVar[str] = "powersgd"
    aggregation: ClassVar[Literal["allreduce", "allgather"]] = "allreduce"
    rank: int = 2
    """Rank ``r`` of the approximation."""
    warmup: int = 10
    """Steps sent uncompressed before compression starts."""
    ef: bool = True
    qs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {self.rank}")
        if self.warmup < 0:
            raise ValueError(f"powersgd: warmup must be >= 0 steps, got {self.warmup}")

    def compresses(self, numel: int, step: int | None) -> bool:
        """Whether a bucket of ``numel`` elements is sent as factors at ``step``."""
        m, c = matrix_shape(numel)
        warm = step is None or step >= self.warmup
        return warm and (m + c) * self.rank < numel

    def payload_bytes(
        self, numel: int, dtype: torch.dtype, world_size: int, *, step: int | None = None
    ) -> int:
        if not self.compresses(numel, step):
            return numel * element_bytes(dtype)
        m, c = matrix_shape(numel)
        return (m + c) * self.rank * element_bytes(factor_dtype(dtype))

    def initial_q(self, cols: int, dtype: torch.dtype, bucket: int) -> torch.Tensor:
        """The first Q of a bucket: a normal draw, the same on every rank."""
        return torch.randn(cols, self.rank, generator=generator_for(self.seed, bucket)).to(dtype)

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        numel = grad.numel()
        if not self.compresses(numel, step):
            C.allreduce(comm, grad, "avg", algo=self.algo)
            return
        m, c = matrix_shape(numel)
        dtype = factor_dtype(grad.dtype)
        x = self.feedback.corrected(bucket, grad) if self.ef else grad
        matrix = torch.zeros(m * c, dtype=dtype)
        matrix[:numel] = x
        matrix = matrix.view(m, c)
        q = self.qs.get(bucket)
        if q is None or q.shape != (c, self.rank) or q.dtype != dtype:
            q = self.initial_q(c, dtype, bucket)
        p = matrix @ q
        C.allreduce(comm, p, "avg", algo=self.algo)
        # Another rank's non-finite gradient reaches everyone through P: keep Q and e clean.
        commit = commit and bool(torch.isfinite(p).all())
        p = orthonormalize(p)
        q = matrix.T @ p
        if self.ef and commit:
            own = (p @ q.T).view(-1)[:numel]
            self.feedback.update(bucket, x - own.to(grad.dtype))
        q = q.contiguous()
        C.allreduce(comm, q, "avg", algo=self.algo)
        if commit and bool(torch.isfinite(q).all()):
            self.qs[bucket] = q.clone()  # warm start of the next step
        grad.copy_((p @ q.T).view(-1)[:numel])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "qs": {b: q.clone() for b, q in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.qs = {int(b): q.clone() for b, q in state["qs"].items()}
