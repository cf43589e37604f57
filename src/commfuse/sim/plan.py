"""The communication plan: how the simulator carries out a model's communication in a step.

A training strategy (``commfuse.train.strategy``: torch DDP, commfuse's engine with a
compressor, local SGD, ...) becomes a plan with ``commfuse.train.sim_plan.plan_for``; a plan can
also be written directly for what-if questions (a compression ratio, fused chunks). Each field
stands for one technique of ``docs/design.md``, simulated from its model (the engines that implement
them live in ``ddp/``, ``fused/`` and ``localsgd/``):

* ``algorithm`` / ``algorithms``: the collective algorithm per message, or ``"auto"``, the
  tuner's choice for that size (``tuner.choose_for``);
* ``bucket_cap_mb`` and ``overlap``: gradients are packed into buckets in backward order and each
  bucket's allreduce starts as soon as it is full, under the rest of backward (wait-free
  backprop; PyTorch DDP's default is 25 MB), or all after backward when ``overlap`` is off;
* ``compressor`` or ``compression_ratio``, and ``compression_gbyte_per_s``: each bucket's
  gradients travel as the compressor's message (its ``payload_bytes``, on its ``aggregation``:
  an allreduce, or an allgather of every rank's message) or shrink to that fraction of their
  bytes, at the price of compressing and decompressing them at that rate (and, with
  ``finite_agreement``, of one small flag allreduce per bucket);
* ``fused_chunks``: a fused computation-collective operator splits a layer's compute into this
  many chunks and sends each chunk's result while computing the next (1: unfused);
* ``local_sgd_period``: synchronise the model every H steps (local SGD, DiLoCo) with one
  allreduce of the parameters, instead of gradients every step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from commfuse.collectives.registry import COLLECTIVES

if TYPE_CHECKING:
    import torch


class _MessageModel(Protocol):
    """What the simulator reads of a compressor (``commfuse.compress`` compressors have it):
    the bytes of one rank's message for a bucket, and the collective that combines them."""

    aggregation: ClassVar[Literal["all_reduce", "all_gather"]]

    def payload_bytes(self, numel: int, dtype: torch.dtype, world_size: int) -> int: ...


#: A bucket cap no model reaches, MiB: every gradient in one buffer (the compressed Adams').
ONE_BUFFER_MB = float(1 << 40)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommPlan:
    """How to communicate; the defaults are PyTorch DDP's."""

    algorithm: str = "auto"
    """Algorithm for every collective (a registered name, an alias, or "auto")."""
    algorithms: tuple[tuple[str, str], ...] = ()
    """Per-collective overrides, e.g. (("all_reduce", "ring"),)."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size, MB (2**20 bytes); 0 puts each layer in its own bucket."""
    first_bucket_cap_mb: float = 0.0
    """Cap of the first bucket (the last layers' gradients), MB; torch DDP and
    ``commfuse.ddp.DataParallel`` use 1 MB so communication starts early (0: ``bucket_cap_mb``)."""
    overlap: bool = True
    """Start each bucket's allreduce during backward (else after it)."""
    compressor: _MessageModel | None = None
    """The message of every gradient bucket (and outer update): its ``payload_bytes`` for the
    bucket's elements (after any warm-up), on its ``aggregation``. None: ``compression_ratio``."""
    compression_ratio: float = 1.0
    """Without a compressor: communicated bytes / original bytes of gradients (and outer
    updates), in (0, 1]."""
    compression_gbyte_per_s: float = 0.0
    """Rate of compression plus decompression, GB of original data per second (0: free)."""
    finite_agreement: bool = True
    """With compression, each bucket first allreduces a small table of NaN/Inf flags, so that
    every rank skips a poisoned step before its error feedback is touched (``commfuse.ddp``
    does for compressors that can drop a NaN, such as sign or top-k; not for fp16, bf16 or
    PowerSGD, whose output turns non-finite everywhere; torch's hooks never do)."""
    fused_chunks: int = 1
    """Chunks of a fused compute + collective operator (1: unfused)."""
    local_sgd_period: int = 1
    """Steps between model synchronisations (1: synchronous data parallel)."""
    outer_fraction: float = 1.0
    """Share of the parameters exchanged at each synchronisation (streaming DiLoCo's 1/F)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {self.bucket_cap_mb}")
        if self.first_bucket_cap_mb < 0:
            raise ValueError(f"first_bucket_cap_mb must be >= 0, got {self.first_bucket_cap_mb}")
        if not 0 < self.compression_ratio <= 1:
            raise ValueError(f"compression_ratio must be in (0, 1], got {self.compression_ratio}")
        if self.compression_gbyte_per_s < 0:
            raise ValueError("compression_gbyte_per_s must be >= 0")
        if self.fused_chunks < 1:
            raise ValueError(f"fused_chunks must be >= 1, got {self.fused_chunks}")
        if self.local_sgd_period < 1:
            raise ValueError(f"local_sgd_period must be >= 1, got {self.local_sgd_period}")
        if not 0 < self.outer_fraction <= 1:
            raise ValueError(f"outer_fraction must be in (0, 1], got {self.outer_fraction}")
        for collective, _ in self.algorithms:
            if collective not in COLLECTIVES:
                raise ValueError(
                    f"unknown collective {collective!r} in algorithms; known: {COLLECTIVES}"
                )

    @property
    def compresses(self) -> bool:
        """Whether gradients travel in fewer bytes (a compressor, or a ratio below 1)."""
        return self.compressor is not None or self.compression_ratio < 1

    def message(self, nbytes: int, dtype_bytes: int, world_size: int) -> tuple[str, int]:
        """(collective, nccl-tests' S) that carries ``nbytes`` of gradients among
        ``world_size`` ranks: an allreduce of the message, or an allgather of every rank's."""
        if self.compressor is None:
            return "all_reduce", int(nbytes * self.compression_ratio)
        # A compressor (commfuse.compress) has imported torch already, so naming its dtype
        # costs nothing here; plans without one stay torch-free.
        import torch

        numel = nbytes // dtype_bytes
        dtype = {2: torch.float16, 8: torch.float64}.get(dtype_bytes, torch.float32)
        size = self.compressor.payload_bytes(numel, dtype, world_size)
        if self.compressor.aggregation == "all_gather":
            return "all_gather", size * world_size
        return "all_reduce", size

    def algorithm_for(self, collective: str) -> str:
        return dict(self.algorithms).get(collective, self.algorithm)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * (1 << 20))

    def cap_of_bucket(self, index: int) -> int:
        """Bytes at which bucket ``index`` (0: the first launched) closes."""
        if index == 0 and self.first_bucket_cap_mb > 0:
            return int(self.first_bucket_cap_mb * (1 << 20))
        return self.bucket_cap_bytes

    def describe(self) -> str:
        parts = [f"algo={self.algorithm}"]
        parts += [f"{c}={a}" for c, a in self.algorithms]
        bucket = (
            "one buffer" if self.bucket_cap_mb >= ONE_BUFFER_MB else f"{self.bucket_cap_mb:g}MB"
        )
        parts.append(f"bucket={bucket}" + ("" if self.overlap else " no-overlap"))
        if self.compressor is not None:
            parts.append(f"compressor={getattr(self.compressor, 'name', '?')}")
        elif self.compression_ratio < 1:
            parts.append(f"compress={self.compression_ratio:g}")
        if self.fused_chunks > 1:
            parts.append(f"fused x{self.fused_chunks}")
        if self.local_sgd_period > 1:
            share = f" ({self.outer_fraction:.2g} of the model)" if self.outer_fraction < 1 else ""
            parts.append(f"sync every {self.local_sgd_period}{share}")
        return ", ".join(parts)
