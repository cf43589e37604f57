"""Two-level allreduce and broadcast through the front door: exact results over a grid, the
bytes and messages of each level per rank (2D and leader allreduce, broadcast), the flat
fallbacks, the layout from the environment, the async form, cached sub-groups, clear errors,
and the cost model handed to the tuner.

Every layout is checked in one pool call per world size (a module fixture), because each new
communicator creates its sub-groups again, and creating process groups costs time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from commfuse.collectives import all_reduce, broadcast
from commfuse.collectives.blocks import even_blocks
from commfuse.collectives.cost import LinkCost, hierarchical_all_reduce, ring_all_reduce
from commfuse.collectives.hierarchical import HostGroups
from commfuse.collectives.reduce_ops import reference_reduce
from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.testing import RankPool
from test_collectives_pipeline_tree import Counts, _cases, lp_counts, rank_input, tree_counts
from test_collectives_ring_doubling import expected_all_reduce

PoolFn = Callable[[int], RankPool]
Outcomes = dict[int, list[dict[str, Any]]]  # world size -> each rank's hierarchical_checks()

LAYOUTS = {4: [2], 8: [2, 4]}  # world size -> ranks per host to test
NUMEL, BLOCK_BYTES = 1001, 400  # float32: n = 4004 bytes, k = 11 blocks of 100 elements
N_BYTES, K_BLOCKS = 4 * NUMEL, 11
ODD_BLOCK_BYTES = 388
CHUNKS, SEGMENTS = 3, 2  # 2D counts: chunks of 334, 334, 333 elements; 2 messages per block


def _roots(world: int) -> list[int]:
    return sorted({0, 1, world - 1})


def hierarchical_checks(layouts: list[int]) -> dict[str, Any]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    bad: list[str] = []
    for local in layouts:
        for index, (dtype, op, numel) in enumerate(_cases()):
            everyone = [rank_input(r, numel, dtype, op) for r in range(world)]
            where = f"L={local} {dtype} {op} n={numel}"
            opts: dict[str, Any] = {"ranks_per_host": local, "block_bytes": ODD_BLOCK_BYTES}
            # 2D, pipelined in 3 chunks of odd sizes; the cross-host step on the worker thread.
            t = everyone[rank].clone()
            all_reduce(
                comm, t, op, algo="hierarchical", inter_algo="pipeline", num_chunks=3, **opts
            )
            bad += [] if torch.equal(t, reference_reduce(everyone, op)) else [f"all_reduce {where}"]
            if op == "sum":
                root = index % world
                t = everyone[rank].clone()
                broadcast(comm, t, root, algo="hierarchical", **opts)
                bad += [] if torch.equal(t, everyone[root]) else [f"broadcast {root} {where}"]
        # Other steps and schemes; fewer elements than ranks; the defaults (2D, ring across).
        for numel, inter, intra, chunks in [
            (NUMEL, "native", "ring", 4),
            (NUMEL, None, "ring", None),
            (5, None, "ring", 3),
            (NUMEL, "native", "pipeline", None),
            (NUMEL, "pipeline", "native", None),
            (NUMEL, None, "tree", None),
        ]:
            everyone = [rank_input(r, numel, torch.float32, "sum") for r in range(world)]
            t = everyone[rank].clone()
            opts = {"inter_algo": inter} if inter else {}
            all_reduce(
                comm,
                t,
                "avg",
                algo="hierarchical",
                ranks_per_host=local,
                intra_algo=intra,
                num_chunks=chunks,
                **opts,
            )
            if not torch.equal(t, reference_reduce(everyone, "avg")):
                bad.append(f"all_reduce L={local} n={numel} inter={inter} intra={intra}")
    traffic: dict[str, Counts] = {}

    def count(key: str, fn: Any, *args: Any, on: Communicator | None = None, **kwargs: Any) -> None:
        """One call's counters under the hierarchical label (on ``comm`` unless given)."""
        where = on or comm
        where.stats.reset()
        fn(where, torch.full((NUMEL,), float(rank)), *args, algo="hierarchical", **kwargs)
        c = where.stats[label(fn.__name__, "hierarchical")]
        traffic[key] = (c.bytes_sent, c.messages_sent, c.bytes_recv, c.messages_recv)

    two_d: dict[str, Any] = {"num_chunks": CHUNKS, "num_segments": SEGMENTS}
    opts = {"block_bytes": BLOCK_BYTES, "inter_algo": "pipeline", "intra_algo": "tree"}
    for local in layouts:
        count(f"all_reduce.2d.{local}", all_reduce, ranks_per_host=local, **two_d)
        count(
            f"all_reduce.2dnative.{local}",
            all_reduce,
            ranks_per_host=local,
            inter_algo="native",
            **two_d,
        )
        count(f"all_reduce.leader.{local}", all_reduce, ranks_per_host=local, **opts)
        for root in _roots(world):
            count(f"broadcast.{local}.{root}", broadcast, root, ranks_per_host=local, **opts)
    for local in (1, world):
        count(f"all_reduce.flat{local}", all_reduce, ranks_per_host=local, **opts)
        count(f"broadcast.flat{local}", broadcast, world - 1, ranks_per_host=local, **opts)
    # No option: CommConfig.ranks_per_host decides (the pool's start-up fills it from
    # LOCAL_WORLD_SIZE, the world size here: one host, flat).
    count("all_reduce.env", all_reduce, **opts)
    configured = Communicator(config=dataclasses.replace(comm.config, ranks_per_host=layouts[0]))
    count(f"all_reduce.env{layouts[0]}", all_reduce, on=configured, **two_d)
    # Async: the caller computes while the two levels run on the worker threads.
    everyone = [rank_input(r, NUMEL, torch.float32, "sum") for r in range(world)]
    t = everyone[rank].clone()
    handle = all_reduce(
        comm,
        t,
        "sum",
        algo="hierarchical",
        ranks_per_host=layouts[-1],
        inter_algo="pipeline",
        num_chunks=4,
        async_op=True,
    )
    busy = sum(i * i for i in range(200_000))
    assert handle is not None
    handle.wait()
    if not (busy and torch.equal(t, reference_reduce(everyone, "sum"))):
        bad.append("async all_reduce")
    errors = []
    # cast: the literal's dicts mix int and str values, which mypy joins to list[object]
    for bad_opts in cast(
        "list[dict[str, Any]]",
        [
            {"ranks_per_host": 3},
            {"inter_algo": "hierarchical"},
            {"intra_algo": "x"},
            {"num_chunks": 0},
        ],
    ):
        try:
            all_reduce(
                comm, torch.ones(8), algo="hierarchical", **{"ranks_per_host": 2, **bad_opts}
            )
        except ValueError as err:
            errors.append(str(err))
    # Dozens of calls above, yet one pair of sub-groups per layout was created.
    cached = sorted(comm.owned(HostGroups).levels) == sorted(layouts)
    return {
        "failures": [f"rank {rank}: {b}" for b in bad],
        "traffic": traffic,
        "errors": errors,
        "cached": cached,
    }


# ---- expected traffic -----------------------------------------------------------------------


def _plus(*counts: Counts) -> Counts:
    return tuple(map(sum, zip(*counts, strict=True)))  # type: ignore[return-value]


def two_d_counts(rank: int, local: int, world: int, across: bool) -> Counts:
    """Per chunk: the host ring's reduce-scatter sends every shard but its own and receives every
    shard but its left neighbour's; its allgather sends every shard but its right neighbour's
    and receives every shard but its own; a shard of s elements is min(s, SEGMENTS) messages.
    ``across``: plus the cross-host ring allreduce of its own shard among the H hosts."""
    host, lr = divmod(rank, local)
    total: Counts = (0, 0, 0, 0)
    for start, stop in even_blocks(NUMEL, CHUNKS):
        shard = [b - a for a, b in even_blocks(stop - start, local)]
        sent = [shard[i] for i in range(local) if i != lr]
        sent += [shard[i] for i in range(local) if i != (lr + 1) % local]
        got = [shard[i] for i in range(local) if i != (lr - 1) % local]
        got += [shard[i] for i in range(local) if i != lr]
        msgs = [sum(min(s, SEGMENTS) for s in side) for side in (sent, got)]
        total = _plus(total, (4 * sum(sent), msgs[0], 4 * sum(got), msgs[1]))
        if across:
            sb, sm, rb, rm = expected_all_reduce("ring", host, world // local, shard[lr], SEGMENTS)
            total = _plus(total, (4 * sb, sm, 4 * rb, rm))
    return total


def leader_counts(rank: int, local: int, world: int) -> Counts:
    """Tree reduce to local rank 0, LP allreduce among the hosts' local ranks 0, tree broadcast."""
    host, lr = divmod(rank, local)
    steps = [
        tree_counts("reduce", lr, local, 0, N_BYTES),
        tree_counts("broadcast", lr, local, 0, N_BYTES),
    ]
    if lr == 0:
        steps.append(lp_counts("all_reduce", host, world // local, 0, N_BYTES, K_BLOCKS))
    return _plus(*steps)


def broadcast_counts(rank: int, local: int, world: int, root: int) -> Counts:
    """LP broadcast among the root's local rank on every host, then a tree inside each host."""
    host, lr = divmod(rank, local)
    root_host, root_lr = divmod(root, local)
    steps = [tree_counts("broadcast", lr, local, root_lr, N_BYTES)]
    if lr == root_lr:
        steps.append(lp_counts("broadcast", host, world // local, root_host, N_BYTES, K_BLOCKS))
    return _plus(*steps)


@pytest.fixture(scope="module")
def outcomes(pool: PoolFn) -> Outcomes:
    return {
        w: pool(w).run(hierarchical_checks, layouts, timeout_s=240)
        for w, layouts in LAYOUTS.items()
    }


def test_results_match_exact_reference(outcomes: Outcomes) -> None:
    failures = [f for per_rank in outcomes.values() for out in per_rank for f in out["failures"]]
    assert failures == []


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_bytes_and_messages_per_level(outcomes: Outcomes, world: int) -> None:
    for rank, out in enumerate(outcomes[world]):
        got = out["traffic"]
        expected: dict[str, Counts] = {}
        for local in LAYOUTS[world]:
            expected[f"all_reduce.2d.{local}"] = two_d_counts(rank, local, world, True)
            # gloo's own allreduce across hosts sends nothing point-to-point.
            expected[f"all_reduce.2dnative.{local}"] = two_d_counts(rank, local, world, False)
            expected[f"all_reduce.leader.{local}"] = leader_counts(rank, local, world)
            for root in _roots(world):
                expected[f"broadcast.{local}.{root}"] = broadcast_counts(rank, local, world, root)
        # One level (one rank per host, or one host): the flat algorithm on the whole group.
        flat = lp_counts("all_reduce", rank, world, 0, N_BYTES, K_BLOCKS)
        for local in (1, world):
            expected[f"all_reduce.flat{local}"] = flat
            expected[f"broadcast.flat{local}"] = lp_counts(
                "broadcast", rank, world, world - 1, N_BYTES, K_BLOCKS
            )
        expected["all_reduce.env"] = flat
        expected[f"all_reduce.env{LAYOUTS[world][0]}"] = two_d_counts(
            rank, LAYOUTS[world][0], world, True
        )
        assert got == expected, f"rank {rank}"


def test_bad_options_and_cached_groups(outcomes: Outcomes) -> None:
    for per_rank in outcomes.values():
        for out in per_rank:
            assert out["cached"]
            assert len(out["errors"]) == 4
            assert "must divide the group size" in out["errors"][0]
            assert (
                "inter_algo='hierarchical' is not a registered all_reduce algorithm"
                in out["errors"][1]
            )
            assert (
                "intra_algo='x' is neither 'ring' (2D) nor a registered reduce" in out["errors"][2]
            )
            assert "num_chunks must be a positive int, got 0" in out["errors"][3]


def test_cost_model() -> None:
    intra = LinkCost(alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)
    inter = LinkCost(alpha_s=0.0, beta_s_per_byte=8e-9, gamma_s_per_byte=0.0)
    n = 16 << 20
    assert hierarchical_all_reduce(n, 1, 4, intra, inter) == math.inf
    assert hierarchical_all_reduce(n, 4, 1, intra, inter) == math.inf
    # Free host links: the cross-host bytes alone, 2((H-1)/H) n per host link, against
    # 2((P-1)/P) n for the flat ring (1.5x less on 2 hosts x 2 ranks).
    for hosts, local in [(2, 2), (4, 2), (2, 4)]:
        two_level = hierarchical_all_reduce(n, hosts, local, intra, inter)
        assert two_level == pytest.approx(2 * (hosts - 1) / hosts * n * 8e-9, rel=1e-6)
        flat = ring_all_reduce(n, hosts * local, inter)
        assert flat / two_level == pytest.approx(
            (hosts * local - 1) / (hosts * local) * hosts / (hosts - 1)
        )
    # Slow host links show up once the cross-host step is no longer the bottleneck.
    slow = LinkCost(alpha_s=0.0, beta_s_per_byte=1e-7, gamma_s_per_byte=0.0)
    assert hierarchical_all_reduce(n, 2, 2, slow, inter) > hierarchical_all_reduce(
        n, 2, 2, intra, inter
    )
