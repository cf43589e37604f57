"""``commfuse bench ddp``: commfuse's DataParallel against torch DDP, step for step.

commfuse bench ddp --hosts 4 --link 1gbit --model transformer --bucket-cap-mb 25 --json out.json

The same model, batches, bucket caps and cluster under torch's DistributedDataParallel,
commfuse's DataParallel (uncompressed, one engine per ``--algo``) and the bare model (no
communication, the compute floor), timed in rounds of balanced orders; medians of ``--repeats`` blocks of
``--steps`` steps (see ``commfuse.bench.ddp``). The issue's target: commfuse <= 1.02x torch.
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
    require_at_least,
    run_on_ranks,
    set_command,
    topology_from_args,
)


def register(bench_sub: Subparsers) -> None:
    from commfuse.bench.ddp import MODELS

    parser = bench_sub.add_parser(
        "ddp",
        help="step time of commfuse DataParallel vs torch DDP and the compute floor (interleaved)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(parser, default_hosts=4, default_link="1gbit")
    add_device_arguments(parser)
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
    add_control_argument(parser, what="time torch DDP twice (torch_ddp')")
    add_output_arguments(parser, json="one record per engine")
    add_timeout_argument(parser, default_s=900.0)
    set_command(parser, run_bench_ddp)


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


def render(records: list[dict[str, Any]]) -> str:
    """A plain table: one row per engine."""
    from commfuse.bench.table import ratio_cell

    header = f"{'engine':<18}{'step ms':>9}{'min-max ms':>15}{'exposed ms':>12}{'x torch':>15}{'spread':>13}{'buckets':>9}"
    rows = [header]
    for r in records:
        span = "{:.0f}-{:.0f}".format(r["step_s_min"] * 1e3, r["step_s_max"] * 1e3)
        spread = "{:.2f}-{:.2f}".format(r["ratio_min"], r["ratio_max"])
        buckets = "-" if r["num_buckets"] is None else str(r["num_buckets"])
        rows.append(
            f"{r['engine']:<18}{r['step_s'] * 1e3:>9.1f}{span:>15}"
            f"{r['exposed_comm_s'] * 1e3:>12.1f}{ratio_cell(r, 'ratio_to_torch_ddp'):>15}"
            f"{spread:>13}{buckets:>9}"
        )
    return "\n".join(rows)


def run_bench_ddp(args: argparse.Namespace) -> int:
    from commfuse.bench.ddp import bench_ddp_on_rank

    topology = topology_from_args(args)
    require_at_least("--repeats", args.repeats, 1)
    config = _config(args)
    print(
        f"commfuse bench ddp: {config.model}, {topology.describe()}, "
        f"{config.num_reps} rounds (balanced orders) of {config.num_steps} steps (median)",
        file=sys.stderr,
    )
    results = run_on_ranks(bench_ddp_on_rank, config, topology=topology, args=args)
    records = results[0]
    params = records[0]["params"]
    print(
        f"# {config.model}, {params / 1e6:.2f}M parameters, {topology.describe()}, bucket cap {config.bucket_cap_mb:g} MiB"
    )
    print(render(records))
    from commfuse.bench.table import control_note

    note = control_note(records, "engine")
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0
