"""Ring, recursive doubling/halving and Rabenseifner through the front door: exact results over
a grid (world sizes, dtypes, ops, sizes) and the exact bytes and messages each rank sent.

Inputs are small integers (sums within +-55, products of {1, 2, -1} within 2^8), so every
dtype, float16 and bfloat16 included, represents every partial result exactly and results are
compared bitwise; ``avg`` is the exact sum divided in the dtype, as ``finish_`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from commfuse.collectives import all_gather, all_reduce, reduce_scatter
from commfuse.collectives.blocks import even_blocks
from commfuse.collectives.registry import label
from commfuse.collectives.ring import default_num_segments
from commfuse.comm import Communicator, ReduceOpName
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
WORLDS = [2, 3, 4, 5, 8]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS: list[ReduceOpName] = ["sum", "avg", "max", "min", "prod"]
ALL_REDUCE = ["ring", "doubling", "rabenseifner"]
Counts = tuple[int, int, int, int]  # bytes_sent, messages_sent, bytes_recv, messages_recv

# ---- expected traffic: the algorithms' formulas, per rank, in elements -----------------------


def _lg(p: int) -> int:
    return p.bit_length() - 1


def _group(sizes: list[int], i: int, d: int) -> int:
    """Elements of the d-aligned group of d blocks that holds block i."""
    base = i & ~(d - 1)
    return sum(sizes[base : base + d])


def _halving_counts(sizes: list[int], i: int) -> Counts:
    """Recursive halving over P' = len(sizes) blocks, for new rank i: at distance d it sends the
    partner's d-group and receives its own; the sent groups tile everything but block i."""
    dists = [1 << k for k in range(_lg(len(sizes)))]
    sent = [_group(sizes, i ^ d, d) for d in dists]
    got = [_group(sizes, i, d) for d in dists]
    assert sum(sent) == sum(sizes) - sizes[i]
    return sum(sent), sum(map(bool, sent)), sum(got), sum(map(bool, got))


def _fold(rank: int, world: int) -> tuple[int, int, int | None]:
    """(P', rem, new rank or None for a rank that idles)."""
    pof2 = 1 << _lg(world)
    rem = world - pof2
    if rank >= 2 * rem:
        return pof2, rem, rank - rem
    return pof2, rem, rank // 2 if rank % 2 else None


def _plus(a: Counts, b: Counts) -> Counts:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def _msg(n: int) -> Counts:
    """One message of n elements each way (none if empty)."""
    return (n, int(n > 0), n, int(n > 0))


def expected_all_reduce(name: str, rank: int, world: int, n: int, segments: int) -> Counts:
    if name == "ring":
        # Sends every block but r+1 (reduce-scatter) and every block but r+2 (allgather);
        # receives every block but r, then every block but r+1. A block of b elements is
        # min(b, segments) messages (empty segments send nothing).
        b = [stop - start for start, stop in even_blocks(n, world)]
        sent = [b[(rank - s) % world] for s in range(world - 1)]
        sent += [b[(rank + 1 - s) % world] for s in range(world - 1)]
        got = [b[(rank - s - 1) % world] for s in range(world - 1)]
        got += [b[(rank - s) % world] for s in range(world - 1)]
        assert sum(sent) == 2 * n - b[(rank + 1) % world] - b[(rank + 2) % world]
        messages = [min(x, segments) for x in sent]
        return sum(sent), sum(messages), sum(got), sum(min(x, segments) for x in got)
    pof2, _, new = _fold(rank, world)
    folded = rank < 2 * (world - pof2)
    edge = _msg(n) if folded else (0, 0, 0, 0)  # fold in + result back: one each way
    if new is None:
        return edge
    if name == "doubling":  # lg P' exchanges of the whole buffer
        return _plus(edge, (n * _lg(pof2), _lg(pof2) * (n > 0), n * _lg(pof2), _lg(pof2) * (n > 0)))
    assert name == "rabenseifner"  # halving, then the same exchanges reversed (doubling)
    sizes = [stop - start for start, stop in even_blocks(n, pof2)]
    half = _halving_counts(sizes, new)
    return _plus(edge, _plus(half, (half[2], half[3], half[0], half[1])))


def expected_reduce_scatter(name: str, rank: int, world: int, m: int, segments: int) -> Counts:
    if name == "ring":  # P - 1 blocks of m each way
        return (
            (world - 1) * m,
            (world - 1) * min(m, segments),
            (world - 1) * m,
            (world - 1) * min(m, segments),
        )
    assert name == "halving"
    pof2, rem, new = _fold(rank, world)
    if new is None:  # sends its whole input, gets its block back
        return (world * m, 1, m, 1)
    sizes = [2 * m if i < rem else m for i in range(pof2)]
    counts = _halving_counts(sizes, new)
    if rank < 2 * rem:  # got the partner's input, returns the partner's block
        counts = _plus(counts, (m, 1, world * m, 1))
    return counts


def expected_all_gather(name: str, world: int, m: int, segments: int) -> Counts:
    # Both send exactly P - 1 blocks: the ring one per step, doubling/Bruck ceil(lg P) ranges.
    messages = (world - 1) * min(m, segments) if name == "ring" else (world - 1).bit_length()
    return ((world - 1) * m, messages, (world - 1) * m, messages)


# ---- rank functions -------------------------------------------------------------------------


def make_input(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    if op == "prod":
        values = torch.tensor([1, 2, -1, 1, 1])[(i + 3 * rank) % 5]
    else:
        values = (i * 7 + rank * 13) % 11 - 5
    return values.to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.double() for t in inputs])
    if op in ("sum", "avg"):
        out = stacked.sum(0).to(inputs[0].dtype)
        return out.div_(len(inputs)) if op == "avg" else out
    if op == "prod":
        return stacked.prod(0).to(inputs[0].dtype)
    return (stacked.max(0) if op == "max" else stacked.min(0)).values.to(inputs[0].dtype)


def _counts(comm: Communicator, kind: str) -> Counts:
    c = comm.stats[kind]
    return (c.bytes_sent, c.messages_sent, c.bytes_recv, c.messages_recv)


def _in_bytes(counts: Counts, element_size: int) -> Counts:
    return (counts[0] * element_size, counts[1], counts[2] * element_size, counts[3])


def _ops(dtype: torch.dtype) -> list[ReduceOpName]:
    return OPS if dtype.is_floating_point else [op for op in OPS if op != "avg"]


def all_reduce_grid(
    names: list[str], sizes: list[int], segments: int | None, dtypes: list[torch.dtype] = DTYPES
) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    for name in names:
        for dtype in dtypes:
            for op in _ops(dtype):
                for n in sizes:
                    where = f"rank {rank} all_reduce.{name} {dtype} {op} n={n} seg={segments}"
                    t = make_input(rank, n, dtype, op)
                    comm.stats.reset()
                    opts: dict[str, Any] = {} if segments is None else {"num_segments": segments}
                    all_reduce(comm, t, op, algo=name, **opts)
                    want = reference([make_input(r, n, dtype, op) for r in range(world)], op)
                    if not torch.equal(t, want):
                        failures.append(f"{where}: wrong result")
                    seg = segments or default_num_segments(-(-n // world) * t.element_size())
                    counts = expected_all_reduce(name, rank, world, n, seg)
                    got, want_counts = (
                        _counts(comm, label("all_reduce", name)),
                        _in_bytes(counts, t.element_size()),
                    )
                    if got != want_counts:
                        failures.append(f"{where}: sent/recv {got}, formula {want_counts}")
    return failures


def scatter_gather_grid(
    sizes: list[int], segments: int | None, dtypes: list[torch.dtype] = DTYPES
) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    for dtype in dtypes:
        for m in sizes:
            seg = segments or default_num_segments(m * torch.empty(0, dtype=dtype).element_size())
            opts: dict[str, Any] = {} if segments is None else {"num_segments": segments}
            for op in _ops(dtype):
                for name in ("ring", "halving"):
                    where = f"rank {rank} reduce_scatter.{name} {dtype} {op} m={m}"
                    inp = make_input(rank, world * m, dtype, op)
                    keep = inp.clone()
                    out = torch.empty(m, dtype=dtype)
                    comm.stats.reset()
                    reduce_scatter(comm, out, inp, op, algo=name, **opts)
                    full = reference(
                        [make_input(r, world * m, dtype, op) for r in range(world)], op
                    )
                    if not torch.equal(out, full[rank * m : (rank + 1) * m]):
                        failures.append(f"{where}: wrong result")
                    if not torch.equal(inp, keep):
                        failures.append(f"{where}: input modified")
                    counts = expected_reduce_scatter(name, rank, world, m, seg)
                    got = _counts(comm, label("reduce_scatter", name))
                    want_counts = _in_bytes(counts, inp.element_size())
                    if got != want_counts:
                        failures.append(f"{where}: sent/recv {got}, formula {want_counts}")
            for name in ("ring", "doubling"):
                where = f"rank {rank} all_gather.{name} {dtype} m={m}"
                inp = make_input(rank, m, dtype, "sum")
                out = torch.empty(world * m, dtype=dtype)
                comm.stats.reset()
                all_gather(comm, out, inp, algo=name, **opts)
                want = torch.cat([make_input(r, m, dtype, "sum") for r in range(world)])
                if not torch.equal(out, want):
                    failures.append(f"{where}: wrong result")
                counts = _in_bytes(expected_all_gather(name, world, m, seg), inp.element_size())
                got = _counts(comm, label("all_gather", name))
                if got != counts:
                    failures.append(f"{where}: sent/recv {got}, formula {counts}")
    return failures


def large_and_async(n: int) -> list[str]:
    """1<<18 floats through every algorithm, issued asynchronously with Python compute in
    between; plus the closed forms of the power-of-two, divisible case."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    want = reference([make_input(r, n, torch.float32, "sum") for r in range(world)], "sum")
    tensors = {name: make_input(rank, n, torch.float32, "sum") for name in ALL_REDUCE}
    comm.stats.reset()
    handles = [all_reduce(comm, t, "sum", algo=name, async_op=True) for name, t in tensors.items()]
    busy = sum(i * i for i in range(200_000))  # Python work overlapping the collectives
    for handle in handles:
        assert handle is not None
        handle.wait()
    for name, t in tensors.items():
        if not torch.equal(t, want) or busy <= 0:
            failures.append(f"rank {rank} async all_reduce.{name} n={n}: wrong result")
        sent = comm.stats[label("all_reduce", name)]
        if world & (world - 1) == 0 and n % world == 0 and name != "doubling":
            # Ring and Rabenseifner: 2 (P-1)/P n bytes; ring in 2(P-1) steps, Rabenseifner 2 lg P.
            steps = 2 * (world - 1) * default_num_segments(4 * n // world)
            steps = steps if name == "ring" else 2 * _lg(world)
            if (sent.bytes_sent, sent.messages_sent) != (2 * (world - 1) * n // world * 4, steps):
                failures.append(f"rank {rank} {name}: {sent} breaks the closed form")
    m = n // world
    out = torch.empty(m)
    handle = reduce_scatter(comm, out, want[: world * m].clone(), "max", algo="ring", async_op=True)
    gathered = torch.empty(world * m)
    handle2 = all_gather(comm, gathered, out, algo="doubling", async_op=True)
    assert handle is not None and handle2 is not None
    handle.wait()
    handle2.wait()
    if not torch.equal(gathered, want[: world * m]):
        failures.append(f"rank {rank} async reduce_scatter+all_gather: wrong result")
    return failures


def bad_segments() -> str:
    comm = Communicator()
    try:
        all_reduce(comm, torch.ones(8), algo="ring", num_segments=0)
    except ValueError as err:
        return str(err)
    return "no error"


# ---- tests ----------------------------------------------------------------------------------


def _check(results: list[list[str]]) -> None:
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures, first: " + "\n".join(failures[:8])


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_exact_with_exact_traffic(pool: PoolFn, world: int) -> None:
    # 1; numel < P (empty blocks); 1001 divides by no world size here (the divisible case is in
    # test_large_async, 1 << 18 elements).
    sizes = sorted({1, world - 1, 1001})
    _check(pool(world).run(all_reduce_grid, ALL_REDUCE, sizes, None, timeout_s=120))


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_all_gather_exact_with_exact_traffic(pool: PoolFn, world: int) -> None:
    _check(pool(world).run(scatter_gather_grid, [1, 3, 125], None, timeout_s=120))


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 8])
def test_ring_segments_option(pool: PoolFn, world: int) -> None:
    # 3 segments of uneven blocks; 64 segments of blocks of 1-2 elements (mostly empty segments).
    dtypes = [torch.float32, torch.bfloat16, torch.int32]
    _check(pool(world).run(all_reduce_grid, ["ring"], [world + 1, 1001], 3, dtypes, timeout_s=120))
    _check(pool(world).run(all_reduce_grid, ["ring"], [2 * world - 1], 64, dtypes, timeout_s=120))
    _check(pool(world).run(scatter_gather_grid, [2, 77], 5, dtypes, timeout_s=120))


@pytest.mark.parametrize("world", WORLDS)
def test_large_async(pool: PoolFn, world: int) -> None:
    _check(pool(world).run(large_and_async, 1 << 18, timeout_s=120))


def test_bad_num_segments_is_a_value_error(pool: PoolFn) -> None:
    for message in pool(2).run(bad_segments):
        assert "num_segments must be >= 1" in message


def test_default_segments_grow_with_size() -> None:
    assert default_num_segments(1) == 1
    assert default_num_segments(128 << 10) == 1
    assert default_num_segments((128 << 10) + 1) == 2
    assert default_num_segments(16 << 20) == 128
    assert default_num_segments(1 << 40) == 1024
