"""Split a model's parameters into fragments synchronised at staggered steps (streaming DiLoCo).

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025): instead of
exchanging the whole model every H steps, split it into F fragments and synchronise fragment f
at steps t with t = f H / F (mod H). Every fragment is still synchronised once per H steps, but
the bytes of one synchronisation, and so the peak bandwidth, fall by F.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split_into_fragments(params: Sequence[torch.Tensor], num_fragments: int) -> list[list[int]]:
    """Indices of ``params`` per fragment: contiguous runs in registration order (neighbouring
    layers together), balanced by element count, every parameter in exactly one fragment."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if len(params) < num_fragments:
        raise ValueError(
            f"{len(params)} trainable parameters cannot fill {num_fragments} fragments; "
            "use fewer fragments"
        )
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    fragments: list[list[int]] = [[]]
    running = 0
    for index, size in enumerate(sizes):
        current = len(fragments) - 1
        params_left = len(params) - index  # this one included
        fragments_left = num_fragments - current - 1  # after the current one
        boundary = total * (current + 1) / num_fragments
        # Close the current fragment once it holds its share (by the parameter's midpoint), or
        # when every remaining parameter is needed to give each later fragment one.
        if (
            fragments[current]
            and fragments_left > 0
            and (running + size / 2 > boundary or params_left == fragments_left)
        ):
            fragments.append([])
        fragments[-1].append(index)
        running += size
    assert sorted(i for f in fragments for i in f) == list(range(len(params)))
    assert all(fragments), fragments
    return fragments


def fragment_offset(fragment: int, num_fragments: int, period_steps: int) -> int:
    """The step within each period at which ``fragment`` synchronises (0 for fragment 0)."""
    return (fragment * period_steps) // num_fragments


def fragments_due(step: int, num_fragments: int, period_steps: int) -> list[int]:
    """Fragments to synchronise after inner step ``step`` (1-based count of periodic steps)."""
    if step <= 0:
        return []
    return [
        f
        for f in range(num_fragments)
        if (step - fragment_offset(f, num_fragments, period_steps)) % period_steps == 0
    ]
