"""Pairwise-exchange all-to-all through the front door: exact results for uneven splits (zeros
included), rows of several elements, every dtype, and exactly the off-diagonal bytes sent."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from commfuse.cluster import RankError
from commfuse.collectives import all_to_all
from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
WORLDS = [2, 3, 4, 5, 8]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def split(src: int, dst: int, scale: int) -> int:
    """Rows rank src sends to rank dst: uneven, zero for some pairs (including src == dst)."""
    return scale * ((src + 2 * dst) % 3)


def block(src: int, dst: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What src sends dst: small integers that identify the pair, exact in every dtype."""
    values = (torch.arange(rows * width) % 17 + 20 * src + dst) % 200
    return values.to(dtype).reshape(rows, width)


def pairwise_grid(scales: list[int], widths: list[int], async_op: bool) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    tag = label("all_to_all", "pairwise")
    failures: list[str] = []
    for dtype in DTYPES:
        for scale in scales:
            for width in widths:
                where = f"rank {rank} pairwise {dtype} scale={scale} width={width}"
                in_splits = [split(rank, j, scale) for j in range(world)]
                out_splits = [split(i, rank, scale) for i in range(world)]
                inp = torch.cat([block(rank, j, in_splits[j], width, dtype) for j in range(world)])
                out = torch.full((sum(out_splits), width), -1, dtype=dtype)
                comm.stats.reset()
                handle = all_to_all(
                    comm, out, inp, out_splits, in_splits, algo="pairwise", async_op=async_op
                )
                if handle is not None:
                    handle.wait()
                want = torch.cat(
                    [block(i, rank, out_splits[i], width, dtype) for i in range(world)]
                )
                if not torch.equal(out, want):
                    failures.append(f"{where}: wrong result")
                # Only off-diagonal, non-empty blocks go on the wire, one message each.
                row_bytes = width * inp.element_size()
                sent = [in_splits[j] for j in range(world) if j != rank]
                got = [out_splits[i] for i in range(world) if i != rank]
                formula = (
                    sum(sent) * row_bytes,
                    sum(map(bool, sent)),
                    sum(got) * row_bytes,
                    sum(map(bool, got)),
                )
                c = comm.stats[tag]
                counted = (c.bytes_sent, c.messages_sent, c.bytes_recv, c.messages_recv)
                if counted != formula:
                    failures.append(f"{where}: sent/recv {counted}, formula {formula}")
    return failures


def equal_split_large(numel: int) -> list[str]:
    """Equal splits (no split lists given): every rank sends (P-1)/P of its buffer."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    per = numel // world
    inp = torch.cat([torch.full((per,), float(world * rank + j)) for j in range(world)])
    out = torch.empty_like(inp)
    all_to_all(comm, out, inp, algo="pairwise")
    want = torch.cat([torch.full((per,), float(world * i + rank)) for i in range(world)])
    c = comm.stats[label("all_to_all", "pairwise")]
    failures = [] if torch.equal(out, want) else [f"rank {rank}: wrong result"]
    if (c.bytes_sent, c.messages_sent) != ((world - 1) * per * 4, world - 1):
        failures.append(f"rank {rank}: sent {c.bytes_sent} bytes in {c.messages_sent} messages")
    return failures


@pytest.mark.parametrize("world", WORLDS)
def test_pairwise_all_to_all(pool: PoolFn, world: int) -> None:
    results = pool(world).run(pairwise_grid, [1, 5], [1, 3], False, timeout_s=120)
    results += pool(world).run(pairwise_grid, [7], [2], True, timeout_s=120)
    results += pool(world).run(equal_split_large, 1 << 18, timeout_s=120)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:8])


def a_rank_sends_nothing(algo: str) -> bool:
    """Rank 0 sends no rows (its input is [0, 3]) but receives; rows are 3 wide everywhere."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    in_splits = [0] * world if rank == 0 else [1] * world
    out_splits = [0 if i == 0 else 1 for i in range(world)]
    inp = torch.full((sum(in_splits), 3), float(rank))
    out = torch.full((sum(out_splits), 3), -1.0)
    all_to_all(comm, out, inp, out_splits, in_splits, algo=algo)
    want = torch.cat([torch.full((1, 3), float(i)) for i in range(1, world)])
    return torch.equal(out, want)


@pytest.mark.parametrize("algo", ["pairwise", "native", "auto"])
def test_a_rank_that_sends_no_rows(pool: PoolFn, algo: str) -> None:
    assert all(pool(3).run(a_rank_sends_nothing, algo, timeout_s=60))


def test_rows_of_different_widths_are_refused(pool: PoolFn) -> None:
    with pytest.raises(RankError, match="all_to_all rows differ"):
        pool(2).run(mismatched_rows, timeout_s=60)


def mismatched_rows() -> None:
    comm = Communicator()
    all_to_all(comm, torch.zeros(2, 4), torch.zeros(2, 3))
