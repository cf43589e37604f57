"""The communicator on real gloo process groups: results, exact byte counts, deadlines, traces."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commfuse.cluster import RankError
from commfuse.comm import (
    CommConfig,
    CommError,
    CommTimeoutError,
    Communicator,
    InconsistentInputError,
    PeerFailureError,
    ReduceOpName,
    merge_chrome_traces,
)
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


# ---- rank functions (module level, so the pool's ranks can import them) -----------------------


def ring_shift(numel: int, dtype: torch.dtype) -> dict[str, Any]:
    """Every rank sends numel elements to the next rank and receives from the previous."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    send = torch.full((numel,), rank + 1, dtype=dtype)
    recv = torch.zeros(numel, dtype=dtype)
    if world > 1:
        comm.sendrecv(send, (rank + 1) % world, recv, (rank - 1) % world, label="shift")
    expected = (
        torch.full((numel,), (rank - 1) % world + 1, dtype=dtype)
        if world > 1
        else torch.zeros(numel, dtype=dtype)
    )
    return {"ok": torch.equal(recv, expected), "stats": comm.stats.snapshot()}


def native_collectives(numel: int, dtype: torch.dtype) -> dict[str, bool]:
    """Each native collective against its exact reference (integer-valued inputs: exact sums)."""
    comm = Communicator(config=CommConfig(validate=True))
    rank, world = comm.rank, comm.world_size
    base = torch.arange(numel, dtype=torch.float64) % 7

    def rank_input(r: int) -> torch.Tensor:
        return (base + r).to(dtype)

    mine = rank_input(rank)
    everyone = torch.stack([rank_input(r).to(torch.float64) for r in range(world)])
    out: dict[str, bool] = {}
    cases: list[tuple[ReduceOpName, torch.Tensor]] = [
        ("sum", everyone.sum(0)),
        ("max", everyone.max(0).values),
        ("min", everyone.min(0).values),
    ]
    for op, reference in cases:
        t = mine.clone()
        comm.all_reduce(t, op)
        out[f"all_reduce_{op}"] = torch.equal(t, reference.to(dtype))
    if dtype.is_floating_point:
        t = mine.clone()
        comm.all_reduce(t, "avg")
        out["all_reduce_avg"] = torch.allclose(t.double(), everyone.mean(0), rtol=1e-2, atol=1e-2)
    t = mine.clone()
    comm.broadcast(t, world - 1)
    out["broadcast"] = torch.equal(t, rank_input(world - 1))
    t = mine.clone()
    comm.reduce(t, 0, "sum")
    out["reduce"] = rank != 0 or torch.equal(t, everyone.sum(0).to(dtype))
    gathered = torch.empty(world * numel, dtype=dtype)
    comm.all_gather(gathered, mine)
    out["all_gather"] = torch.equal(gathered, everyone.reshape(-1).to(dtype))
    big = torch.cat([rank_input(rank)] * world)
    piece = torch.empty(numel, dtype=dtype)
    comm.reduce_scatter(piece, big, "sum")
    out["reduce_scatter"] = torch.equal(piece, everyone.sum(0).to(dtype))
    # all_to_all: rank r sends block j (value 100 r + j) to rank j.
    send = torch.cat([torch.full((numel,), 100 * rank + j, dtype=dtype) for j in range(world)])
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)
    expected = torch.cat([torch.full((numel,), 100 * i + rank, dtype=dtype) for i in range(world)])
    out["all_to_all"] = torch.equal(recv, expected)
    stats = comm.stats
    out["counted"] = (
        stats["all_reduce"].calls == (4 if dtype.is_floating_point else 3)
        and stats["all_gather"].native_bytes == numel * mine.element_size()
    )
    return out


def uneven_all_to_all() -> bool:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    # rank r sends r + j + 1 elements to rank j
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [i + rank + 1 for i in range(world)]
    send = torch.cat([torch.full((n,), float(10 * rank + j)) for j, n in enumerate(in_splits)])
    recv = torch.empty(sum(out_splits))
    comm.all_to_all(recv, send, out_splits, in_splits)
    expected = torch.cat([torch.full((n,), float(10 * i + rank)) for i, n in enumerate(out_splits)])
    return torch.equal(recv, expected)


def recv_never_sent(deadline_s: float) -> str:
    """Rank 0 waits for a message rank 1 never sends; returns the error text."""
    comm = Communicator(config=CommConfig(deadline_s=deadline_s))
    if comm.rank == 0:
        with comm.at_step(7):
            try:
                comm.recv(torch.zeros(16), 1)
            except CommTimeoutError as err:
                return f"{type(err).__name__}|{err.rank}|{err.op}|{err.peer}|{err.step}|{err}"
        return "no error"
    return ""


def die_mid_collective(deadline_s: float) -> str:
    comm = Communicator(config=CommConfig(deadline_s=deadline_s))
    if comm.rank == 1:
        os._exit(17)
    t = torch.ones(1 << 16)
    try:
        comm.all_reduce(t)
    except CommError as err:
        return f"{type(err).__name__}|{err}"
    return "no error"


def mismatched_shapes() -> None:
    comm = Communicator(config=CommConfig(validate=True))
    comm.all_reduce(torch.ones(4 + comm.rank))


def bad_op() -> None:
    comm = Communicator()
    comm.all_reduce(torch.ones(4, dtype=torch.int32), "avg")


def traced(path: str) -> list[dict[str, Any]]:
    comm = Communicator(config=CommConfig(trace=True))
    t = torch.ones(1000)
    with comm.at_step(3):
        comm.sendrecv(
            t, (comm.rank + 1) % comm.world_size, t.clone(), (comm.rank - 1) % comm.world_size
        )
        comm.all_reduce(t)
    comm.trace.export_chrome(f"{path}/trace-rank{comm.rank}.json")
    return [
        {
            "kind": e.kind,
            "peer": e.peer,
            "nbytes": e.nbytes,
            "dur": (e.end_us or 0) - e.start_us,
            "step": e.step,
        }
        for e in comm.trace.events
    ]


def hierarchical_groups() -> dict[str, object]:
    comm = Communicator()
    intra, inter = comm.split_by_host(2)
    t = torch.tensor([float(comm.rank)])
    intra.all_reduce(t)
    u = torch.tensor([float(comm.rank)])
    inter.all_reduce(u)
    # p2p inside a subgroup uses subgroup ranks
    got = torch.zeros(1)
    intra.sendrecv(torch.tensor([float(comm.rank)]), 1 - intra.rank, got, 1 - intra.rank)
    return {
        "intra": t.item(),
        "inter": u.item(),
        "peer": got.item(),
        "names": (intra.name, inter.name),
        "intra_sent": intra.stats["sendrecv"].bytes_sent,
        "world_sent": comm.stats.total().bytes_sent,
    }


def split_of_a_split() -> tuple[float, float, str]:
    """Split a sub-communicator again (only its members call): halves, then singles and pairs."""
    comm = Communicator()
    half = comm.split([[0, 1, 2], [3, 4]], name="half")
    parts = [[0, 2], [1]] if half.world_size == 3 else [[0], [1]]
    quarter = half.split(parts, name="quarter")
    t = torch.tensor([float(comm.rank)])
    quarter.all_reduce(t)
    u = torch.tensor([1.0])
    half.all_reduce(u)  # the parent still works afterwards
    return t.item(), u.item(), quarter.name


# ---- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("numel", [0, 1, 1023])
def test_point_to_point_counts_are_exact(pool: PoolFn, world: int, numel: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        results = pool(world).run(ring_shift, numel, dtype)
        size = torch.tensor([], dtype=dtype).element_size()
        for result in results:
            assert result["ok"]
            shift = result["stats"]["shift"]
            messages = 1 if numel else 0  # an empty tensor costs no message
            assert shift["messages_sent"] == messages and shift["messages_recv"] == messages
            assert shift["bytes_sent"] == numel * size and shift["bytes_recv"] == numel * size
            assert shift["calls"] == 2  # one isend, one irecv


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_collectives_match_reference(pool: PoolFn, world: int, dtype: torch.dtype) -> None:
    for numel in (1, 33):
        for result in pool(world).run(native_collectives, numel, dtype):
            assert all(result.values()), result


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_with_uneven_splits(pool: PoolFn, world: int) -> None:
    assert all(pool(world).run(uneven_all_to_all))


def test_wait_past_deadline_names_rank_op_peer_and_step(pool: PoolFn) -> None:
    results = pool(2).run(recv_never_sent, 1.0, timeout_s=30)
    kind, rank, op, peer, step, message = results[0].split("|", 5)
    assert (kind, rank, op, peer, step) == ("CommTimeoutError", "0", "recv", "1", "7")
    assert (
        "rank 0" in message
        and "peer 1" in message
        and "step 7" in message
        and "deadline" in message
    )
    # The pool noticed the broken group and rebuilds it: the next call works.
    assert all(r["ok"] for r in pool(2).run(ring_shift, 8, torch.float32))


def test_peer_death_raises_on_the_survivor_within_deadline(pool: PoolFn) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(die_mid_collective, 20.0, timeout_s=30)
    assert info.value.rank == 1 and "died" in str(info.value)
    survivor = info.value.partial_results[0]
    assert isinstance(survivor, str) and survivor.startswith(
        ("PeerFailureError", "CommTimeoutError", "CommError")
    )
    assert "rank 0" in survivor and "all_reduce" in survivor
    assert all(r["ok"] for r in pool(2).run(ring_shift, 8, torch.float32))


def test_mismatched_shapes_are_named(pool: PoolFn) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(mismatched_shapes)
    assert isinstance(info.value.exc, InconsistentInputError)
    assert "rank 0: torch.float32 (4,)" in str(
        info.value.exc
    ) and "rank 1: torch.float32 (5,)" in str(info.value.exc)


def test_avg_of_integers_is_refused(pool: PoolFn) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(bad_op)
    assert isinstance(info.value.exc, ValueError) and "avg" in str(info.value.exc)


def test_trace_exports_chrome_json(pool: PoolFn, tmp_path: Path) -> None:
    results = pool(2).run(traced, str(tmp_path))
    for events in results:
        kinds = [e["kind"] for e in events]
        assert kinds == ["sendrecv", "sendrecv", "all_reduce"]
        assert all(e["dur"] >= 0 and e["step"] == 3 for e in events)
        assert [e["nbytes"] for e in events] == [4000, 4000, 4000]
    merged = tmp_path / "trace.json"
    merge_chrome_traces(sorted(tmp_path.glob("trace-rank*.json")), merged)
    data = json.loads(merged.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and len(spans) == 6
    assert {e["name"] for e in spans} == {"sendrecv", "all_reduce"}


def test_host_subgroups(pool: PoolFn) -> None:
    results = pool(4).run(hierarchical_groups)
    for rank, result in enumerate(results):
        host = rank // 2
        assert result["intra"] == 2 * host * 2 + 1  # ranks 2h and 2h+1
        assert result["inter"] == (rank % 2) * 2 + 2  # ranks lr and lr + 2
        assert result["peer"] == rank ^ 1
        assert result["names"] == (f"host{host}", f"cross{rank % 2}")
        # traffic is counted on the communicator that carried it, not the world's
        assert result["intra_sent"] == 4 and result["world_sent"] == 0


def test_world_of_one_is_a_cheap_real_path(pool: PoolFn) -> None:
    for dtype in (torch.float32, torch.int64):
        assert all(pool(1).run(native_collectives, 5, dtype)[0].values())


def test_communicator_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        Communicator()


def test_peer_failure_is_a_comm_error() -> None:
    assert issubclass(PeerFailureError, CommError) and issubclass(CommTimeoutError, TimeoutError)


def test_split_of_a_sub_communicator(pool: PoolFn) -> None:
    results = pool(5).run(split_of_a_split, timeout_s=60)
    # world ranks 0,2 | 1 | 3 | 4; halves of 3 and 2 ranks.
    assert [r[0] for r in results] == [2.0, 1.0, 2.0, 3.0, 4.0]
    assert [r[1] for r in results] == [3.0, 3.0, 3.0, 2.0, 2.0]
    assert [r[2] for r in results] == ["quarter0", "quarter1", "quarter0", "quarter0", "quarter1"]


def keys_resolve() -> dict[str, Any]:
    """Every rank's view of the communicator registry (``Communicator.key``/``resolve``) on a
    new process group (the pool's ranks have built other communicators before, maybe not the
    same ones)."""
    import gc

    first = Communicator().split([[0, 1]], name="both")  # over a new process group
    second = Communicator(first.group, name="again")
    out: dict[str, Any] = {
        "keys": [first.key, second.key],
        "resolves": Communicator.resolve(first.key) is first
        and Communicator.resolve(second.key) is second,
    }
    gone = second.key
    del second
    gc.collect()
    for key in (gone, "no-such-group:0"):
        try:
            Communicator.resolve(key)
            out[key] = "resolved"
        except ValueError as err:
            out[key] = str(err)
    out["third"] = Communicator(first.group).key
    return out


def test_communicators_resolve_by_a_key_the_same_on_every_rank(pool: PoolFn) -> None:
    replies = pool(2).run(keys_resolve)
    assert replies[0] == replies[1]  # the same keys (and messages) on every rank
    reply = replies[0]
    first, second = reply["keys"]
    group = first.rpartition(":")[0]
    assert (first, second) == (f"{group}:0", f"{group}:1") and reply["resolves"]
    assert reply["third"] == f"{group}:2"  # a collected communicator's key is not reused
    for key in (second, "no-such-group:0"):
        assert f"no live Communicator has key {key!r}" in reply[key]
