"""Which gradients travel together: the bucket layout, and each bucket's flat buffer.

Sending every gradient on its own pays the start-up cost alpha once per tensor; sending all of
them at the end of backward hides nothing. Buckets sit between (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020): parameters are taken in the
order their gradients become ready, which is roughly the reverse of registration order (the
last layer's gradient is computed first), and cut into consecutive groups of at most
``bucket_cap`` bytes; the first group is capped smaller (``first_cap``) so the first
collective starts early. Each bucket is one flat contiguous buffer, so it is one collective.

The cut is torch's (``compute_bucket_assignment_by_size``): a bucket closes as soon as it
reaches its cap, parameters of different dtypes never share a bucket, and with the same order
and caps the layout is the same as torch DDP's rebuilt one (its ``bucket_cap_mb_list``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch


def assign_buckets(
    sizes_bytes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    *,
    first_cap_bytes: int,
    cap_bytes: int,
) -> list[list[int]]:
    """Cut items (given in launch order) into buckets; returns lists of item positions.

    Each dtype fills its own open bucket; a bucket closes when its bytes reach the cap (the
    dtype's first bucket: ``first_cap_bytes``, then ``cap_bytes``). Buckets are ordered by their
    first item, so the one holding the earliest-ready gradient is launched first.
    """
    if len(sizes_bytes) != len(dtypes):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(dtypes)} dtypes")
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got {first_cap_bytes} and {cap_bytes}")
    closed: list[list[int]] = []
    open_: dict[torch.dtype, list[int]] = {}
    filled: dict[torch.dtype, int] = {}
    closed_count: dict[torch.dtype, int] = {}
    for position, (size, dtype) in enumerate(zip(sizes_bytes, dtypes, strict=True)):
        members = open_.setdefault(dtype, [])
        members.append(position)
        filled[dtype] = filled.get(dtype, 0) + size
        cap = first_cap_bytes if closed_count.get(dtype, 0) == 0 else cap_bytes
        if filled[dtype] >= cap:
            closed.append(members)
            closed_count[dtype] = closed_count.get(dtype, 0) + 1
            del open_[dtype]
            filled[dtype] = 0
    closed.extend(members for members in open_.values() if members)
    return sorted(closed, key=lambda members: members[0])


@dataclasses.dataclass
class Bucket:
    """One bucket: its parameters (indices into the engine's list), where each lives in ``flat``,
    and the progress of the current step."""

    index: int
    params: list[int]
    offsets: list[int]
    numels: list[int]
    flat: torch.Tensor
    pending: int = 0
    """Gradients of this bucket still to arrive in the current backward."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, slot: int) -> torch.Tensor:
        """The slice of ``flat`` holding the slot-th parameter of this bucket (flat)."""
        start = self.offsets[slot]
        return self.flat[start : start + self.numels[slot]]


def build_buckets(params: Sequence[torch.Tensor], groups: Sequence[Sequence[int]]) -> list[Bucket]:
    """Allocate one zeroed flat buffer per group of parameter indices."""
    buckets = []
    for index, members in enumerate(groups):
        dtypes = {params[i].dtype for i in members}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {index} mixes dtypes {sorted(map(str, dtypes))}")
        numels = [params[i].numel() for i in members]
        offsets = [0, *itertools.accumulate(numels)][:-1]
        flat = torch.zeros(
            sum(numels), dtype=params[members[0]].dtype, device=params[members[0]].device
        )
        buckets.append(Bucket(index, list(members), offsets, numels, flat))
    return buckets
