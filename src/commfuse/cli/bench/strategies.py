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
import json
import sys
from pathlib import Path
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    add_bucket_cap_argument,
    add_control_argument,
    add_device_arguments,
    add_output_arguments,
    add_timeout_argument,
    add_topology_arguments,
    backend_from_args,
    require_at_least,
    run_on_ranks,
    set_command,
    topology_from_args,
)


def register(bench_sub: Subparsers) -> None:

    parser = bench_sub.add_parser(
        "strategies",
        help="step times of training strategies, interleaved in one job, against the first",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(parser, default_hosts=4, default_link="100mbit")
    add_device_arguments(parser)
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
    add_control_argument(parser, what="build and time the first strategy twice (NAME')")
    add_output_arguments(parser, json="one record per strategy")
    add_timeout_argument(parser, default_s=1200.0)
    set_command(parser, run_bench_strategies)


def render(records: list[dict[str, Any]]) -> str:
    """A plain table, one row per strategy."""
    from commfuse.bench.table import ratio_cell

    width = max(len("strategy"), *(len(r["strategy"]) for r in records)) + 2
    header = (
        f"{'strategy':<{width}}{'step ms':>9}{'min-max':>11}{'x first':>15}{'spread':>12}"
        f"{'/compute':>10}{'fwd ms':>8}{'bwd+sync':>10}{'opt ms':>8}{'cpu ms':>8}{'floor ms':>10}"
        f"{'MB/step':>9}"
    )
    rows = [header]
    for r in records:
        span = "{:.0f}-{:.0f}".format(r["step_s_min"] * 1e3, r["step_s_max"] * 1e3)
        spread = "{:.2f}-{:.2f}".format(r["ratio_min"], r["ratio_max"])
        over = r.get("step_over_compute")
        floor = r.get("cpu_floor_s")
        rows.append(
            f"{r['strategy']:<{width}}{r['step_s'] * 1e3:>9.1f}{span:>11}"
            f"{ratio_cell(r, 'ratio_to_first'):>15}{spread:>12}"
            f"{'-' if over is None else format(over, '.2f'):>10}"
            f"{r['forward_s'] * 1e3:>8.1f}{r['backward_sync_s'] * 1e3:>10.1f}"
            f"{r['optimizer_s'] * 1e3:>8.1f}{r['cpu_s_per_step'] * 1e3:>8.1f}"
            f"{'-' if floor is None else format(floor * 1e3, '.1f'):>10}"
            f"{r['bytes_per_step'] / 1e6:>9.3f}"
        )
    return "\n".join(rows)


def run_bench_strategies(args: argparse.Namespace) -> int:
    from commfuse.bench.strategies import StrategiesBenchConfig, bench_strategies_on_rank
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
    results = run_on_ranks(bench_strategies_on_rank, config, topology=topology, args=args)
    records = results[0]
    print(f"# {args.workload}, {topology.describe()}, bucket cap {config.bucket_cap_mb:g} MiB")
    print(render(records))
    from commfuse.bench.table import control_note

    note = control_note(records, "strategy")
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0
