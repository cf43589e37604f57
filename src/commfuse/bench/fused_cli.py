"""``commfuse bench fused``: fused computation-collective operators against their unfused form.

commfuse bench fused --hosts 4 --link 1gbit --op gemm_allreduce,embedding_alltoall --json out.json
commfuse bench fused --hosts 4 --link 1gbit --step dlrm
commfuse bench fused --hosts 4 --link 1gbit --step tp-transformer,tp-transformer-sp
"""

from __future__ import annotations

import argparse
import sys


def register_bench(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from commfuse.bench.fused import OPS
    from commfuse.cluster.launch_cli import add_topology_arguments

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
        "batch x tables x rows x dim x pooling for embedding_alltoall and --step dlrm, "
        "seq x batch x d_model x heads x d_ff x layers for --step tp-transformer",
    )
    parser.add_argument(
        "--chunks",
        type=int,
        help="fix the number of chunks (default: cost model); 0: table by table, for "
        "embedding_alltoall and --step dlrm",
    )
    parser.add_argument("--iters", type=int, default=7, help="timed runs per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
    parser.add_argument(
        "--step",
        metavar="NAMES",
        help="time whole training steps of these workloads (comma list: dlrm, tp-transformer, "
        "tp-transformer-sp) instead of --op",
    )
    parser.add_argument("--markdown", metavar="PATH", help="write a dated Markdown report")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="stop the job after this many seconds"
    )
    parser.set_defaults(func=run_bench_fused)


def run_bench_fused(args: argparse.Namespace) -> int:
    if getattr(args, "step", None):
        from commfuse.bench.fused_steps import run_bench_steps

        return run_bench_steps(args)
    from commfuse.bench.fused import COLUMNS, FusedBenchConfig, bench_fused_on_rank, parse_shapes
    from commfuse.bench.report import run_and_report
    from commfuse.cluster.launch_cli import topology_from_args

    try:
        topology = topology_from_args(args)
        shapes = parse_shapes(args.shape)
        config = FusedBenchConfig(
            ops=tuple(op.strip() for op in args.op.split(",") if op.strip()),
            iters=args.iters,
            warmup=args.warmup,
            chunks=args.chunks,
            shapes=shapes,
        )
    except ValueError as err:
        print(f"commfuse bench fused: {err}", file=sys.stderr)
        return 2
    print(
        f"commfuse bench fused: {topology.describe()}, {config.iters} timed runs per variant (median)",
        file=sys.stderr,
    )
    return run_and_report(
        bench_fused_on_rank,
        config,
        topology,
        args,
        prog="commfuse bench fused",
        heading="Fused operators benchmark",
        columns=COLUMNS,
    )
