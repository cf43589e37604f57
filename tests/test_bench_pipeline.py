"""``bench pipeline`` on a small pool: every schedule's record, its bubble formula, its bytes
per step against the boundaries' activations, and the A/A control on the sequential step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from commfuse.bench.pipeline import PipelineBenchConfig, bench_pipeline_on_rank
from commfuse.cli import main
from commfuse.pipeline.runtime import HEADER_SLOTS
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]


@pytest.mark.e2e
def test_pipeline_bench_records_every_schedule(pool: PoolFn) -> None:
    p, m, v, batch, width = 2, 4, 2, 10, 8
    config = PipelineBenchConfig(
        schedules=("gpipe", "1f1b", "zb_h1", "interleaved_1f1b"),
        num_microbatches=m,
        stages_per_rank=v,
        num_layers=4,
        width=width,
        batch_size=batch,
        num_steps=1,
        num_reps=2,
        control=True,
    )
    records = pool(p).run(bench_pipeline_on_rank, config, timeout_s=180)[0]
    by_name = {r["schedule"]: r for r in records}
    assert set(by_name) == {
        "sequential",
        "gpipe",
        "1f1b",
        "zb_h1",
        "interleaved_1f1b",
        "sequential'",
    }
    formula = {
        "sequential": (p - 1) / p,
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "zb_h1": (p - 1) / (3 * m + p - 1),
        "interleaved_1f1b": (p - 1) / (v * m + p - 1),
    }
    for name, record in by_name.items():
        assert record["bubble_formula"] == pytest.approx(formula[name.rstrip("'")], abs=1e-12)
        assert 0.0 <= record["bubble_measured"] < 1.0
        # every boundary crosses ranks: an activation forward, a gradient back, per micro-batch
        crossings = record["stages"] - 1
        assert record["bytes_per_step"] == crossings * 2 * (
            batch * width * 4 + m * HEADER_SLOTS * 8
        )
        assert record["sequential_step_s"] == by_name["sequential"]["step_s"]
    assert by_name["sequential'"]["tie"] is True and by_name["sequential"]["tie"] is None
    assert all(r["control_ratio"] == by_name["sequential'"]["ratio_to_sequential"] for r in records)


def test_the_config_names_what_it_refuses() -> None:
    with pytest.raises(ValueError, match=r"schedules \['pipedream'\]: choose from sequential"):
        PipelineBenchConfig(schedules=("pipedream",))
    with pytest.raises(ValueError, match="batch_size 2 cannot make 4 micro-batches"):
        PipelineBenchConfig(batch_size=2, num_microbatches=4)
    assert PipelineBenchConfig(schedules=("1f1b",)).schedules == ("sequential", "1f1b")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--schedule", "pipedream"], "schedules ['pipedream']: choose from"),
        (["--batch-size", "2"], "batch_size 2 cannot make 8 micro-batches"),
        (["--repeats", "0"], "--repeats must be at least 1"),
    ],
)
def test_the_command_refuses_bad_settings_before_any_rank_starts(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "pipeline", "--hosts", "2", "--no-emulate", *argv]) == 2
    assert needle in capsys.readouterr().err
