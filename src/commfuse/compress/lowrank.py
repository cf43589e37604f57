"""Where each tensor of a bucket goes in PowerSGD's messages: the per-tensor plan.

A bucket is a flat buffer holding several gradients back to back (its ``BucketLayout`` gives
their shapes, in order). A flat bucket, laid out as one square-ish matrix, has no low-rank structure:
its rows cut across unrelated parameters. A weight gradient does: an ``(out, in)`` linear layer's
gradient is a sum of ``batch`` outer products, so a few directions dominate it. torch's
``powerSGD_hook`` therefore compresses each tensor on its own, as the matrix
``(shape[0], numel / shape[0])``, and sends 1-D tensors (biases, norms) as they are. This module
plans that for one bucket:

* a tensor with ``ndim >= 2`` whose factors are smaller than itself,
  ``(rows + cols) r' < rows cols`` with ``r' = min(r, rows, cols)``, is a ``_Matrix``;
* every other element is ``plain`` and is averaged exactly.

The messages are two flat buffers, so a bucket costs two allreduces whatever its tensor count:
``[plain elements | every P]`` (the plain elements ride with the first factor: one round trip
fewer than torch's separate allreduce for them) and ``[every Q]``. Matrices of the same
``(rows, cols, r')`` sit next to each other in both, so their P's form one ``(k, rows, r')``
block that a single batched QR orthonormalises.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

from commfuse.compress.layout import check_shapes


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """One compressed tensor: its slice of the bucket, viewed as ``rows x cols``."""

    offset: int
    """First element of the tensor in the bucket."""
    rows: int
    cols: int
    index: int
    """Position of the tensor in the bucket's layout."""


@dataclasses.dataclass(frozen=True)
class _MatrixGroup:
    """Compressed tensors of one shape and rank: contiguous ``(k, rows, rank)`` P's and
    ``(k, cols, rank)`` Q's in the messages."""

    rows: int
    cols: int
    rank: int
    members: tuple[_Matrix, ...]
    p_offset: int
    """Start of this group's P's in the P part of the first message."""
    q_offset: int
    """Start of this group's Q's in the second message."""

    @property
    def p_numel(self) -> int:
        return len(self.members) * self.rows * self.rank

    @property
    def q_numel(self) -> int:
        return len(self.members) * self.cols * self.rank


@dataclasses.dataclass(frozen=True)
class Plan:
    """The per-tensor plan of one bucket (see the module docstring)."""

    shapes: tuple[torch.Size, ...]
    numel: int
    """Elements of the bucket (the sum over its tensors)."""
    plain: tuple[tuple[int, int], ...]
    """``(offset, length)`` runs of elements sent uncompressed (adjacent tensors merged)."""
    groups: tuple[_MatrixGroup, ...]

    @property
    def plain_numel(self) -> int:
        return sum(length for _, length in self.plain)

    @property
    def p_numel(self) -> int:
        return sum(g.p_numel for g in self.groups)

    @property
    def q_numel(self) -> int:
        return sum(g.q_numel for g in self.groups)

    def message_numel(self) -> int:
        """Elements this rank sends per compressed step: plain + P's, then Q's."""
        return self.plain_numel + self.p_numel + self.q_numel

    def pack_plain(self, flat: torch.Tensor, message: torch.Tensor) -> None:
        """Copy the plain elements of the bucket ``flat`` to the front of ``message``."""
        at = 0
        for offset, length in self.plain:
            message[at : at + length] = flat[offset : offset + length]
            at += length

    def unpack_plain(self, message: torch.Tensor, flat: torch.Tensor) -> None:
        """Copy the front of ``message`` back to the plain elements' places in ``flat``."""
        at = 0
        for offset, length in self.plain:
            flat[offset : offset + length] = message[at : at + length]
            at += length

    def factor_slices(self, factor: Literal["p", "q"]) -> dict[int, tuple[int, int, _MatrixGroup]]:
        """Where each compressed tensor's factor sits in the P part of the first message
        (``"p"``, ``rows x rank``) or in the second message (``"q"``, ``cols x rank``): tensor
        index -> (start, numel, its group)."""
        out = {}
        for g in self.groups:
            size = (g.rows if factor == "p" else g.cols) * g.rank
            start = g.p_offset if factor == "p" else g.q_offset
            for j, m in enumerate(g.members):
                out[m.index] = (start + j * size, size, g)
        return out

    def zero_plain(self, flat: torch.Tensor) -> None:
        """Zero the plain elements of ``flat`` (a residual: they were sent exactly)."""
        for offset, length in self.plain:
            flat[offset : offset + length] = 0


def plan_for(shapes: Sequence[torch.Size], rank: int) -> Plan:
    """Plan a bucket holding tensors of ``shapes`` (in order) for rank-``rank`` PowerSGD."""
    shapes = check_shapes(shapes)
    plain: list[list[int]] = []
    by_shape: dict[tuple[int, int, int], list[_Matrix]] = {}
    offset = 0
    for index, shape in enumerate(shapes):
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        r = min(rank, rows, cols)
        if len(shape) >= 2 and numel > 0 and (rows + cols) * r < numel:
            by_shape.setdefault((rows, cols, r), []).append(_Matrix(offset, rows, cols, index))
        elif numel > 0:
            if plain and plain[-1][0] + plain[-1][1] == offset:
                plain[-1][1] += numel  # adjacent plain tensors: one copy, not two
            else:
                plain.append([offset, numel])
        offset += numel
    groups = []
    p_offset = q_offset = 0
    for (rows, cols, r), members in by_shape.items():
        group = _MatrixGroup(rows, cols, r, tuple(members), p_offset, q_offset)
        groups.append(group)
        p_offset += group.p_numel
        q_offset += group.q_numel
    return Plan(
        shapes=shapes,
        numel=offset,
        plain=tuple((o, n) for o, n in plain),
        groups=tuple(groups),
    )
