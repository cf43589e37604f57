"""Split a model's parameters into fragments synchronised at staggered steps (streaming DiLoCo).

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025): instead of
exchanging the whole model every H steps, split it into F fragments and synchronise fragment f
at steps t with t = f H / F (mod H). Every fragment is still synchronised once per H steps, but
the bytes of one synchronisation, and so the peak bandwidth, fall by F. (The paper cuts at
layer boundaries; here the cut is by element count, so the fall is exactly F.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened)."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def split_into_fragments(params: Sequence[torch.Tensor], num_fragments: int) -> list[list[Piece]]:
    """Cut the parameters, concatenated in registration order (neighbouring layers together),
    into ``num_fragments`` runs of equal element counts (they differ by at most one element):
    fragment f holds elements ``[f N / F, (f + 1) N / F)``, so one synchronisation sends at
    most ``ceil(N / F)`` elements, 1/F of the whole model, whatever the tensors' sizes (whole
    tensors per fragment overshot: the largest of 4 fragments of charlm held 1/3.9). A tensor
    may span two fragments; every element is in exactly one."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    if total < num_fragments:
        raise ValueError(
            f"{total} trainable elements cannot fill {num_fragments} fragments; use fewer fragments"
        )
    bounds = [total * f // num_fragments for f in range(num_fragments + 1)]
    fragments: list[list[Piece]] = [[] for _ in range(num_fragments)]
    offset = 0
    for index, size in enumerate(sizes):
        for f in range(num_fragments):
            lo, hi = max(bounds[f], offset), min(bounds[f + 1], offset + size)
            if lo < hi:
                fragments[f].append(Piece(param=index, start=lo - offset, stop=hi - offset))
        offset += size
    return fragments


def _fragment_offset(fragment: int, num_fragments: int, period_steps: int) -> int:
    """The step within each period at which ``fragment`` synchronises (0 for fragment 0)."""
    return (fragment * period_steps) // num_fragments


def fragments_due(step: int, num_fragments: int, period_steps: int) -> list[int]:
    """Fragments to synchronise after inner step ``step`` (1-based count of periodic steps)."""
    if step <= 0:
        return []
    return [
        f
        for f in range(num_fragments)
        if (step - _fragment_offset(f, num_fragments, period_steps)) % period_steps == 0
    ]
