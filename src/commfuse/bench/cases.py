"""What a benchmark times: ``Case``, one timed form of a benchmark row (an algorithm, the fused or
the unfused operator, a training step), and the cases of the collectives benchmark: inputs, the
call, the exact expected result, and the nccl-tests size and bus-bandwidth conventions.

Every benchmark that compares variants builds one ``Case`` per variant and times them in the
balanced orders of ``bench/schedule.py``.

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

__all__ = ["Case", "bus_factor", "element_count", "make_case"]


def _nothing() -> None:
    return None


def _unchecked() -> int:
    return 0


_MODULUS = 11


def pattern(
    numel: int, rank: int, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    ints = torch.arange(numel, dtype=torch.int64, device=device or torch.device("cpu"))
    return ((ints + rank) % _MODULUS).to(dtype)


@dataclasses.dataclass(kw_only=True)
class Case:
    """One timed form of a benchmark row on one rank, ready to run repeatedly."""

    name: str
    """What it is (the op, the variant)."""
    call: Callable[[], object]
    """The timed work."""
    reset: Callable[[], object] = _nothing
    """Restore the inputs (in-place work overwrites them); not timed."""
    count_wrong: Callable[[], int] = _unchecked
    """Elements of this rank's last result that differ from the reference (0 where the
    benchmark checks results another way)."""
    size_bytes: int = 0
    """The bytes the row is named by (nccl-tests' S for a collective: module docstring)."""


def element_count(op: str, size_bytes: int, world: int, element_size: int) -> int:
    """Elements per rank buffer for a requested S, rounded down so blocks split evenly."""
    numel = size_bytes // element_size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel -= numel % world
    return max(numel, world if op in ("all_gather", "reduce_scatter", "all_to_all") else 1)


def make_case(
    comm: Communicator,
    op: str,
    size_bytes: int,
    dtype: torch.dtype = torch.float32,
    algo: str = "native",
) -> Case:
    """The case of ``op`` at ``size_bytes``, run by algorithm ``algo`` (a name, or auto)."""
    rank, world, dev = comm.rank, comm.world_size, comm.device
    esize = torch.empty(0, dtype=dtype, device=dev).element_size()
    numel = element_count(op, size_bytes, world, esize)
    total = (
        sum(pattern(numel, r, torch.int64, dev) for r in range(world))
        if op in ("all_reduce", "reduce", "reduce_scatter")
        else None
    )

    if op in ("all_reduce", "broadcast", "reduce"):
        source = pattern(numel, rank, dtype, dev)
        buf = source.clone()
        root = 0
        if op == "all_reduce":
            expected = total.to(dtype)  # type: ignore[union-attr]

            def call() -> None:
                C.all_reduce(comm, buf, "sum", algo=algo)
        elif op == "broadcast":
            expected = pattern(numel, root, dtype, dev)

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

        return Case(
            name=op, call=call, reset=reset, count_wrong=count_wrong, size_bytes=numel * esize
        )

    block = numel // world
    if op == "all_gather":
        mine = pattern(block, rank, dtype, dev)
        out = torch.empty(numel, dtype=dtype, device=dev)
        expected = torch.cat([pattern(block, r, dtype, dev) for r in range(world)])
        return Case(
            name=op,
            size_bytes=numel * esize,
            reset=lambda: out.zero_(),
            call=lambda: C.all_gather(comm, out, mine, algo=algo),
            count_wrong=lambda: int((out != expected).sum()),
        )
    if op == "reduce_scatter":
        full = pattern(numel, rank, dtype, dev)
        piece = torch.empty(block, dtype=dtype, device=dev)
        expected = total[rank * block : (rank + 1) * block].to(dtype)  # type: ignore[index]
        return Case(
            name=op,
            size_bytes=numel * esize,
            reset=lambda: piece.zero_(),
            call=lambda: C.reduce_scatter(comm, piece, full, "sum", algo=algo),
            count_wrong=lambda: int((piece != expected).sum()),
        )
    if op == "all_to_all":
        # Block j of rank r's input is pattern(block, 1000 r + j): every block is distinguishable.
        send = torch.cat([pattern(block, 7 * rank + j, dtype, dev) for j in range(world)])
        recv = torch.empty(numel, dtype=dtype, device=dev)
        expected = torch.cat([pattern(block, 7 * i + rank, dtype, dev) for i in range(world)])
        return Case(
            name=op,
            size_bytes=numel * esize,
            reset=lambda: recv.zero_(),
            call=lambda: C.all_to_all(comm, recv, send, algo=algo),
            count_wrong=lambda: int((recv != expected).sum()),
        )
    raise ValueError(f"unknown op {op!r}: use one of {', '.join(COLLECTIVES)}")
