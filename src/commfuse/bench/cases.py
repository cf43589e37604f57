"""One benchmark case per collective: inputs, the call, the exact expected result, and the
nccl-tests size and bus-bandwidth conventions.

Inputs are small integers (value = (index + rank) mod 11), so sums over up to thousands of ranks
are exact in float32 and a result can be compared element by element: the ``wrong`` column
counts elements that differ from the reference, as nccl-tests does.

Sizes follow nccl-tests: ``S`` is the buffer a rank holds for allreduce, broadcast and reduce,
and the full (world-sized) buffer for allgather, reduce-scatter and all-to-all. Then
``algbw = S / t`` and ``busbw = algbw * factor`` with factor 2(n-1)/n for allreduce,
(n-1)/n for allgather, reduce-scatter and all-to-all, 1 for broadcast and reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from commfuse import collectives as C
from commfuse.collectives.cost import bus_factor
from commfuse.collectives.registry import COLLECTIVES
from commfuse.comm import Communicator

__all__ = ["OPS", "Case", "bus_factor", "element_count", "make_case"]

OPS = COLLECTIVES
_MODULUS = 11


def pattern(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.int64) + rank) % _MODULUS).to(dtype)


@dataclasses.dataclass
class Case:
    """Buffers of one op at one size on one rank, ready to run repeatedly."""

    op: str
    size_bytes: int
    """nccl-tests' S for this op (see module docstring)."""
    reset: Callable[[], object]
    """Restore the input (in-place ops overwrite it); not timed."""
    call: Callable[[], object]
    """The timed collective."""
    count_wrong: Callable[[], int]
    """Elements of this rank's result that differ from the reference."""


def element_count(op: str, size_bytes: int, world: int, element_size: int) -> int:
    """Elements per rank buffer for a requested S, rounded down so blocks split evenly."""
    numel = size_bytes // element_size
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        numel -= numel % world
    return max(numel, world if op in ("allgather", "reduce_scatter", "all_to_all") else 1)


def make_case(
    comm: Communicator,
    op: str,
    size_bytes: int,
    dtype: torch.dtype = torch.float32,
    algo: str = "native",
) -> Case:
    """The case of ``op`` at ``size_bytes``, run by algorithm ``algo`` (a name, or auto)."""
    rank, world = comm.rank, comm.world_size
    esize = torch.tensor([], dtype=dtype).element_size()
    numel = element_count(op, size_bytes, world, esize)
    total = (
        sum(pattern(numel, r, torch.int64) for r in range(world))
        if op in ("allreduce", "reduce", "reduce_scatter")
        else None
    )

    if op in ("allreduce", "broadcast", "reduce"):
        source = pattern(numel, rank, dtype)
        buf = source.clone()
        root = 0
        if op == "allreduce":
            expected = total.to(dtype)  # type: ignore[union-attr]

            def call() -> None:
                C.allreduce(comm, buf, "sum", algo=algo)
        elif op == "broadcast":
            expected = pattern(numel, root, dtype)

            def call() -> None:
                C.broadcast(comm, buf, root, algo=algo)
        else:
            expected = total.to(dtype) if rank == root else buf  # type: ignore[union-attr]

            def call() -> None:
                C.reduce(comm, buf, root, "sum", algo=algo)

        def reset() -> None:
            buf.copy_(source)

        def count_wrong() -> int:
            if op == "reduce" and rank != root:
                return 0
            return int((buf != expected).sum())

        return Case(op, numel * esize, reset, call, count_wrong)

    block = numel // world
    if op == "allgather":
        mine = pattern(block, rank, dtype)
        out = torch.empty(numel, dtype=dtype)
        expected = torch.cat([pattern(block, r, dtype) for r in range(world)])
        return Case(
            op,
            numel * esize,
            lambda: out.zero_(),
            lambda: C.allgather(comm, out, mine, algo=algo),
            lambda: int((out != expected).sum()),
        )
    if op == "reduce_scatter":
        full = pattern(numel, rank, dtype)
        piece = torch.empty(block, dtype=dtype)
        expected = total[rank * block : (rank + 1) * block].to(dtype)  # type: ignore[index]
        return Case(
            op,
            numel * esize,
            lambda: piece.zero_(),
            lambda: C.reduce_scatter(comm, piece, full, "sum", algo=algo),
            lambda: int((piece != expected).sum()),
        )
    if op == "all_to_all":
        # Block j of rank r's input is pattern(block, 1000 r + j): every block is distinguishable.
        send = torch.cat([pattern(block, 7 * rank + j, dtype) for j in range(world)])
        recv = torch.empty(numel, dtype=dtype)
        expected = torch.cat([pattern(block, 7 * i + rank, dtype) for i in range(world)])
        return Case(
            op,
            numel * esize,
            lambda: recv.zero_(),
            lambda: C.all_to_all(comm, recv, send, algo=algo),
            lambda: int((recv != expected).sum()),
        )
    raise ValueError(f"unknown op {op!r}: use one of {', '.join(OPS)}")
