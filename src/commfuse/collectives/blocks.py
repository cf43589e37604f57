"""How a buffer is cut into pieces: ``num_parts`` near-equal blocks (ring, halving) or blocks of
a fixed size (pipelines).

Blocks are ``(start, stop)`` element ranges of a flat tensor. Near-equal means sizes differ by
at most one element and larger blocks come first, so any numel, 0 included, splits cleanly over
any number of parts.
"""

from __future__ import annotations


def even_blocks(numel: int, num_parts: int) -> list[tuple[int, int]]:
    """``num_parts`` contiguous ranges covering ``[0, numel)``, sizes differing by at most one."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    base, extra = divmod(numel, num_parts)
    blocks = []
    start = 0
    for part in range(num_parts):
        stop = start + base + (1 if part < extra else 0)
        blocks.append((start, stop))
        start = stop
    return blocks


def fixed_blocks(numel: int, block_elems: int) -> list[tuple[int, int]]:
    """Ranges of ``block_elems`` elements (the last may be shorter); one empty range if numel is 0."""
    if block_elems < 1:
        raise ValueError(f"block size must be >= 1 element, got {block_elems}")
    if numel == 0:
        return [(0, 0)]
    return [(start, min(start + block_elems, numel)) for start in range(0, numel, block_elems)]
