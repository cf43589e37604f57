"""The backend's own collectives as first-class algorithms (gloo: ring all-reduce, binomial-tree
broadcast, all-reduce-then-slice reduce-scatter; NCCL: its tuned rings and trees).

Beating the native algorithm is the point of the other families, so it is always measured
beside them, with the same front door, validation and accounting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from commfuse.collectives.registry import register
from commfuse.comm import Communicator, ReduceOpName


@register("all_reduce", "native")
def _native_all_reduce(comm: Communicator, buf: torch.Tensor, op: ReduceOpName, **_: Any) -> None:
    comm.all_reduce(buf, op)


@register("broadcast", "native")
def _native_broadcast(comm: Communicator, buf: torch.Tensor, root: int, **_: Any) -> None:
    comm.broadcast(buf, root)


@register("reduce", "native")
def _native_reduce(
    comm: Communicator, buf: torch.Tensor, root: int, op: ReduceOpName, **_: Any
) -> None:
    # The backend may overwrite non-root buffers; reduce a copy there to keep them unchanged.
    target = buf if comm.rank == root else buf.clone()
    comm.reduce(target, root, op)


@register("all_gather", "native")
def _native_all_gather(comm: Communicator, out: torch.Tensor, inp: torch.Tensor, **_: Any) -> None:
    comm.all_gather(out, inp)


@register("reduce_scatter", "native")
def _native_reduce_scatter(
    comm: Communicator, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName, **_: Any
) -> None:
    comm.reduce_scatter(out, inp, op)


@register("all_to_all", "native")
def _native_all_to_all(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    **_: Any,
) -> None:
    comm.all_to_all(out, inp, out_splits, in_splits)
