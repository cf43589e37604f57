"""Element-wise reductions used by every algorithm built on point-to-point messages.

An algorithm receives a peer's contribution into a scratch buffer and folds it into its own with
``combine_``. ``avg`` is a sum during the algorithm and a division at the end (``finish_``), so
every algorithm computes it identically to the native path. Integer ``avg`` is refused: it would
silently truncate.
"""

from __future__ import annotations

import torch

from commfuse.comm import ReduceOpName

OPS: tuple[ReduceOpName, ...] = ("sum", "avg", "prod", "max", "min")


def check_op(op: str, dtype: torch.dtype) -> None:
    """ValueError for an unknown op or an op the dtype cannot do exactly."""
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}: use one of {', '.join(OPS)}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(
            f"op='avg' needs a floating-point tensor, got {dtype}; use op='sum' and divide"
        )


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOpName) -> None:
    """``acc = acc (op) other`` in place."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "prod":
        acc.mul_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        raise ValueError(f"unknown reduce op {op!r}: use one of {', '.join(OPS)}")


def finish_(tensor: torch.Tensor, op: ReduceOpName, world_size: int) -> None:
    """The last step of a reduction: divide for ``avg``; nothing for the others."""
    if op == "avg" and world_size > 1:
        tensor.div_(world_size)


def reference_reduce(tensors: list[torch.Tensor], op: ReduceOpName) -> torch.Tensor:
    """The exact answer, for tests: fold in rank order, like a sequential reduction."""
    acc = tensors[0].clone()
    for other in tensors[1:]:
        combine_(acc, other, op)
    finish_(acc, op, len(tensors))
    return acc
