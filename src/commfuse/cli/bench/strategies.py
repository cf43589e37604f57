"""``commfuse bench strategies``: training strategies' step times, interleaved in one job.

commfuse bench strategies --hosts 4 --link 100mbit --strategy ddp-powersgd:rank=4,warmup=2 --strategy powersgd:rank=4,warmup=2

Every strategy (same syntax as ``commfuse train``) on its own copy of the workload's model,
after ``--warmup-steps`` untimed steps each, timed in turns of ``--steps`` steps for
``--repeats`` rounds in balanced orders (every strategy in every position equally often), plus
the bare model without communication (the floor). Ratios are to the first strategy, median over
rounds (see ``commfuse.bench.strategies``); ``--control`` times the first one twice (A/A). For
losses and time to a loss use ``commfuse compare``; this command is for step times a few
percent apart.
"""

from __future__ import annotations

import argparse
import sys

from commfuse.cli.common import (
    Subparsers,
    add_bucket_cap_argument,
    add_job_command,
    backend_from_args,
    require_at_least,
    topology_from_args,
)


def register(bench_sub: Subparsers) -> None:
    add_job_command(
        bench_sub,
        "strategies",
        _run_bench_strategies,
        help="step times of training strategies, interleaved in one job, against the first",
        doc=__doc__,
        arguments=_arguments,
        default_link="100mbit",
        control="build and time the first strategy twice (NAME')",
        json="one record per strategy",
        plot="each strategy's median step, fastest to slowest round (PNG/SVG/PDF)",
        timeout_s=1200.0,
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="charlm", help="charlm or digits, with options")
    parser.add_argument(
        "--strategy",
        action="append",
        required=True,
        help="repeat, one per strategy; the first is the baseline of the ratios",
    )
    parser.add_argument("--steps", type=int, default=6, help="steps per timed block (default 6)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="untimed steps of each strategy first"
    )
    add_bucket_cap_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-compute", action="store_true", help="skip the bare model (the compute floor)"
    )


def _run_bench_strategies(args: argparse.Namespace) -> int:
    from commfuse.bench.strategies import StrategiesBenchConfig, bench_strategies_on_rank
    from commfuse.cli.bench.report import plot_steps, run_and_report
    from commfuse.cli.spec import strategy_from_spec, workload_from_spec

    topology = topology_from_args(args)
    backend_from_args(args, topology)  # the device checks, before any rank starts
    require_at_least("--repeats", args.repeats, 1)
    config = StrategiesBenchConfig(
        strategies=tuple(
            strategy_from_spec(s, ranks_per_host=topology.ranks_per_host) for s in args.strategy
        ),
        labels=tuple(s.strip() for s in args.strategy),
        workload=workload_from_spec(args.workload),
        steps=args.steps,
        reps=args.repeats,
        warmup_steps=args.warmup_steps,
        bucket_cap_mb=args.bucket_cap_mb,
        seed=args.seed,
        include_compute=not args.no_compute,
        control=args.control,
    )
    print(
        f"commfuse bench strategies: {args.workload}, {topology.describe()}, "
        f"{config.reps} rounds (balanced orders) of {config.steps} steps after "
        f"{config.warmup_steps} untimed (medians; phases: rank 0)",
        file=sys.stderr,
    )
    title = f"{args.workload}, {topology.describe()}, bucket cap {config.bucket_cap_mb:g} MiB"
    return run_and_report(
        bench_strategies_on_rank,
        config,
        topology,
        args,
        kind="bench strategies",
        heading="Strategies benchmark",
        title=lambda records: title,
        plot=plot_steps("strategy"),
    )
