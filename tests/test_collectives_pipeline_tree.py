"""Linear pipeline and binomial tree through the front door: exact results over a grid (world
sizes, dtypes, ops, sizes, roots), the async form, and the exact bytes and messages per rank.

Inputs are small integers (sums within +-40, products of {1, -1, 2, -2} within 2^8), so every
dtype, float16 and bfloat16 included, holds every partial result exactly and results compare
bitwise; ``avg`` is the exact sum divided in the dtype, as ``finish_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from commfuse.collectives import all_reduce, broadcast, reduce
from commfuse.collectives.cost import LinkCost, lp_best_block_bytes
from commfuse.collectives.pipeline import pipeline_link
from commfuse.collectives.reduce_ops import reference_reduce
from commfuse.collectives.registry import label
from commfuse.comm import Communicator, ReduceOpName
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

WORLDS = [2, 3, 4, 5, 8]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS: list[ReduceOpName] = ["sum", "avg", "max", "min", "prod"]
ODD_BLOCK_BYTES = 388  # 97 float32 elements: no size in the grid divides evenly
Counts = tuple[int, int, int, int]  # bytes_sent, messages_sent, bytes_recv, messages_recv


def rank_input(rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    i = torch.arange(numel)
    if op == "prod":  # powers of two: every product is exact in every dtype
        return torch.tensor([1, -1, 2, -2])[(3 * i + rank) % 4].to(dtype)
    return ((7 * i + 3 * rank) % 11 - 5).to(dtype)


def _cases() -> list[tuple[torch.dtype, ReduceOpName, int]]:
    return [
        (dtype, op, numel)
        for dtype in DTYPES
        for op in OPS
        for numel in (1, 1001)
        if dtype.is_floating_point or op != "avg"
    ]


# ---- rank functions ------------------------------------------------------------------------


def check_grid() -> list[str]:
    """Every algorithm of the two families against the exact reference; returns failures."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    bad: list[str] = []
    for index, (dtype, op, numel) in enumerate(_cases()):
        everyone = [rank_input(r, numel, dtype, op) for r in range(world)]
        expected = reference_reduce(everyone, op)
        where = f"{dtype} {op} n={numel}"
        t = everyone[rank].clone()
        all_reduce(comm, t, op, algo="pipeline", block_bytes=ODD_BLOCK_BYTES)
        if not torch.equal(t, expected):
            bad.append(f"all_reduce.pipeline {where}")
        for algo in ("pipeline", "tree"):
            root = (index + len(algo)) % world
            t = everyone[rank].clone()
            reduce(comm, t, root, op, algo=algo, block_bytes=ODD_BLOCK_BYTES)
            if not torch.equal(t, expected if rank == root else everyone[rank]):
                bad.append(f"reduce.{algo} root={root} {where}")
            if op == "sum":
                t = everyone[rank].clone()
                broadcast(comm, t, root, algo=algo, block_bytes=ODD_BLOCK_BYTES)
                if not torch.equal(t, everyone[root]):
                    bad.append(f"broadcast.{algo} root={root} {where}")
    # One larger message, with explicit and with default block sizes.
    big = [rank_input(r, 1 << 18, torch.float32, "sum") for r in range(world)]
    total = reference_reduce(big, "sum")
    for block_bytes in (1 << 16, None):
        t = big[rank].clone()
        all_reduce(comm, t, "sum", algo="pipeline", block_bytes=block_bytes)
        bad += [] if torch.equal(t, total) else [f"all_reduce.pipeline big b={block_bytes}"]
        for algo in ("pipeline", "tree"):
            t = big[rank].clone()
            broadcast(comm, t, world - 1, algo=algo, block_bytes=block_bytes)
            bad += [] if torch.equal(t, big[-1]) else [f"broadcast.{algo} big b={block_bytes}"]
            t = big[rank].clone()
            reduce(comm, t, 1, "sum", algo=algo, block_bytes=block_bytes)
            ok = torch.equal(t, total if rank == 1 else big[rank])
            bad += [] if ok else [f"reduce.{algo} big b={block_bytes}"]
    return [f"rank {rank}: {b}" for b in bad]


def count_traffic(numel: int, block_bytes: int | None) -> tuple[dict[str, Counts], LinkCost]:
    """Counters of one call of each algorithm (float32, roots 0 and world - 1), and the link
    cost the rank's environment gives the default block size."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    out: dict[str, Counts] = {}
    calls: list[tuple[str, str, int]] = [("all_reduce", "pipeline", 0)]
    calls += [
        (c, a, root)
        for c in ("broadcast", "reduce")
        for a in ("pipeline", "tree")
        for root in sorted({0, world - 1})
    ]
    for collective, algo, root in calls:
        t = torch.full((numel,), float(rank))
        comm.stats.reset()
        if collective == "all_reduce":
            all_reduce(comm, t, "sum", algo=algo, block_bytes=block_bytes)
        elif collective == "broadcast":
            broadcast(comm, t, root, algo=algo, block_bytes=block_bytes)
        else:
            reduce(comm, t, root, "sum", algo=algo, block_bytes=block_bytes)
        c = comm.stats[label(collective, algo)]
        assert c.calls == c.messages_sent + c.messages_recv, (collective, algo, c)
        out[f"{collective}.{algo}.{root}"] = (
            c.bytes_sent,
            c.messages_sent,
            c.bytes_recv,
            c.messages_recv,
        )
    return out, pipeline_link(comm.config.link_mbit)


def check_async() -> list[str]:
    """``async_op=True``, Python compute while the collective runs, then ``wait()``."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    everyone = [rank_input(r, 5003, torch.float32, "sum") for r in range(world)]
    total = reference_reduce(everyone, "sum")
    a, b, c = (everyone[rank].clone() for _ in range(3))
    handles = [
        all_reduce(comm, a, "avg", algo="pipeline", block_bytes=1000, async_op=True),
        broadcast(comm, b, world - 1, algo="tree", async_op=True),
        reduce(comm, c, world - 1, "sum", algo="pipeline", block_bytes=1000, async_op=True),
    ]
    busy = sum(i * i for i in range(200_000))  # the caller's own work, overlapping
    for handle in handles:
        assert handle is not None
        handle.wait()
    bad = [] if busy else ["compute"]
    bad += [] if torch.equal(a, total / world) else ["all_reduce avg"]
    bad += [] if torch.equal(b, everyone[-1]) else ["broadcast"]
    bad += [] if torch.equal(c, total if rank == world - 1 else everyone[rank]) else ["reduce"]
    # A synchronous call after async ones runs after them (the front door drains the queue).
    t = everyone[rank].clone()
    handle = all_reduce(comm, t, "max", algo="pipeline", async_op=True)
    broadcast(comm, t, 0, algo="pipeline")
    bad += [] if torch.equal(t, reference_reduce(everyone, "max")) else ["async then sync"]
    return [f"rank {rank}: {b}" for b in bad]


def bad_block_bytes() -> list[str]:
    comm = Communicator()
    errors = []
    for value in (0, -4, 2.5, "64k"):
        try:
            all_reduce(comm, torch.ones(10), "sum", algo="pipeline", block_bytes=value)
        except ValueError as err:
            errors.append(str(err))
    return errors


# ---- expected traffic: per-rank formulas ------------------------------------------------------


def lp_counts(collective: str, rank: int, world: int, root: int, n: int, k: int) -> Counts:
    """LP: position p = rank - root along the chain. Broadcast: every rank but the last sends n
    bytes in k messages, every rank but the root receives them. Reduce: the reverse. Allreduce
    (head 0): n bytes in k messages over each direction of each chain link a rank touches."""
    pos = (rank - root) % world
    first, last = pos == 0, pos == world - 1
    if collective == "broadcast":
        sends, recvs = int(not last), int(not first)
    elif collective == "reduce":
        sends, recvs = int(not first), int(not last)
    else:
        sends = recvs = int(not first) + int(not last)
    return sends * n, sends * k, recvs * n, recvs * k


def tree_num_children(vrank: int, world: int) -> int:
    """Binomial tree: children vrank + 2^j for 2^j below vrank's lowest set bit (any 2^j < P for
    the root), inside the world."""
    limit = vrank & -vrank if vrank else world
    return sum(1 for j in range(world.bit_length()) if 1 << j < limit and vrank + (1 << j) < world)


def tree_counts(collective: str, rank: int, world: int, root: int, n: int) -> Counts:
    """Tree broadcast: n bytes to each child, n from the parent. Reduce: the reverse."""
    vrank = (rank - root) % world
    children, parent = tree_num_children(vrank, world), int(vrank > 0)
    down, up = (children, parent) if collective == "broadcast" else (parent, children)
    return down * n, down, up * n, up


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_results_match_exact_reference(pool: PoolFn, world: int) -> None:
    failures = [f for per_rank in pool(world).run(check_grid, timeout_s=180) for f in per_rank]
    assert failures == []


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel,block_bytes", [(1, 4), (1001, 400), (100_003, None)])
def test_bytes_and_messages_match_formulas(
    pool: PoolFn, world: int, numel: int, block_bytes: int | None
) -> None:
    n = 4 * numel
    assert tree_num_children(0, world) == math.ceil(math.log2(world))
    assert sum(tree_num_children(v, world) for v in range(world)) == world - 1
    per_rank = pool(world).run(count_traffic, numel, block_bytes)
    for rank, (got, link) in enumerate(per_rank):
        for key, counts in got.items():
            collective, algo, root = key.split(".")
            if algo == "tree":
                expected = tree_counts(collective, rank, world, int(root), n)
            else:
                depth = world - 1 if collective != "all_reduce" else 2 * (world - 1)
                b = block_bytes or lp_best_block_bytes(n, depth + 1, link)
                k = math.ceil(numel / max(1, b // 4))
                expected = lp_counts(collective, rank, world, int(root), n, k)
            assert counts == expected, f"rank {rank} {key}: got {counts}, formula {expected}"


@pytest.mark.parametrize("world", [3, 4])
def test_async_form_overlaps_and_keeps_order(pool: PoolFn, world: int) -> None:
    failures = [f for per_rank in pool(world).run(check_async) for f in per_rank]
    assert failures == []


def test_bad_block_bytes_is_a_value_error(pool: PoolFn) -> None:
    errors = pool(2).run(bad_block_bytes)[0]
    assert len(errors) == 4 and all("block_bytes must be a positive int" in e for e in errors)
