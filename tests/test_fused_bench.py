"""``commfuse bench fused`` on a small pool: every record has the fields its report reads, sane ratios,
and no wrong element; bad options fail before any rank starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from commfuse.bench.fused import FUSED_OPS, FusedBenchConfig, bench_fused_on_rank, run_together
from commfuse.bench.fused_steps import StepBenchConfig, bench_steps_on_rank
from commfuse.bench.machine_rounds import MACHINE_KINDS, machine_share
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
FIELDS = {
    "op",
    "shape",
    "world_size",
    "chunks",
    "compute_us",
    "comm_us",
    "unfused_us",
    "fused_us",
    "ideal_us",
    "overlap_us",
}


@pytest.mark.e2e
def test_bench_records(pool: PoolFn) -> None:
    config = FusedBenchConfig(
        iters=1, warmup=1, chunks=3, shapes=((64, 32, 48), (96, 4, 50, 8, 3), (32, 16, 24, 2))
    )
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == list(FUSED_OPS)
    for r in records:
        assert set(r) >= FIELDS, r
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["chunks"] == 3
        assert r["ideal_us"] == max(r["compute_us"], r["comm_us"])
        assert r["fused_vs_unfused"] == pytest.approx(r["fused_us"] / r["unfused_us"])
        assert r["fused_vs_overlap"] == pytest.approx(r["fused_us"] / r["overlap_us"])
        assert r["overlap_us"] > 0
        bound = r["dependency_bound_us"]
        # The CPU floor: every variant's CPU (all ranks), compute's and comm's over the cores.
        cpu = r["cpu_us"]
        assert set(cpu) >= {"compute", "comm", "unfused", "fused"} and r["cpu_floor_us"] > 0
        if r["op"] == "moe_step":  # the one operator whose dependencies give a bound of its own
            assert bound == max(r["dependencies_only_us"], r["cpu_floor_us"]) > 0
            # The dependency-aware part counts each stage's CPU floor (fused_moe.py).
            from commfuse.bench.fused_moe import moe_step_bound_us

            floors = r["stage_floors_us"]
            assert set(floors) == {
                *("dispatch", "combine", "gemm1", "gemm2"),
                *("allreduce", "allreduce_ring", "update"),
            }
            medians = {"compute": r["compute_us"], "comm": r["comm_us"], **r["stages_us"]}
            assert r["dependencies_only_us"] == pytest.approx(moe_step_bound_us(medians, floors))
            assert r["fused_vs_dependency_bound"] == pytest.approx(r["fused_us"] / bound)
            # The graph's bound (sim/bound.py): the machine floor and the two global waits.
            graph = r["graph_bound"]
            assert set(graph["exposed_us"]) == {"dispatch", "allreduce"}
            assert graph["machine_us"] >= r["machine_floor_us"] * (1 - 1e-9)
            assert 1 <= graph["chunks"] <= 16
            assert r["graph_bound_us"] == max(r["machine_bound_us"], graph["bound_us"])
            assert r["fused_vs_graph_bound"] == pytest.approx(r["fused_us"] / r["graph_bound_us"])
        else:
            assert bound is None and r["fused_vs_dependency_bound"] is None
            assert r["graph_bound_us"] is None and r["fused_vs_graph_bound"] is None
            assert r["machine_dependencies_us"] == r["ideal_us"]  # its parts: max(C, M)
        # The machine's bound: its CPU, the kernel's network work and the cores left to it.
        assert r["machine_floor_us"] >= r["cpu_floor_us"] * (1 - 1e-9)
        assert r["machine_floor_us"] == max(
            r["machine_floor_parts_us"], r["machine_floor_unfused_us"]
        )
        assert r["machine_bound_us"] == max(r["machine_dependencies_us"], r["machine_floor_us"])
        assert r["fused_vs_machine_bound"] == pytest.approx(r["fused_us"] / r["machine_bound_us"])
        assert all(v >= 0 for v in r["kernel_network_us"].values()) and r["taken_cores"] >= 0


def test_gemm_all_reduce_schedules_get_rows_of_their_own(pool: PoolFn) -> None:
    """Where the operator chooses, its other row schedules are timed in the same rounds, each a
    row sharing the chosen row's C, M, unfused and overlap, with its own result checked."""
    config = FusedBenchConfig(ops=("gemm_all_reduce",), iters=2, warmup=1, shapes=((32, 16, 8),))
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == [
        "gemm_all_reduce",
        "gemm_all_reduce[ring k=2]",
        "gemm_all_reduce[blocks k=2 L=1]",
    ]
    chosen = records[0]
    for r in records[1:]:
        assert r["schedule_of"] == "gemm_all_reduce" and r["wrong"] == 0
        for key in ("compute_us", "comm_us", "unfused_us", "overlap_us"):
            assert r[key] == chosen[key]
        assert r["fused_vs_overlap"] == pytest.approx(r["fused_us"] / r["overlap_us"])


def test_no_warm_up_still_times_the_parts_the_chunk_choice_needs(pool: PoolFn) -> None:
    config = FusedBenchConfig(ops=("gemm_all_reduce",), iters=1, warmup=0, shapes=((32, 16, 8),))
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert records and all(r["wrong"] == 0 for r in records)
    assert records[0]["compute_us"] > 0 and records[0]["comm_us"] > 0
    steps = StepBenchConfig(steps=("dlrm",), iters=1, warmup=0, shapes=((16, 3, 20, 4, 2),))
    assert pool(2).run(bench_steps_on_rank, steps, timeout_s=120)[0]


def test_moe_step_bound_hides_each_exchange_only_behind_its_gemms() -> None:
    from commfuse.bench.fused_moe import moe_step_bound_us

    parts = {"compute": 100.0, "comm": 40.0, "dispatch": 10.0, "combine": 12.0}
    # GEMMs longer than the exchanges: all four hide (forward once, backward once).
    assert moe_step_bound_us({**parts, "gemm1": 30.0, "gemm2": 30.0}) == 140.0 - 44.0
    # Short GEMMs: each exchange hides only as long as its GEMMs run (backward twice).
    assert moe_step_bound_us({**parts, "gemm1": 2.0, "gemm2": 3.0}) == 140.0 - (2 + 3 + 6 + 4)
    # No GEMMs: nothing hides, the bound is C + M.
    assert moe_step_bound_us({**parts, "gemm1": 0.0, "gemm2": 0.0}) == 140.0
    # Ranks sharing cores: an exchange and its GEMMs last at least their CPU floors together,
    # so each pair hides only what those floors leave: 30 + 10 against 25 + 8 hides 7 (not
    # 10), the combine 9, and the backward pairs (60 against 50 + 8) hide the whole exchange.
    long = {**parts, "gemm1": 30.0, "gemm2": 30.0}
    floors = {"dispatch": 8.0, "combine": 8.0, "gemm1": 25.0, "gemm2": 25.0}
    assert moe_step_bound_us(long, floors) == 140.0 - (7 + 9 + 10 + 12)
    assert moe_step_bound_us(long, dict.fromkeys(floors, 0.0)) == moe_step_bound_us(long)


def test_moe_step_graph_waits_for_the_dispatchs_first_round_and_the_last_all_reduce() -> None:
    from commfuse.bench.fused_moe import moe_step_graph
    from commfuse.sim.bound import step_bound

    wall = {"compute": 200.0, "dispatch": 28.0, "allreduce": 4.0}
    cpu = {"compute": 400.0, "dispatch": 14.0, "allreduce": 2.0, "gemm1": 54.0, "update": 1.0}
    g = moe_step_graph(wall, cpu, floor_us=250.0, cores=2.0, ranks=4, local_share=0.25)
    dispatch, allreduce = g.waits
    assert (dispatch.name, dispatch.chunked, dispatch.fill_us) == ("dispatch", True, 13.5)
    assert dispatch.traffic_cores == pytest.approx(0.5)
    assert (allreduce.name, allreduce.chunked, allreduce.fill_us) == ("allreduce", False, 1.0)
    assert g.rank_compute_us == 100.0 and g.chunk_choices == tuple(range(1, 17))
    # The dispatch's first round, 28 / k with its own half core busy, against 13.5 us of local
    # blocks over 2 cores: (28 / k * 1.5 - 13.5) / 2 idles 3.75 us at 2 pieces, 0.25 at 3, none
    # from 4; the all-reduce idles (4 * 1.5 - 1) / 2 = 2.5 us whatever the pieces.
    b = step_bound(g)
    assert b.chunks == 4 and b.exposed_us == {"dispatch": 0.0, "allreduce": pytest.approx(2.5)}
    assert b.bound_us == pytest.approx(252.5)
    # Where gloo's ring is the faster all-reduce, the wait is its time: a bound charges the
    # fastest exchange there is.
    ring = {**wall, "allreduce_ring": 2.0}
    g = moe_step_graph(
        ring, {**cpu, "allreduce_ring": 1.0}, floor_us=250.0, cores=2.0, ranks=4, local_share=0.25
    )
    assert g.waits[1].wait_us == 2.0 and g.waits[1].traffic_cores == 0.5


def test_machine_share_counts_the_kernels_work_beyond_its_rate_and_the_cores_taken() -> None:
    names = ["compute", "comm"]
    machine = torch.zeros(len(MACHINE_KINDS), 2, 1, dtype=torch.float64)
    at = {kind: i for i, kind in enumerate(MACHINE_KINDS)}
    # The computation alone: 2000 us busy in 1000 us, 1600 of them the ranks', 300 other
    # programs', so 100 the kernel's (0.1 us per us); 100 us stolen: 0.5 cores taken.
    for kind, value in {"busy": 2000, "ranks": 1600, "others": 300, "steal": 100}.items():
        machine[at[kind], 0, 0] = value
    machine[at["interval"], 0, 0] = 1000
    # The exchange alone: 200 us of the kernel's in 500 us, 50 of which it does anyway.
    for kind, value in {"busy": 900, "ranks": 300, "others": 400, "interval": 500}.items():
        machine[at[kind], 1, 0] = value
    network, taken = machine_share(machine, names, reader=(1, 2))
    assert network == {"compute": 0.0, "comm": pytest.approx(150.0)}
    assert taken == pytest.approx(0.5)
    # Only a machine's reader reports; the other ranks add nothing to its floor.
    assert machine_share(machine, names, reader=None) == ({"compute": 0.0, "comm": 0.0}, 0.0)


def test_run_together_runs_both_and_raises_the_collectives_error() -> None:
    ran: list[str] = []
    run_together(lambda: ran.append("compute"), lambda: ran.append("collective"))
    assert sorted(ran) == ["collective", "compute"]

    def broken() -> None:
        raise RuntimeError("rank 1 left during all_reduce")

    with pytest.raises(RuntimeError, match="rank 1 left"):
        run_together(lambda: ran.append("again"), broken)
    assert ran[-1] == "again"  # the computation still ran to its end


def test_schedule_by_table_times_the_embedding_exchange_by_table(pool: PoolFn) -> None:
    config = FusedBenchConfig(
        ops=("embedding_all_to_all",),
        iters=1,
        warmup=1,
        schedule="by_table",
        shapes=((40, 5, 30, 4, 3),),
    )
    (record,) = pool(3).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert record["chunks"] == "by_table" and record["wrong"] == 0
    assert record["predicted_us"] is None


def test_bench_config_errors() -> None:
    with pytest.raises(ValueError, match="is a schedule of the embedding exchange only"):
        FusedBenchConfig(ops=("embedding_all_to_all", "gemm_all_reduce"), schedule="by_table")
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        FusedBenchConfig(ops=("embedding_all_to_all",), chunks=0)
    with pytest.raises(ValueError, match="leave chunks None"):
        FusedBenchConfig(ops=("embedding_all_to_all",), chunks=2, schedule="by_table")
    with pytest.raises(ValueError, match="tp-transformer take"):
        StepBenchConfig(steps=("dlrm", "tp-transformer"), schedule="by_table")
    StepBenchConfig(steps=("dlrm",), schedule="by_table")
    with pytest.raises(ValueError, match="unknown op"):
        FusedBenchConfig(ops=("gemm_all_gather",))
    with pytest.raises(ValueError, match="no shape of 5 dimensions"):
        FusedBenchConfig(ops=("embedding_all_to_all",), shapes=((1, 2, 3),))


@pytest.mark.e2e
def test_control_times_the_unfused_reference_twice(pool: PoolFn) -> None:
    config = FusedBenchConfig(
        ops=("gemm_all_reduce",), iters=3, warmup=1, chunks=2, shapes=((64, 32, 48),), control=True
    )
    (record,) = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert record["control_ratio"] == pytest.approx(
        record["unfused_control_us"] / record["unfused_us"]
    )
    assert isinstance(record["tie"], bool) and record["wrong"] == 0
    steps = StepBenchConfig(
        steps=("dlrm",), iters=2, warmup=1, shapes=((16, 3, 20, 4, 2),), control=True
    )
    (step,) = pool(2).run(bench_steps_on_rank, steps, timeout_s=120)[0]
    assert step["control_ratio"] is not None and step["wrong"] == 0  # U' trained as U did
