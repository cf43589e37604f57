"""Finding NaN/Inf gradients in a bucket without paying for it on every step.

The exact test, ``torch.isfinite(x).all()``, writes a boolean per element and reads it back,
a pass that torch DDP, having no such check, does not pay, and that is exposed after the last
bucket lands. A sum is one fused read: NaN and Inf propagate through it (``inf + -inf`` is NaN), so a finite sum
proves every element finite. A non-finite sum is either a non-finite element or an overflow of
large finite ones; only then is the exact per-parameter test run, to name the culprits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commfuse.compress.base import all_finite
from commfuse.ddp.buckets import Bucket


def nonfinite_slots(bucket: Bucket) -> list[int]:
    """Slots of ``bucket`` whose gradient holds a NaN or Inf ([] on the fast path)."""
    if all_finite(bucket.flat):
        return []
    return nonfinite_positions([bucket.view(slot) for slot in range(len(bucket.params))])


def nonfinite_positions(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """Positions of the tensors holding a NaN or Inf (the exact test; None counts as finite)."""
    return [i for i, t in enumerate(tensors) if t is not None and not bool(torch.isfinite(t).all())]
