"""The data-parallel engine's configuration."""

from __future__ import annotations

import dataclasses
from typing import Literal

from commfuse.compress.base import Compressor


@dataclasses.dataclass(kw_only=True)
class DataParallelConfig:
    """How ``DataParallel`` buckets, reduces and checks gradients.

    Raises:
        ValueError: a bucket cap that is not positive, an unknown ``on_nonfinite`` or ``algo``,
            a ``staleness`` other than 0 or 1 (or 1 with ``find_unused_parameters`` or
            ``merge_buckets_by_cost``), or a ``compressor`` that is not a ``Compressor`` object
            (the message names the field).

    Example:
        ```python
        config = DataParallelConfig(bucket_cap_mb=25, compressor=PowerSGD(rank=8, wire="bf16"))
        ```
    """

    bucket_cap_mb: float = 25.0
    """Largest bucket, MiB (as torch DDP's ``bucket_cap_mb``); a bucket closes once it reaches it."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket launched, MiB: small, so communication starts early in backward."""
    merge_buckets_by_cost: bool = False
    """After the first step, re-bucket by MG-WFBP (Shi et al. 2019) from measured gradient
    arrival times and the tuner's cost model (see ``merge.py``)."""
    algo: str = "auto"
    """The commfuse allreduce algorithm for uncompressed buckets (``auto``, ``native``, ``ring``...)."""
    compressor: Compressor | None = None
    """Reduce every bucket with this compressor instead of a plain allreduce, e.g.
    ``PowerSGD(rank=8, wire="bf16")``."""
    on_nonfinite: Literal["skip", "raise"] = "skip"
    """A NaN/Inf gradient on any rank: ``skip`` zeroes the gradients and skips the step, ``raise`` stops."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 before every synchronized forward."""
    find_unused_parameters: bool = False
    """Leave parameters no rank used untouched (grad as it was), as torch DDP does; costs one tiny
    allreduce per step. Without it they get a zero gradient (see ``reducer.py``)."""
    skip_communication: bool = False
    """Compute-only mode: everything but the collectives (gradients stay local), for the compute floor."""
    staleness: Literal[0, 1] = 0
    """1: apply each step's averaged gradient one step later (Pipe-SGD, Li et al. NeurIPS 2018), so
    its communication runs during the next step's forward and backward instead of being waited
    for; the first step has nothing to apply (``DataParallel.step`` returns False). 0: apply it in
    the same step, as torch DDP does. See ``reducer.py``."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if not self.first_bucket_cap_mb > 0:
            raise ValueError(f"first_bucket_cap_mb must be > 0, got {self.first_bucket_cap_mb}")
        if self.on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {self.on_nonfinite!r}")
        from commfuse.collectives.registry import check_algorithm

        check_algorithm("all_reduce", self.algo)
        if self.staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1 steps, got {self.staleness}")
        if self.staleness and (self.find_unused_parameters or self.merge_buckets_by_cost):
            raise ValueError(
                "staleness=1 does not combine with find_unused_parameters or "
                "merge_buckets_by_cost (both need the step's own reduction before the next step)"
            )
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ValueError(
                "compressor must be a commfuse.compress.Compressor, an object, e.g. "
                f"PowerSGD(rank=8) or TopK(ratio=0.01), got {self.compressor!r}"
            )

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * (1 << 20))

    @property
    def first_bucket_cap_bytes(self) -> int:
        return int(self.first_bucket_cap_mb * (1 << 20))
