"""``commfuse bench fused``: fused computation-collective operators against their unfused form.

commfuse bench fused --hosts 4 --link 1gbit --op gemm_all_reduce,embedding_all_to_all --json out.json
commfuse bench fused --hosts 4 --link 1gbit --step dlrm
commfuse bench fused --hosts 4 --link 1gbit --step tp-transformer,tp-transformer-sp
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from commfuse.bench.records import Kind
from commfuse.cli.common import (
    Subparsers,
    add_job_command,
    require_at_least,
    topology_from_args,
    will_emulate,
)


def register(bench_sub: Subparsers) -> None:
    add_job_command(
        bench_sub,
        "fused",
        _run_bench_fused,
        help="fused operators vs unfused: compute C, comm M, unfused, fused, ideal max(C, M), ratios",
        doc=__doc__,
        arguments=_arguments,
        control="time the unfused reference twice per round (U and U'; with --step a second "
        "unfused model)",
        json="one record per row",
        plot="unfused, fused and ideal max(C, M) per row (PNG/SVG/PDF)",
        timeout_s=900.0,
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    from commfuse.bench.fused import FUSED_OPS

    parser.add_argument(
        "--op", default=",".join(FUSED_OPS), help=f"comma list of {', '.join(FUSED_OPS)}"
    )
    parser.add_argument(
        "--shape",
        action="append",
        metavar="AxBx...",
        help="shape to time instead of the defaults (repeatable): rows x in x out for the GEMMs, "
        "batch x tables x rows x dim x pooling for embedding_all_to_all and --step dlrm, "
        "seq x batch x d_model x heads x d_ff x layers for --step tp-transformer",
    )
    parser.add_argument(
        "--chunks", type=int, help="fix the number of chunks, >= 1 (default: cost model)"
    )
    parser.add_argument(
        "--schedule",
        choices=["by_table"],
        help="by_table: the embedding exchange table by table instead of chunks "
        "(embedding_all_to_all and --step dlrm only)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    parser.add_argument(
        "--step",
        metavar="NAMES",
        help="time whole training steps of these workloads (comma list: dlrm, tp-transformer, "
        "tp-transformer-sp) instead of --op",
    )


def _parse_shapes(specs: list[str] | None) -> tuple[tuple[int, ...], ...] | None:
    """``--shape`` values (``1024x2048x1024``, repeatable) as tuples of ints; None if none."""
    if not specs:
        return None
    try:
        return tuple(tuple(int(d) for d in s.lower().split("x")) for s in specs)
    except ValueError:
        raise ValueError(
            f"--shape takes integers joined by x (1024x2048x1024), got {specs}"
        ) from None


def _run_bench_fused(args: argparse.Namespace) -> int:
    """Operators (``--op``) or, with ``--step``, whole training steps of workloads; the same
    cluster, shape, chunk, repetition and output flags for both."""
    from commfuse.bench import fused, fused_steps
    from commfuse.cli.bench.report import run_and_report

    topology = topology_from_args(args)
    require_at_least("--repeats", args.repeats, 1)
    require_at_least("--warmup", args.warmup, 0)
    shared: dict[str, Any] = {
        "iters": args.repeats,
        "warmup": args.warmup,
        "chunks": args.chunks,
        "schedule": args.schedule,
        "shapes": _parse_shapes(args.shape),
        "emulated": will_emulate(topology, args),
        "control": args.control,
    }
    config: Any
    fn: Callable[[Any], list[dict[str, Any]]]
    kind: Kind = "bench fused --step" if args.step else "bench fused"
    if args.step:
        config = fused_steps.StepBenchConfig(steps=_names(args.step), **shared)
        fn = fused_steps.bench_steps_on_rank
        what, heading = "--step", "Fused training-step benchmark"
        unit = "steps"
    else:
        config = fused.FusedBenchConfig(ops=_names(args.op), **shared)
        fn = fused.bench_fused_on_rank
        what, heading = "", "Fused operators benchmark"
        unit = "timed runs"
    print(
        f"commfuse bench fused{' ' + what if what else ''}: {topology.describe()}, "
        f"{config.iters} {unit} per variant (median)",
        file=sys.stderr,
    )
    return run_and_report(fn, config, topology, args, kind=kind, heading=heading, plot=plot_rows)


def plot_rows(records: list[dict[str, Any]], path: str) -> None:
    """Unfused, fused and (operators only) the ideal max(C, M) of every row, in ms."""
    from commfuse.bench.plot import plot_bars

    bars = [("unfused", "unfused_us"), ("fused", "fused_us")]
    if all("ideal_us" in r for r in records):
        bars.append(("ideal max(C, M)", "ideal_us"))
    plot_bars(
        records,
        path,
        label=lambda r: f"{r['op']} {'x'.join(map(str, r['shape']))}",
        bars=bars,
        scale=1e-3,
        unit="time (ms)",
    )


def _names(text: str) -> tuple[str, ...]:
    """A comma list (``a,b``) as a tuple of its non-empty names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())
