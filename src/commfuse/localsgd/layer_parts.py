"""DreamDDP's unit of exchange: a layer, or an equal slice of one (``DreamDDPConfig.split``).

DreamDDP averages every layer once per period of H steps, a planned group per step
(``layer_schedule.py``). The plan can spread the bytes over the steps only as finely as the
layers are cut: a step cannot carry less than its largest layer, and a model whose largest
layers hold more than ``1/H`` of its parameters has steps that carry more than the mean
``4 N / H`` bytes and steps that carry almost nothing. Where ranks share cores, every byte
exchanged also costs CPU that no overlap hides (the copies, the reductions, the network
stack), which the step with the most bytes pays most of.

Cutting fixes the granularity: with ``split = k``, every layer larger than ``N / (H k)``
parameters is cut into the fewest equal contiguous slices (of its parameters concatenated in
registration order) that are no larger, and each slice is planned, sent and landed as a layer
of its own (at its layer's next use, like the whole layer). Parameters do not interact inside
an average, so a slice averaged at one step and the rest at another is the same method as
streaming DiLoCo's fragments; the plan can then fill every step to within one slice, ``1/k``
of the mean, of the same bytes.

A part is a list of segments ``(parameter index, start, stop)`` over each parameter's
flattened elements; a whole layer is one segment per parameter, covering it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """One unit of exchange: ``segments`` of the parameters of ``layer``."""

    layer: int
    """The layer (index into ``layers_of``'s list) whose module's use lands it."""
    segments: tuple[tuple[int, int, int], ...]
    """``(parameter index, start, stop)``: a slice of that parameter's flattened elements."""

    @property
    def numel(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)


def cut_layers(
    layers: Sequence[Sequence[int]], numels: Sequence[int], period: int, split: int
) -> list[Part]:
    """The parts of ``layers`` (each a list of parameter indices; ``numels[i]`` the elements
    of parameter i), in layer order: with ``split`` 0, one per layer; else every layer larger
    than ``ceil(N / (period * split))`` elements (N: all of them) cut into the fewest equal
    contiguous slices no larger (the module docstring).

    Raises:
        ValueError: ``split`` or ``period`` below its least (0 and 1).
    """
    if split < 0 or period < 1:
        raise ValueError(f"split must be >= 0 and period >= 1, got {split} and {period}")
    total = sum(numels[i] for members in layers for i in members)
    limit = math.ceil(total / (period * split)) if split else 0
    parts = []
    for layer, members in enumerate(layers):
        size = sum(numels[i] for i in members)
        pieces = max(1, math.ceil(size / limit)) if limit else 1
        bounds = [size * k // pieces for k in range(pieces + 1)]  # equal to within one element
        for lo, hi in itertools.pairwise(bounds):
            parts.append(Part(layer, _segments(members, numels, lo, hi)))
    return parts


def _segments(
    members: Sequence[int], numels: Sequence[int], lo: int, hi: int
) -> tuple[tuple[int, int, int], ...]:
    """The parameter slices that hold elements ``[lo, hi)`` of ``members`` concatenated."""
    out, offset = [], 0
    for i in members:
        start, stop = max(lo, offset), min(hi, offset + numels[i])
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += numels[i]
    return tuple(out)


def read(params: Sequence[torch.Tensor], part: Part) -> torch.Tensor:
    """A new flat tensor of ``part``'s values (on the parameters' device)."""
    return torch.cat([params[i].detach().reshape(-1)[a:b] for i, a, b in part.segments])


def add(params: Sequence[torch.Tensor], part: Part, flat: torch.Tensor) -> None:
    """Add ``flat`` (``part.numel`` elements) to ``part``'s values in place."""
    with torch.no_grad():
        for values, piece in _pieces(params, part, flat):
            values.add_(piece)


def write(params: Sequence[torch.Tensor], part: Part, flat: torch.Tensor) -> None:
    """Copy ``flat`` (``part.numel`` elements) into ``part``'s values."""
    with torch.no_grad():
        for values, piece in _pieces(params, part, flat):
            values.copy_(piece)


def _pieces(
    params: Sequence[torch.Tensor], part: Part, flat: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each segment of ``part`` as (a view of the parameter's values, its slice of ``flat``)."""
    offset = 0
    for i, a, b in part.segments:
        yield params[i].view(-1)[a:b], flat[offset : offset + b - a]
        offset += b - a
