"""``commfuse bench fused`` on a small pool: every record has the issue's fields, sane ratios,
and no wrong element; bad options fail before any rank starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from commfuse.bench.fused import OPS, FusedBenchConfig, bench_fused_on_rank, run_together
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


def test_bench_records(pool: PoolFn) -> None:
    config = FusedBenchConfig(
        iters=1, warmup=1, chunks=3, shapes=((64, 32, 48), (96, 4, 50, 8, 3), (32, 16, 24, 2))
    )
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == list(OPS)
    for r in records:
        assert set(r) >= FIELDS, r
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["chunks"] == 3
        assert r["ideal_us"] == max(r["compute_us"], r["comm_us"])
        assert r["fused_vs_unfused"] == pytest.approx(r["fused_us"] / r["unfused_us"])
        assert r["fused_vs_overlap"] == pytest.approx(r["fused_us"] / r["overlap_us"])
        assert r["overlap_us"] > 0


def test_run_together_runs_both_and_raises_the_collectives_error() -> None:
    ran: list[str] = []
    run_together(lambda: ran.append("compute"), lambda: ran.append("collective"))
    assert sorted(ran) == ["collective", "compute"]

    def broken() -> None:
        raise RuntimeError("rank 1 left during all_reduce")

    with pytest.raises(RuntimeError, match="rank 1 left"):
        run_together(lambda: ran.append("again"), broken)
    assert ran[-1] == "again"  # the computation still ran to its end


def test_bench_config_errors() -> None:
    with pytest.raises(ValueError, match="unknown --op"):
        FusedBenchConfig(ops=("gemm_allgather",))
    with pytest.raises(ValueError, match="no --shape of 5 dimensions"):
        FusedBenchConfig(ops=("embedding_alltoall",), shapes=((1, 2, 3),))
