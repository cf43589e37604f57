"""``commfuse bench fused``: fused computation-collective operators against their unfused form.

commfuse bench fused --hosts 4 --link 1gbit --op gemm_all_reduce,embedding_all_to_all --json out.json
commfuse bench fused --hosts 4 --link 1gbit --step dlrm
commfuse bench fused --hosts 4 --link 1gbit --step tp-transformer,tp-transformer-sp
"""

from __future__ import annotations

import argparse
import sys

from commfuse.cli.common import (
    Subparsers,
    add_output_arguments,
    add_timeout_argument,
    add_topology_arguments,
    set_command,
    topology_from_args,
    will_emulate,
)


def register(bench_sub: Subparsers) -> None:
    from commfuse.bench.fused import OPS

    parser = bench_sub.add_parser(
        "fused",
        help="fused operators vs unfused: compute C, comm M, unfused, fused, ideal max(C, M), ratios",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(parser, default_hosts=4, default_link="1gbit")
    parser.add_argument("--op", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument(
        "--shape",
        action="append",
        metavar="AxBx...",
        help="shape to time instead of the defaults (repeatable): rows x in x out for the GEMMs, "
        "batch x tables x rows x dim x pooling for embedding_all_to_all and --step dlrm, "
        "seq x batch x d_model x heads x d_ff x layers for --step tp-transformer",
    )
    parser.add_argument(
        "--chunks",
        type=int,
        help="fix the number of chunks (default: cost model); 0: table by table, for "
        "embedding_all_to_all and --step dlrm",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    parser.add_argument(
        "--step",
        metavar="NAMES",
        help="time whole training steps of these workloads (comma list: dlrm, tp-transformer, "
        "tp-transformer-sp) instead of --op",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A control: time the unfused reference twice per round (U and U'; with --step a second unfused model); U'/U is the noise floor, fused/unfused within it is a tie",
    )
    add_output_arguments(parser, json="one record per row", markdown="a dated report")
    add_timeout_argument(parser, default_s=900.0)
    set_command(parser, run_bench_fused)


def run_bench_fused(args: argparse.Namespace) -> int:
    from commfuse.bench.fused import COLUMNS, FusedBenchConfig, bench_fused_on_rank, parse_shapes
    from commfuse.cli.bench.report import run_and_report

    if args.step:
        return run_bench_steps(args)
    topology = topology_from_args(args)
    config = FusedBenchConfig(
        ops=tuple(op.strip() for op in args.op.split(",") if op.strip()),
        iters=args.repeats,
        warmup=args.warmup,
        chunks=args.chunks,
        shapes=parse_shapes(args.shape),
        emulated=will_emulate(topology, args),
        control=args.control,
    )
    print(
        f"commfuse bench fused: {topology.describe()}, {config.iters} timed runs per variant (median)",
        file=sys.stderr,
    )
    return run_and_report(
        bench_fused_on_rank,
        config,
        topology,
        args,
        heading="Fused operators benchmark",
        columns=COLUMNS,
    )


def run_bench_steps(args: argparse.Namespace) -> int:
    """The ``--step`` form (same topology, shape and output flags): whole training steps."""
    from commfuse.bench.fused import parse_shapes
    from commfuse.bench.fused_steps import COLUMNS, StepBenchConfig, bench_steps_on_rank
    from commfuse.cli.bench.report import run_and_report

    topology = topology_from_args(args)
    config = StepBenchConfig(
        steps=tuple(s.strip() for s in args.step.split(",") if s.strip()),
        iters=args.repeats,
        warmup=args.warmup,
        chunks=args.chunks,
        shapes=parse_shapes(args.shape),
        emulated=will_emulate(topology, args),
        control=args.control,
    )
    print(
        f"commfuse bench fused --step: {topology.describe()}, {config.iters} steps per variant (median)",
        file=sys.stderr,
    )
    return run_and_report(
        bench_steps_on_rank,
        config,
        topology,
        args,
        heading="Fused training-step benchmark",
        columns=COLUMNS,
    )
