"""``commfuse bench ddp``: commfuse's DataParallel against torch DDP, step for step.

commfuse bench ddp --hosts 4 --link 1gbit --model transformer --bucket-cap-mb 25 --json out.json

The same model, batches, bucket caps and cluster under torch's DistributedDataParallel,
commfuse's DataParallel (uncompressed, one engine per ``--algo``) and the bare model (no
communication, the compute floor), timed in rounds of balanced orders; medians of ``--repeats`` blocks of
``--steps`` steps (see ``commfuse.bench.ddp``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    add_bucket_cap_argument,
    add_job_command,
    require_at_least,
    topology_from_args,
)


def register(bench_sub: Subparsers) -> None:
    add_job_command(
        bench_sub,
        "ddp",
        _run_bench_ddp,
        help="step time of commfuse DataParallel vs torch DDP and the compute floor (interleaved)",
        doc=__doc__,
        arguments=_arguments,
        control="time torch DDP twice (torch_ddp')",
        json="one record per engine",
        plot="each engine's median step, fastest to slowest round (PNG/SVG/PDF)",
        timeout_s=900.0,
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    from commfuse.bench.ddp import MODELS

    parser.add_argument("--model", default="mlp", choices=MODELS, help="model (default mlp)")
    parser.add_argument(
        "--layers", type=int, default=None, help="layers (default 8 mlp, 4 transformer)"
    )
    parser.add_argument(
        "--width", type=int, default=None, help="width (default 512 mlp, 256 transformer)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per rank (default 32 mlp, 8 transformer)",
    )
    add_bucket_cap_argument(parser)
    parser.add_argument(
        "--algo", default="native,auto", help="commfuse all_reduce algorithms, comma list"
    )
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block (default 5)")
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed blocks per engine; medians reported"
    )


def _config(args: argparse.Namespace) -> Any:
    from commfuse.bench.ddp import DdpBenchConfig

    transformer = args.model == "transformer"
    return DdpBenchConfig(
        model=args.model,
        num_layers=args.layers or (4 if transformer else 8),
        width=args.width or (256 if transformer else 512),
        batch_size=args.batch_size or (8 if transformer else 32),
        bucket_cap_mb=args.bucket_cap_mb,
        num_steps=args.steps,
        num_reps=args.repeats,
        algos=tuple(a.strip() for a in args.algo.split(",") if a.strip()),
        control=args.control,
    )


def _run_bench_ddp(args: argparse.Namespace) -> int:
    from commfuse.bench.ddp import bench_ddp_on_rank
    from commfuse.cli.bench.report import plot_steps, run_and_report

    topology = topology_from_args(args)
    require_at_least("--repeats", args.repeats, 1)
    config = _config(args)
    print(
        f"commfuse bench ddp: {config.model}, {topology.describe()}, "
        f"{config.num_reps} rounds (balanced orders) of {config.num_steps} steps (median)",
        file=sys.stderr,
    )

    def title(records: list[dict[str, Any]]) -> str:
        params = records[0]["params"]
        return (
            f"{config.model}, {params / 1e6:.2f}M parameters, {topology.describe()}, "
            f"bucket cap {config.bucket_cap_mb:g} MiB"
        )

    return run_and_report(
        bench_ddp_on_rank,
        config,
        topology,
        args,
        kind="bench ddp",
        heading="DataParallel vs torch DDP",
        title=title,
        plot=plot_steps("engine"),
    )
