"""Pairwise-exchange all-to-all (name ``"pairwise"``).

Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), section 4.6: the algorithm MPICH uses for long messages.

1. Copy the local block (``inp`` block r to ``out`` block r); it never touches the network.
2. For k = 1, ..., P - 1: send ``inp`` block ``(r + k) mod P`` to rank ``(r + k) mod P`` and
   receive ``out`` block ``(r - k) mod P`` from rank ``(r - k) mod P``, receive posted first.

In every step each rank sends exactly one message and receives exactly one, and the pairing is
a permutation, so no link or rank is oversubscribed (unlike posting all P - 1 sends at once,
which floods the first receivers). Cost ``(P - 1) alpha + ((P - 1)/P) n beta`` for n bytes per
rank in equal blocks; with uneven splits a rank sends the sum of its off-diagonal ``in_splits``.
Blocks of size zero send nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from commfuse.collectives.registry import label, register
from commfuse.comm import Communicator


def _offsets(splits: Sequence[int]) -> list[int]:
    return [0, *accumulate(splits)]


@register("all_to_all", "pairwise")
def pairwise_all_to_all(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    **_: Any,
) -> None:
    """P - 1 pairwise exchanges; splits are element counts per peer (the front door converts
    rows to elements)."""
    tag = label("all_to_all", "pairwise")
    rank, world = comm.rank, comm.world_size
    at_in, at_out = _offsets(in_splits), _offsets(out_splits)
    out[at_out[rank] : at_out[rank + 1]].copy_(inp[at_in[rank] : at_in[rank + 1]])
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        recv = comm.irecv(out[at_out[src] : at_out[src + 1]], src, label=tag)
        send = comm.isend(inp[at_in[dst] : at_in[dst + 1]], dst, label=tag)
        send.wait()
        recv.wait()
