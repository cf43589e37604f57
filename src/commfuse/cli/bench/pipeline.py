"""``commfuse bench pipeline``: pipeline schedules side by side against the sequential step.

commfuse bench pipeline --hosts 4 --link 100mbit --micro-batches 8 --control --json out.json

One stage per rank (``interleaved_1f1b``: ``--stages-per-rank``) of the same MLP cut into equal
stages, the batch split into ``--micro-batches``; each schedule on its own copy, timed in
``--repeats`` rounds of balanced orders of ``--steps`` steps; ratios to ``sequential`` (no
pipelining), the bubble measured on a traced step beside the schedule's formula, the bytes per
step (see ``commfuse.bench.pipeline``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commfuse.cli.common import Subparsers, add_job_command, require_at_least, topology_from_args


def register(bench_sub: Subparsers) -> None:
    add_job_command(
        bench_sub,
        "pipeline",
        _run_bench_pipeline,
        help="step time and bubble of pipeline schedules against the sequential step",
        doc=__doc__,
        arguments=_arguments,
        default_link="100mbit",
        control="time the sequential step twice (sequential')",
        json="one record per schedule",
        plot="each schedule's median step, fastest to slowest round (PNG/SVG/PDF)",
        timeout_s=900.0,
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule",
        default="sequential,gpipe,1f1b,zb_h1,interleaved_1f1b",
        help="schedules, comma list (sequential is always timed: the ratios' baseline)",
    )
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument(
        "--stages-per-rank", type=int, default=2, help="stages per rank of interleaved_1f1b"
    )
    parser.add_argument("--layers", type=int, default=16, help="Linear+Tanh layers (default 16)")
    parser.add_argument("--width", type=int, default=256, help="layer width (default 256)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block (default 3)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed blocks per schedule; medians reported"
    )


def _config(args: argparse.Namespace) -> Any:
    from commfuse.bench.pipeline import PipelineBenchConfig

    return PipelineBenchConfig(
        schedules=tuple(s.strip() for s in args.schedule.split(",") if s.strip()),
        num_microbatches=args.micro_batches,
        stages_per_rank=args.stages_per_rank,
        num_layers=args.layers,
        width=args.width,
        batch_size=args.batch_size,
        num_steps=args.steps,
        num_reps=args.repeats,
        control=args.control,
    )


def _run_bench_pipeline(args: argparse.Namespace) -> int:
    from commfuse.bench.pipeline import bench_pipeline_on_rank
    from commfuse.cli.bench.report import plot_steps, run_and_report

    topology = topology_from_args(args)
    require_at_least("--repeats", args.repeats, 1)
    config = _config(args)
    print(
        f"commfuse bench pipeline: {', '.join(config.schedules)}, {topology.describe()}, "
        f"{config.num_microbatches} micro-batches, {config.num_reps} rounds (balanced orders) "
        f"of {config.num_steps} steps (median)",
        file=sys.stderr,
    )

    def title(records: list[dict[str, Any]]) -> str:
        return (
            f"MLP {config.num_layers} x {config.width}, batch {config.batch_size} in "
            f"{config.num_microbatches} micro-batches, {topology.describe()}"
        )

    return run_and_report(
        bench_pipeline_on_rank,
        config,
        topology,
        args,
        kind="bench pipeline",
        heading="Pipeline schedules",
        title=title,
        plot=plot_steps("schedule"),
    )
