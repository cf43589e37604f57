"""``bench ddp`` and ``bench strategies`` on a small pool with the A/A control: the baseline's
copy is a model of its own, timed in the balanced rounds, and every record carries its ratio."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from commfuse.bench.ddp import DdpBenchConfig, bench_ddp_on_rank
from commfuse.bench.strategies import StrategiesBenchConfig, bench_strategies_on_rank
from commfuse.compress import FP16
from commfuse.testing import RankPool
from commfuse.train import CommfuseDPConfig, TorchDDPConfig
from commfuse.workloads import DigitsConfig

PoolFn = Callable[[int], RankPool]


@pytest.mark.e2e
def test_ddp_bench_times_torch_ddp_twice(pool: PoolFn) -> None:
    config = DdpBenchConfig(
        num_layers=2,
        width=32,
        batch_size=4,
        num_steps=1,
        num_reps=3,
        algos=("native",),
        control=True,
    )
    records = pool(2).run(bench_ddp_on_rank, config, timeout_s=120)[0]
    by_engine = {r["engine"]: r for r in records}
    assert set(by_engine) == {"torch_ddp", "compute", "commfuse:native", "torch_ddp'"}
    twin = by_engine["torch_ddp'"]
    assert all(r["control_ratio"] == twin["ratio_to_torch_ddp"] for r in records)
    assert twin["tie"] is True and by_engine["torch_ddp"]["tie"] is None
    assert all(sorted(order) == sorted(by_engine) for order in twin["orders"])
    assert len({order[0] for order in twin["orders"]}) == 3  # no engine always first


@pytest.mark.e2e
def test_strategies_bench_times_the_first_strategy_twice(pool: PoolFn) -> None:
    config = StrategiesBenchConfig(
        strategies=(TorchDDPConfig(), CommfuseDPConfig(compressor=FP16())),
        labels=("ddp", "fp16"),
        workload=DigitsConfig(),
        steps=1,
        reps=2,
        warmup_steps=1,
        control=True,
    )
    records = pool(2).run(bench_strategies_on_rank, config, timeout_s=180)[0]
    by_name = {r["strategy"]: r for r in records}
    assert set(by_name) == {"ddp", "fp16", "ddp'", "compute"}
    assert by_name["ddp'"]["bytes_per_step"] == by_name["ddp"]["bytes_per_step"] > 0
    assert all(r["control_ratio"] == by_name["ddp'"]["ratio_to_first"] for r in records)
