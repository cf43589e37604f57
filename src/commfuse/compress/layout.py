"""Which parameters a bucket holds, and how per-bucket state moves when buckets change.

A compressor keeps state per bucket: error-feedback residuals, DGC's momentum, PowerSGD's
warm-started factors. A bucket's index and size do not say whose state it is: when buckets are
laid out anew (MG-WFBP's merge after the timing step, torch DDP's rebuild after iteration 0, a
resume with another bucket cap), two buckets of equal size may trade places, and state filed
under "bucket 1" would be applied to the other bucket's parameters. So state is filed under
the bucket's ``BucketLayout``: the names and shapes of the parameters packed into it, in order,
and its ``key``, a digest of them.

When a bucket gets a layout with no state of its own, each of its parameters' state is looked
up where it lives now (the layout that last held that parameter) and copied slice by slice to
the parameter's place in the new bucket: a residual or a momentum element by element, a
PowerSGD factor matrix by matrix. What cannot be moved (a parameter whose shape changed, state
of a bucket that had no layout) is dropped and counted in ``StateMoves``; it is never applied
to other parameters. A layout that no longer owns any parameter's state is forgotten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch


def check_shapes(shapes: Sequence[torch.Size | Sequence[int]]) -> tuple[torch.Size, ...]:
    """The shapes as ``torch.Size``; ValueError naming the first that is not a shape."""
    checked = []
    for i, shape in enumerate(shapes):
        try:
            size = torch.Size([int(d) for d in shape])
        except (TypeError, ValueError):
            raise ValueError(
                f"layout: tensor {i} has shape {shape!r}, not a sequence of ints"
            ) from None
        if any(d < 0 for d in size):
            raise ValueError(f"layout: tensor {i} has a negative dimension in {tuple(size)}")
        checked.append(size)
    return tuple(checked)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketLayout:
    """The tensors packed into one flat bucket, in order, with no gaps.

    ``names`` identify the parameters (``module.named_parameters()`` names); the same names and
    shapes on every rank give the same ``key``."""

    names: tuple[str, ...]
    """One name per tensor, unique within the bucket."""
    shapes: tuple[torch.Size, ...]
    """One shape per tensor; their numels add up to the bucket's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(str(n) for n in self.names))
        object.__setattr__(self, "shapes", check_shapes(self.shapes))
        if len(self.names) != len(self.shapes):
            raise ValueError(
                f"layout: {len(self.names)} names but {len(self.shapes)} shapes; give one each"
            )
        if len(set(self.names)) != len(self.names):
            twice = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ValueError(f"layout: parameter names must be unique, {twice} appear twice")

    @classmethod
    def of(cls, named_shapes: Sequence[tuple[str, Sequence[int]]]) -> BucketLayout:
        """``BucketLayout.of([("fc.weight", (8, 4)), ("fc.bias", (8,))])``."""
        return cls(
            names=tuple(n for n, _ in named_shapes),
            shapes=tuple(torch.Size(s) for _, s in named_shapes),
        )

    @classmethod
    def of_shapes(
        cls, shapes: Sequence[torch.Size | Sequence[int]], *, prefix: str
    ) -> BucketLayout:
        """Tensors named ``prefix0``, ``prefix1``, ... (for a caller without parameter names;
        a different ``prefix`` per bucket keeps their states apart)."""
        checked = check_shapes(shapes)
        return cls(names=tuple(f"{prefix}{i}" for i in range(len(checked))), shapes=checked)

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """First element of each tensor in the bucket."""
        return tuple(itertools.accumulate(self.numels, initial=0))[:-1]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @functools.cached_property
    def slices(self) -> dict[str, tuple[int, int]]:
        """``name -> (offset, numel)`` of each tensor."""
        return dict(zip(self.names, zip(self.offsets, self.numels, strict=True), strict=True))

    @functools.cached_property
    def key(self) -> str:
        """A digest of the names and shapes, in order: the bucket's identity."""
        text = ";".join(
            f"{name}:{'x'.join(map(str, shape))}"
            for name, shape in zip(self.names, self.shapes, strict=True)
        )
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:20]

    def to_state(self) -> dict[str, Any]:
        """Plain lists and strings, for a checkpoint that loads with ``weights_only=True``."""
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BucketLayout:
        return cls(names=tuple(state["names"]), shapes=tuple(map(torch.Size, state["shapes"])))


def anonymous_key(bucket: int) -> str:
    """The state key of a bucket that was given no layout: its index (the caller then keeps
    the same parameters in that bucket, as a fixed set of fragments does)."""
    return f"#{bucket}"


@dataclasses.dataclass(kw_only=True)
class StateMoves:
    """What re-layouts did to a compressor's state, in elements, since it was built."""

    moved_numel: int = 0
    """Elements of state copied to their parameter's new place."""
    dropped_numel: int = 0
    """Elements of state that could not follow their parameter and were discarded."""


def move_elementwise(
    store: dict[str, torch.Tensor],
    layout: BucketLayout,
    sources: dict[str, BucketLayout],
    moves: StateMoves,
) -> None:
    """Build ``store[layout.key]`` from each parameter's slice of the flat tensor where it
    lives now (``sources``: name -> the layout holding it); parameters with no state there
    start from zero. Nothing is stored when no parameter had state."""
    pieces = []
    for name, (offset, numel) in layout.slices.items():
        source = sources.get(name)
        old = store.get(source.key) if source is not None else None
        if source is None or old is None:
            continue
        start, length = source.slices[name]
        if length != numel or old.numel() != source.numel:
            moves.dropped_numel += length
            continue
        pieces.append((offset, old[start : start + length]))
    if not pieces:
        return
    new = pieces[0][1].new_zeros(layout.numel)
    for offset, piece in pieces:
        new[offset : offset + piece.numel()] = piece
        moves.moved_numel += piece.numel()
    store[layout.key] = new
