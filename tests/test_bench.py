"""The collectives benchmark: every case is correct (wrong == 0) and reports nccl-tests fields."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from commfuse.bench.cases import bus_factor, element_count, make_case
from commfuse.bench.collectives import (
    CollectiveBenchConfig,
    auto_summary,
    bench_collectives_on_rank,
    mark_regret,
)
from commfuse.bench.table import algo_cell
from commfuse.cli import main
from commfuse.collectives.registry import COLLECTIVES, label
from commfuse.comm import Communicator
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

REQUIRED_FIELDS = {
    "op",
    "algo",
    "bytes",
    "world_size",
    "hosts",
    "link_gbit",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "wrong",
}


def corrupted_case_is_caught(op: str) -> int:
    """A case whose collective is skipped must report wrong elements (the check can fail)."""
    comm = Communicator()
    case = make_case(comm, op, 4096)
    case.reset()
    return case.count_wrong()


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("all_to_all", 8) == 0.875
    assert bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("gossip", 2)


def test_element_counts_split_evenly() -> None:
    assert element_count("all_gather", 1000, 3, 4) == 249  # 250 rounded down to a multiple of 3
    assert element_count("all_reduce", 1000, 3, 4) == 250
    assert element_count("all_to_all", 1, 4, 4) == 4  # never smaller than one element per rank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_op_is_correct(pool: PoolFn, world: int) -> None:
    config = CollectiveBenchConfig(ops=COLLECTIVES, sizes_bytes=(4, 4000, 65536), iters=2, warmup=1)
    results = pool(world).run(bench_collectives_on_rank, config)
    records = results[0]
    assert len(records) == len(COLLECTIVES) * 3
    for record in records:
        assert record.keys() >= REQUIRED_FIELDS
        assert record["wrong"] == 0, record
        assert record["world_size"] == world and record["time_us"] > 0
        assert record["busbw_GBps"] == pytest.approx(
            record["algbw_GBps"] * bus_factor(record["op"], world)
        )


def test_wrong_column_detects_a_skipped_collective(pool: PoolFn) -> None:
    for op in COLLECTIVES:
        wrong = pool(2).run(corrupted_case_is_caught, op)
        # The root of reduce (rank 0) holds the result; the root of broadcast already has it.
        checked_rank = 0 if op == "reduce" else 1
        assert wrong[checked_rank] > 0, (op, wrong)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown op gossip"):
        CollectiveBenchConfig(ops=("gossip",))
    with pytest.raises(ValueError, match="iters must be >= 1"):
        CollectiveBenchConfig(iters=0)


@pytest.mark.netlab
def test_cli_on_an_emulated_cluster_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    report = tmp_path / "report.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commfuse.cli",
            "bench",
            "collectives",
            "--hosts",
            "2",
            "--link",
            "200mbit",
            "--op",
            "all_reduce,all_to_all",
            "--sizes",
            "64K,256K",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert [(r["op"], r["bytes"]) for r in records] == [
        ("all_reduce", 65536),
        ("all_reduce", 262144),
        ("all_to_all", 65536),
        ("all_to_all", 262144),
    ]
    for record in records:
        assert record.keys() >= REQUIRED_FIELDS and record["wrong"] == 0
        assert record["hosts"] == 2 and record["link_gbit"] == 0.2 and record["emulated"]
        assert record["link_pct"] == pytest.approx(100 * record["busbw_GBps"] / 0.025)
    assert "busbw_GB/s" in proc.stdout and "all_reduce" in proc.stdout
    assert "| size" in report.read_text() and "torch" in report.read_text()


BAD_INPUT = (
    (["--link", "0mbit"], "more than 0"),
    (["--sizes", "12Q"], "bad size"),
    (["--op", "gossip"], "unknown op"),
    (["--hosts", "0"], "at least 1"),
    (["--hosts", "1"], "needs at least 2 ranks"),
)


@pytest.mark.e2e
def test_cli_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    # One case through a real interpreter (nothing else may reach stderr), the rest in-process:
    # each interpreter costs seconds of imports on a loaded 2-core machine.
    for i, (args, needle) in enumerate(BAD_INPUT):
        if i == 0:
            proc = subprocess.run(
                [sys.executable, "-m", "commfuse.cli", "bench", "collectives", *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            code, stderr = proc.returncode, proc.stderr
        else:
            code = main(["bench", "collectives", *args])
            stderr = capsys.readouterr().err
        assert code == 2, (args, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, stderr)


def test_control_times_the_first_algorithm_twice(pool: PoolFn) -> None:
    config = CollectiveBenchConfig(
        ops=("all_reduce",),
        sizes_bytes=(4000,),
        iters=4,
        warmup=1,
        algos=("native", "ring"),
        control=True,
    )
    records = pool(2).run(bench_collectives_on_rank, config)[0]
    assert [r["variant"] for r in records] == ["native", "ring", "native'"]
    assert [r["algo"] for r in records] == ["native", "ring", "native"]
    control = records[2]
    assert all(
        r["control_ratio"] == pytest.approx(1 / control["speedup_vs_first"]) for r in records
    )
    assert records[0]["tie"] is None and isinstance(records[1]["tie"], bool)
    assert control["tie"] is True and all(r["wrong"] == 0 for r in records)


def _row(variant: str, algo: str, time_us: float, chosen: str | None = None) -> dict[str, object]:
    return {
        "variant": variant,
        "algo": algo,
        "chosen": chosen or algo,
        "time_us": time_us,
        "op": "all_reduce",
        "hosts": 4,
        "ranks_per_host": 1,
    }


def test_auto_regret_is_against_the_fastest_algorithm_timed_beside_it() -> None:
    """The control's copy never counts as the best (it runs native's code: a fast run of it
    would charge auto for noise); the best algorithm's median is the yardstick."""
    row = [
        _row("native", "native", 10.0),
        _row("auto", "auto", 12.0, chosen="doubling"),
        _row("doubling", "doubling", 11.0),
        _row("pipeline", "pipeline", 8.0),
        _row("native'", "native", 5.0),
    ]
    mark_regret(row, control="native'")
    auto = row[1]
    assert auto["best_algo"] == "pipeline" and auto["best_us"] == 8.0
    assert auto["regret"] == pytest.approx(12.0 / 8.0 - 1)
    assert all("regret" not in r for r in row if r is not auto)
    # Without its pick timed on its own, auto's own run is a candidate: here the best.
    alone = [_row("native", "native", 10.0), _row("auto", "auto", 4.0, chosen="pipeline")]
    mark_regret(alone)
    assert alone[1]["best_algo"] == "pipeline" and alone[1]["regret"] == 0.0
    summary = auto_summary([*row, *alone])
    assert summary == [
        {
            "op": "all_reduce",
            "hosts": 4,
            "ranks_per_host": 1,
            "sizes": 2,
            "picks": {"doubling": 1, "pipeline": 1},
            "best_picked": 1,
            "median_regret": pytest.approx(0.25),
            "max_regret": pytest.approx(0.5),
        }
    ]


def test_auto_rows_carry_their_pick_and_regret(pool: PoolFn) -> None:
    config = CollectiveBenchConfig(
        ops=("all_reduce",),
        sizes_bytes=(4000,),
        iters=2,
        warmup=1,
        algos=("native", "auto", "ring"),
        control=True,
    )
    records = pool(2).run(bench_collectives_on_rank, config)[0]
    auto = next(r for r in records if r["variant"] == "auto")
    timed = {r["variant"]: r["time_us"] for r in records if r["variant"] in ("native", "ring")}
    if auto["chosen"] not in timed:  # what auto ran was not timed on its own: auto's run counts
        timed[auto["chosen"]] = auto["time_us"]
    assert auto["best_algo"] == min(timed, key=lambda name: timed[name])
    assert auto["regret"] == pytest.approx(auto["time_us"] / min(timed.values()) - 1)
    assert algo_cell(auto) == f"auto:{auto['chosen']}" and algo_cell(records[0]) == "native"


def test_auto_rows_settle_their_trial_before_timing(pool: PoolFn) -> None:
    config = CollectiveBenchConfig(
        ops=("all_reduce",),
        sizes_bytes=(4000,),
        iters=2,
        warmup=1,
        algos=("native", "auto"),
        tuner_trial_calls=1,
    )
    records = pool(2).run(bench_collectives_on_rank, config)[0]
    native, auto = records
    assert "trial" not in native
    trial = auto["trial"]
    assert trial["candidates"][0] == "native" and trial["chosen"] == auto["chosen"]
    assert trial["calls"] == 2 * len(trial["candidates"]) and all(m > 0 for m in trial["median_us"])
    assert auto["wrong"] == 0


def _ring_sweep_with_counts(config: CollectiveBenchConfig) -> tuple[list[dict[str, Any]], int]:
    comm = Communicator()
    records = bench_collectives_on_rank(config, comm)
    return records, comm.stats[label("all_reduce", "ring")].messages_sent


def test_a_sample_repeats_the_call_to_fill_its_minimum_time(pool: PoolFn) -> None:
    # A 64-byte all-reduce takes well under a millisecond, so a 30 ms sample needs many calls;
    # the ring's exact message count shows how many ran: 2 (P - 1) per call at P = 2.
    config = CollectiveBenchConfig(
        ops=("all_reduce",),
        sizes_bytes=(64,),
        iters=3,
        warmup=2,
        algos=("native", "ring"),
        min_sample_ms=30.0,
    )
    (records, ring_messages), (records1, ring_messages1) = pool(2).run(
        _ring_sweep_with_counts, config
    )
    calls = records[0]["calls_per_sample"]
    assert calls > 1 and all(r["calls_per_sample"] == calls for r in records + records1)
    assert ring_messages == ring_messages1 == 2 * (config.warmup + config.iters * calls)
    assert all(r["wrong"] == 0 for r in records)
    one = dataclasses.replace(config, min_sample_ms=0.0)
    (records, ring_messages), _ = pool(2).run(_ring_sweep_with_counts, one)
    assert records[0]["calls_per_sample"] == 1 and ring_messages == 2 * (2 + 3)
