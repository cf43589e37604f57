"""The front door of every algorithm: edge sizes, in- and out-of-place, bad input, dead peers.

The family test files check each algorithm's maths and bytes over the full grid; this file
checks what every algorithm shares through ``commfuse.collectives``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import pytest
import torch

from commfuse import collectives as C
from commfuse.cluster import RankError
from commfuse.collectives.registry import algorithms_for, resolve
from commfuse.comm import CommConfig, CommError, Communicator, InconsistentInputError
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]


def every(collective: str) -> list[str]:
    return sorted(algorithms_for(collective))


def empty_and_single_element() -> dict[str, bool]:
    """Size 0 and size 1 through every algorithm of every collective."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    ok: dict[str, bool] = {}
    for algo in every("all_reduce"):
        empty = torch.zeros(0)
        C.all_reduce(comm, empty, algo=algo)
        one = torch.tensor([float(rank + 1)])
        C.all_reduce(comm, one, "sum", algo=algo)
        ok[f"all_reduce.{algo}"] = empty.numel() == 0 and one.item() == world * (world + 1) / 2
    for algo in every("broadcast"):
        one = torch.tensor([float(rank)])
        C.broadcast(comm, one, world - 1, algo=algo)
        C.broadcast(comm, torch.zeros(0), 0, algo=algo)
        ok[f"broadcast.{algo}"] = one.item() == world - 1
    for algo in every("reduce"):
        one = torch.tensor([float(rank + 1)])
        C.reduce(comm, one, 0, "max", algo=algo)
        ok[f"reduce.{algo}"] = one.item() == (world if rank == 0 else rank + 1)
    for algo in every("all_gather"):
        out = torch.zeros(world)
        C.all_gather(comm, out, torch.tensor([float(rank)]), algo=algo)
        C.all_gather(comm, torch.zeros(0), torch.zeros(0), algo=algo)
        ok[f"all_gather.{algo}"] = out.tolist() == [float(r) for r in range(world)]
    for algo in every("reduce_scatter"):
        out = torch.zeros(1)
        C.reduce_scatter(comm, out, torch.arange(world, dtype=torch.float32), "sum", algo=algo)
        C.reduce_scatter(comm, torch.zeros(0), torch.zeros(0), algo=algo)
        ok[f"reduce_scatter.{algo}"] = out.item() == rank * world
    for algo in every("all_to_all"):
        out = torch.zeros(world)
        C.all_to_all(comm, out, torch.full((world,), float(rank)), algo=algo)
        ok[f"all_to_all.{algo}"] = out.tolist() == [float(r) for r in range(world)]
    return ok


def out_of_place_leaves_input() -> dict[str, bool]:
    comm = Communicator()
    ok: dict[str, bool] = {}
    for algo in every("all_reduce"):
        src = torch.arange(10, dtype=torch.float64) + comm.rank
        keep = src.clone()
        out = torch.empty_like(src)
        C.all_reduce(comm, src, "sum", algo=algo, out=out)
        # cast: typeshed's sum() adds Literal[0] for an empty iterable; world_size >= 1 here
        expected = cast(
            torch.Tensor,
            sum(torch.arange(10, dtype=torch.float64) + r for r in range(comm.world_size)),
        )
        ok[algo] = torch.equal(src, keep) and torch.equal(out, expected)
    return ok


def async_then_sync_keeps_order(algo: str, validate: bool = False, rounds: int = 1) -> bool:
    """An async collective followed by a sync one (and compute between) on every rank; with
    ``validate``, each one's input check (a collective too) is ordered with them."""
    comm = Communicator(config=CommConfig(validate=validate, deadline_s=30))
    world, good = comm.world_size, True
    for _ in range(rounds):
        a = torch.ones(1 << 16) * comm.rank
        b = torch.ones(8) * (comm.rank + 1)
        handle = C.all_reduce(comm, a, "sum", algo=algo, async_op=True)
        busy = torch.randn(256, 256) @ torch.randn(256, 256)  # compute while it travels
        C.all_reduce(comm, b, "max", algo=algo)
        assert handle is not None
        handle.wait()
        good = good and (
            bool(busy.isfinite().all())
            and bool((a == world * (world - 1) / 2).all())
            and bool((b == world).all())
        )
    return good


def rounds_inside_a_queued_function() -> tuple[float, float]:
    """A compressor runs several collectives in one queued function (PowerSGD's two rounds);
    they run in order on the worker instead of waiting for themselves."""

    comm = Communicator()

    def two_rounds() -> float:
        first = torch.ones(4) * (comm.rank + 1)
        C.all_reduce(comm, first, "sum", algo="ring")
        second = first.clone()
        inner = C.all_reduce(comm, second, "max", algo="doubling", async_op=True)
        assert inner is not None
        inner.wait()
        return float(first[0] + second[0])

    handle = comm.submit("two rounds", two_rounds)
    after = torch.ones(2) * comm.rank
    C.all_reduce(comm, after, "max", algo="native")  # queued behind the two rounds
    return float(handle.result()), float(after[0])


def mismatched_lengths(algo: str) -> None:
    comm = Communicator(config=CommConfig(validate=True, deadline_s=10))
    C.all_reduce(comm, torch.ones(100 + comm.rank), algo=algo)


def bad_arguments() -> list[str]:
    comm = Communicator()
    messages = []
    call: Callable[[], object]
    for call in (
        lambda: C.all_reduce(comm, torch.ones(4), algo="carrier-pigeon"),
        lambda: C.all_reduce(comm, torch.ones(4, dtype=torch.int32), "avg"),
        lambda: C.all_reduce(comm, torch.ones(4), "median"),  # type: ignore[arg-type]
        lambda: C.all_reduce(comm, torch.ones(4, 4).t()),
        lambda: C.all_reduce(comm, torch.ones(4), out=torch.ones(5)),
        lambda: C.broadcast(comm, torch.ones(4), comm.world_size),
        lambda: C.all_gather(comm, torch.ones(3), torch.ones(2)),
        lambda: C.all_to_all(comm, torch.ones(3), torch.ones(3)),
        lambda: C.all_reduce(comm, torch.ones(4, dtype=torch.complex64)),
    ):
        try:
            call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


#: The deadline the survivors of a dead peer must raise within.
DEAD_PEER_DEADLINE_S = 15.0


def peer_dies_mid_collective(algo: str) -> str:
    comm = Communicator(config=CommConfig(deadline_s=DEAD_PEER_DEADLINE_S))
    if comm.rank == 1:
        os._exit(9)
    try:
        C.all_reduce(comm, torch.ones(1 << 16), algo=algo)
    except CommError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_empty_and_single_element_through_every_algorithm(pool: PoolFn, world: int) -> None:
    for result in pool(world).run(empty_and_single_element, timeout_s=120):
        failed = [name for name, good in result.items() if not good]
        assert not failed, failed


@pytest.mark.parametrize("world", [2, 3])
def test_out_of_place_all_reduce_leaves_the_input(pool: PoolFn, world: int) -> None:
    for result in pool(world).run(out_of_place_leaves_input):
        assert all(result.values()), result


@pytest.mark.parametrize("algo", ["ring", "rabenseifner", "doubling", "pipeline", "native"])
def test_async_then_sync_on_every_rank(pool: PoolFn, algo: str) -> None:
    assert all(pool(3).run(async_then_sync_keeps_order, algo))


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_input_checks_keep_the_order_of_queued_collectives(pool: PoolFn, algo: str) -> None:
    """validate=True checks each call's input with a collective of its own: issued while an
    async collective is still queued, it must not overtake it on one rank and not another."""
    assert all(pool(2).run(async_then_sync_keeps_order, algo, True, 30, timeout_s=120))


def test_collectives_inside_a_queued_function_run_in_order(pool: PoolFn) -> None:
    for total, after in pool(3).run(rounds_inside_a_queued_function):
        assert (total, after) == (12.0, 2.0)


@pytest.mark.parametrize("algo", ["ring", "pipeline"])
def test_mismatched_lengths_are_named_not_hung(pool: PoolFn, algo: str) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(mismatched_lengths, algo, timeout_s=60)
    assert isinstance(info.value.exc, InconsistentInputError)
    assert "rank 0: torch.float32 (100,)" in str(
        info.value.exc
    ) and "rank 1: torch.float32 (101,)" in str(info.value.exc)


def test_bad_arguments_get_clear_errors(pool: PoolFn) -> None:
    messages = pool(2).run(bad_arguments)[0]
    expected = [
        "unknown all_reduce algorithm 'carrier-pigeon'",
        "needs a floating-point",
        "unknown reduce op 'median'",
        "contiguous",
        "out must match",
        "root=2 is not a rank",
        "all_gather output must hold",
        "must divide by world size",
        "dtype torch.complex64",
    ]
    for message, needle in zip(messages, expected, strict=True):
        assert needle in message, (needle, message)


@pytest.mark.parametrize("algo", ["ring", "rabenseifner", "pipeline"])
def test_a_dead_peer_makes_the_others_raise_within_the_deadline(pool: PoolFn, algo: str) -> None:
    with pytest.raises(RankError) as info:
        # A survivor whose neighbour gave up (alive, not dead) raises only at the deadline:
        # the pool waits that long for it, and the assertions below say how it must fail.
        pool(3).run(
            peer_dies_mid_collective,
            algo,
            timeout_s=60,
            failure_grace_s=DEAD_PEER_DEADLINE_S + 10,
        )
    assert info.value.rank == 1
    survivors = info.value.partial_results
    assert set(survivors) == {0, 2}, survivors
    for text in survivors.values():
        assert str(text).startswith(("PeerFailureError", "CommTimeoutError")), text
        assert "all_reduce" in str(text) and "rank " in str(text)


def test_aliases_name_the_same_algorithms() -> None:
    assert (
        resolve("all_reduce", "lp") == "pipeline" and resolve("all_reduce", "rab") == "rabenseifner"
    )
    assert (
        resolve("reduce_scatter", "rab") == "halving"
        and resolve("broadcast", "hier") == "hierarchical"
    )
    assert resolve("all_gather", "rd") == "doubling" and resolve("all_reduce", "ring") == "ring"


def handed_bytes_per_algorithm() -> dict[str, tuple[int, int, int]]:
    """(handed bytes counted, input bytes, wire bytes sent) of one call per algorithm."""
    comm = Communicator()
    world = comm.world_size
    x = torch.ones(96 * world)
    nbytes = x.numel() * x.element_size()
    calls: dict[str, Callable[[str], object]] = {
        "all_reduce": lambda a: C.all_reduce(comm, x.clone(), algo=a),
        "broadcast": lambda a: C.broadcast(comm, x.clone(), 0, algo=a),
        "reduce": lambda a: C.reduce(comm, x.clone(), 0, algo=a),
        "all_gather": lambda a: C.all_gather(comm, torch.empty(world * x.numel()), x, algo=a),
        "reduce_scatter": lambda a: C.reduce_scatter(comm, torch.empty(96), x, algo=a),
        "all_to_all": lambda a: C.all_to_all(comm, torch.empty_like(x), x, algo=a),
    }
    out = {}
    for collective, call in calls.items():
        for algo in every(collective):
            comm.stats.reset()
            call(algo)
            total = comm.stats.total()
            out[f"{collective}.{algo}"] = (total.handed_bytes, nbytes, total.bytes_sent)
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_handed_bytes_count_the_callers_buffer_once_whatever_the_algorithm(
    pool: PoolFn, world: int
) -> None:
    """``handed_bytes``: every rank's input, once per call, for gloo's collectives and commfuse's
    algorithms alike (the accounting the training strategies compare with torch DDP's hooks);
    ``bytes_sent`` stays the exact wire traffic of commfuse's own algorithms."""
    for result in pool(world).run(handed_bytes_per_algorithm, timeout_s=120):
        wrong = {k: v for k, v in result.items() if v[0] != v[1]}
        assert not wrong, wrong
        _, nbytes, sent = result["all_reduce.ring"]
        assert sent == 2 * (world - 1) * nbytes // world
        assert result["all_reduce.native"][2] == 0
