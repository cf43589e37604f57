"""The DLRM-style workload: a training step with the fused embedding + All-to-All trains exactly
the same model as the unfused step (lookups, then gloo's All-to-All), bit for bit, over world
sizes 1-4, ranks owning no table included; the fused step sends exactly the off-diagonal bytes
of the unfused All-to-All in each direction, and both allreduce the same MLP gradients; the
loss falls; the synthetic data is deterministic and power-law skewed; bad configs are rejected."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import ChunkConfig
from commfuse.fused.chunking import BY_TABLE, ChunkSchedule
from commfuse.fused.embedding_all_to_all import LABEL
from commfuse.testing import RankPool
from commfuse.workloads.dlrm import (
    DLRM,
    DLRMConfig,
    make_optimizer,
    power_law_ids,
    synthetic_batch,
    train_step,
)

PoolFn = Callable[[int], RankPool]


def fused_equals_unfused(
    num_tables: int, interaction: str, steps: int, chunks: ChunkSchedule = 3
) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    chunk_config = (
        ChunkConfig(schedule=BY_TABLE) if chunks == BY_TABLE else ChunkConfig(num_chunks=chunks)
    )
    config = DLRMConfig(
        num_tables=num_tables,
        rows_per_table=50,
        embedding_dim=4,
        dense_features=5,
        bottom_mlp=(8,),
        top_mlp=(8,),
        interaction=interaction,
        pooling=3,
        batch_per_rank=7,
    )
    failures: list[str] = []
    runs = {}
    for exchange in ("fused", "unfused"):
        model = DLRM(config, comm, exchange=exchange, chunk_config=chunk_config)
        opt = make_optimizer(model)
        losses, counters = [], []
        for step in range(steps):
            comm.stats.reset()
            losses.append(
                train_step(
                    model, opt, synthetic_batch(config, step, rank, world, device=comm.device)
                )
            )
            counters.append(comm.stats.snapshot())
        runs[exchange] = (model, losses, counters)
    fused, unfused = runs["fused"], runs["unfused"]
    where = f"rank {rank} world {world} tables {num_tables} {interaction} chunks {chunks}"
    if fused[1] != unfused[1]:
        failures.append(f"{where}: losses differ {fused[1]} vs {unfused[1]}")
    for (name, p), q in zip(fused[0].named_parameters(), unfused[0].parameters(), strict=True):
        if not torch.equal(p, q):
            failures.append(f"{where}: parameter {name} differs by {(p - q).abs().max():.3g}")
    # Communication: the fused exchange sends the unfused All-to-All's payload minus the block
    # that stays local, forward (my tables, others' samples) and backward (mine, others' tables).
    per_rank = fused[0].embedding.tables_per_rank
    d, b = config.embedding_dim, config.batch_per_rank
    forward = (world - 1) * b * per_rank[rank] * d * 4
    backward = b * (num_tables - per_rank[rank]) * d * 4
    for step in range(steps):
        f, u = fused[2][step], unfused[2][step]
        sent = f.get(LABEL, {}).get("bytes_sent", 0)
        if sent != forward + backward:
            failures.append(f"{where}: fused sent {sent} bytes, want {forward + backward}")
        # The unfused exchange is commfuse's pairwise All-to-All (baselines.ALL_TO_ALL), which
        # counts exact point-to-point bytes: the local blocks never travel, as in the fused one.
        pairwise = u.get(label("all_to_all", "pairwise"), {}).get("bytes_sent", 0)
        if world > 1 and pairwise != sent:
            failures.append(f"{where}: unfused pairwise All-to-All sent {pairwise} != {sent}")
        if f["all_reduce"] != u["all_reduce"]:
            failures.append(
                f"{where}: MLP all_reduce differs {f['all_reduce']} vs {u['all_reduce']}"
            )
        if "all_to_all" in f or label("all_to_all", "pairwise") in f:
            failures.append(f"{where}: the fused step used an unfused All-to-All")
    return failures


def loss_falls() -> list[str]:
    comm = Communicator()
    config = DLRMConfig(num_tables=3, rows_per_table=40, embedding_dim=4, batch_per_rank=32, lr=0.2)
    model = DLRM(config, comm, chunk_config=ChunkConfig(num_chunks=2))
    opt = make_optimizer(model)
    losses = [
        train_step(
            model, opt, synthetic_batch(config, s, comm.rank, comm.world_size, device=comm.device)
        )
        for s in range(30)
    ]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return [] if last < 0.9 * first else [f"rank {comm.rank}: loss {first:.3f} -> {last:.3f}"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_step_equals_unfused(pool: PoolFn, world: int) -> None:
    # 5 tables: uneven tables per rank; 2 tables at world >= 3: some ranks own none.
    failures = [
        f for r in pool(world).run(fused_equals_unfused, 5, "dot", 3, timeout_s=180) for f in r
    ]
    if world >= 3:
        failures += [
            f for r in pool(world).run(fused_equals_unfused, 2, "cat", 2, timeout_s=180) for f in r
        ]
        # By table (ChunkConfig(schedule="by_table")): the same model, the same bytes.
        failures += [
            f
            for r in pool(world).run(fused_equals_unfused, 5, "dot", 2, BY_TABLE, timeout_s=180)
            for f in r
        ]
    assert not failures, "\n".join(failures[:8])


def test_loss_falls(pool: PoolFn) -> None:
    failures = [f for r in pool(2).run(loss_falls, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures)


def test_synthetic_data_is_deterministic_and_skewed() -> None:
    config = DLRMConfig(num_tables=4, rows_per_table=1000, pooling=4, batch_per_rank=256)
    a = synthetic_batch(config, 3, 1, 2, seed=7, device=torch.device("cpu"))
    b = synthetic_batch(config, 3, 1, 2, seed=7, device=torch.device("cpu"))
    c = synthetic_batch(config, 4, 1, 2, seed=7, device=torch.device("cpu"))
    assert torch.equal(a.dense, b.dense) and all(
        torch.equal(x, y) for x, y in zip(a.indices, b.indices, strict=True)
    )
    assert not torch.equal(a.dense, c.dense)
    # Rank 1 owns tables 1 and 3; the ids of rank 0's samples are the ones rank 0 would draw.
    other = synthetic_batch(config, 3, 0, 2, seed=7, device=torch.device("cpu"))
    assert len(a.indices) == 2 and len(other.indices) == 2
    ids = power_law_ids(200_000, 1000, 1.2, torch.Generator().manual_seed(0))
    counts = torch.bincount(ids, minlength=1000).double()
    assert int(ids.min()) >= 0 and int(ids.max()) <= 999
    # A power law: id 0 about 2^1.2 times as frequent as id 1; the top 1% of ids take > 40%.
    assert 1.8 < float(counts[0] / counts[1]) < 2.9
    assert float(counts[:10].sum() / counts.sum()) > 0.4
    uniform = power_law_ids(100_000, 100, 0.0, torch.Generator().manual_seed(0))
    assert float(torch.bincount(uniform, minlength=100).double().std() / 1000) < 0.15


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="interaction must be one of"):
        DLRMConfig(interaction="sum")
    with pytest.raises(ValueError, match="num_tables must be >= 1"):
        DLRMConfig(num_tables=0)
    with pytest.raises(ValueError, match="MLP widths"):
        DLRMConfig(top_mlp=(0,))


def test_step_bench_records(pool: PoolFn) -> None:
    from commfuse.bench.fused_steps import StepBenchConfig, bench_steps_on_rank

    config = StepBenchConfig(iters=2, warmup=1, chunks=2, shapes=((24, 3, 20, 4, 2),))
    (record,) = pool(2).run(bench_steps_on_rank, config, timeout_s=120)[0]
    assert record["op"] == "dlrm_step" and record["wrong"] == 0 and record["chunks"] == 2
    assert record["fused_vs_unfused"] == pytest.approx(record["fused_us"] / record["unfused_us"])
    # The bound: the larger of the dependencies' (from the stages timed alone) and the CPU floor.
    stages = {"lookup", "exchange", "accumulate", "bottom", "dense", "allreduce"}
    assert set(record["stages_us"]) == stages
    assert record["cpu_floor_us"] > 0 and record["cpu_us"]["unfused"] > 0
    bound = record["dependency_bound_us"]
    assert bound == max(record["dependencies_only_us"], record["cpu_floor_us"])
    assert record["fused_vs_dependency_bound"] == pytest.approx(record["fused_us"] / bound)
    # The machine's bound, as the operator benchmark's: the machine floor of the unfused step
    # or of its parts alone (with the kernel's network work, over the cores left), or the
    # dependencies; then the step's graph on those cores.
    floor = record["machine_floor_us"]
    assert floor == max(record["machine_floor_unfused_us"], record["machine_floor_parts_us"])
    assert floor >= record["cpu_floor_us"] * (1 - 1e-9)
    assert record["machine_bound_us"] == max(record["dependencies_only_us"], floor)
    graph = record["graph_bound"]
    assert set(graph["exposed_us"]) == {"exchange", "exchange_back", "allreduce"}
    assert graph["chunks"] in (1, 2, 3) and graph["machine_us"] >= floor
    assert record["graph_bound_us"] == max(record["machine_bound_us"], graph["bound_us"])
    assert record["fused_vs_graph_bound"] == pytest.approx(
        record["fused_us"] / record["graph_bound_us"]
    )
    with pytest.raises(ValueError, match="unknown step"):
        StepBenchConfig(steps=("bert",))


def test_dlrm_step_bound_hides_each_exchange_only_behind_its_computation() -> None:
    from commfuse.bench.fused_steps import dlrm_step_bound_us

    parts = {"unfused": 100.0, "exchange": 20.0}
    assert dlrm_step_bound_us({**parts, "lookup": 5.0, "accumulate": 30.0}) == 100.0 - 5 - 20
    assert dlrm_step_bound_us({**parts, "lookup": 0.0, "accumulate": 0.0}) == 100.0


def test_dlrm_step_graph_waits_for_each_exchanges_piece_round_and_the_mlp_all_reduce() -> None:
    from commfuse.bench.fused_steps import dlrm_step_graph
    from commfuse.sim.bound import step_bound

    wall = {"exchange": 40.0, "allreduce": 6.0}
    cpu = {"lookup": 20.0, "accumulate": 80.0, "dense": 40.0, "bottom": 4.0}
    cpu |= {"exchange": 20.0, "allreduce": 3.0}
    g = dlrm_step_graph(wall, cpu, floor_us=300.0, cores=2.0, ranks=4, chunk_choices=(1, 3, 8))
    forward, back, allreduce = g.waits
    assert (forward.name, forward.chunked, forward.fill_us) == ("exchange", True, 4.0)
    # The reverse exchange: the own samples' block of the accumulation, and the MLPs' work.
    assert (back.name, back.chunked, back.fill_us) == ("exchange_back", True, 20.0 + 40.0)
    assert (allreduce.name, allreduce.chunked, allreduce.fill_us) == ("allreduce", False, 80.0)
    assert forward.traffic_cores == 0.5 and allreduce.traffic_cores == 0.5
    assert g.rank_compute_us == (20 + 80 + 40) / 4
    # The forward exchange's last piece, 40 / k with its own half core busy, against the
    # bottom MLP's 4 us over 2 cores: 30 / k - 2 idle; the other two waits are filled.
    b = step_bound(g)
    assert b.chunks == 8 and b.exposed_us == {
        "exchange": pytest.approx(1.75),
        "exchange_back": 0.0,
        "allreduce": 0.0,
    }
    assert b.bound_us == pytest.approx(301.75) and b.machine_us == b.bound_us
    # One rank's path at one piece: 35 of computation, 40 - 1 and 40 - 15 of the exchanges'
    # waits less their fill per rank, the all-reduce filled: 99, under the machine's 328.
    one = step_bound(dataclasses.replace(g, chunk_choices=(1,)))
    assert one.critical_path_us == pytest.approx(99.0) and one.bound_us == pytest.approx(328.0)
