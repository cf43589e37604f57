"""``commfuse bench collectives``: time collectives over a size sweep, nccl-tests style.

commfuse bench collectives --hosts 4 --link 1gbit --op all_reduce --sizes 16M --json out.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    add_job_command,
    require_at_least,
    topology_from_args,
    will_emulate,
)
from commfuse.units import parse_sizes

#: The embedded default: a short sweep on an emulated 4-host, 1 Gbit/s cluster.
DEFAULT_SIZES = "64K,1M,16M"
_DEFAULT_OPS = "all_reduce,broadcast,all_gather"
#: A sample of one small-message call is mostly scheduling jitter; a loop of calls is not.
_DEFAULT_MIN_SAMPLE_MS = 20.0


def register(bench_sub: Subparsers) -> None:
    add_job_command(
        bench_sub,
        "collectives",
        _run_bench_collectives,
        help="time collectives over a size sweep: time, algbw, busbw, percent of link, wrong elements",
        doc=__doc__,
        arguments=_arguments,
        control="time the first algorithm twice (the second with buffers of its own)",
        json="one record per row",
        plot="busbw vs size, one line per algorithm (PNG/SVG/PDF)",
        timeout_s=600.0,
    )


def _arguments(coll: argparse.ArgumentParser) -> None:
    coll.add_argument(
        "--op", default=_DEFAULT_OPS, help=f"comma list of collectives (default {_DEFAULT_OPS})"
    )
    coll.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma list (4K,1M) or doubling range (4K:64M) (default {DEFAULT_SIZES})",
    )
    coll.add_argument(
        "--algo",
        default="native",
        help="comma list of algorithms timed side by side (all = every one; auto = the tuner's pick); "
        "the first is the baseline of the x-first column; rounds run in balanced orders",
    )
    coll.add_argument(
        "--repeats", type=int, default=10, help="timed runs per row; the median is reported"
    )
    coll.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    coll.add_argument(
        "--min-sample-ms",
        type=float,
        default=_DEFAULT_MIN_SAMPLE_MS,
        help="repeat the call back to back within each timed sample until the fastest algorithm's "
        f"sample lasts this long (0: one call per sample) (default {_DEFAULT_MIN_SAMPLE_MS:g})",
    )
    coll.add_argument(
        "--tuner-trial-calls",
        type=int,
        default=0,
        metavar="K",
        help="auto tries native and the model's two fastest other algorithms on the first calls of "
        "each size, K timed calls each, and keeps the fastest (CommConfig.tuner_trial_calls); the "
        "trial runs before timing and its medians are in the JSON (default 0: the model alone)",
    )
    coll.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "float16", "bfloat16", "int32", "int64"],
    )


def _run_bench_collectives(args: argparse.Namespace) -> int:
    from commfuse.bench.collectives import (
        CollectiveBenchConfig,
        bench_collectives_on_rank,
    )
    from commfuse.cli.bench.report import run_and_report

    topology = topology_from_args(args)
    if topology.world_size < 2:
        raise ValueError(
            "bench collectives needs at least 2 ranks (one rank's collective moves nothing "
            "over a link): --hosts 2 or more, or --ranks-per-host 2 or more"
        )
    require_at_least("--repeats", args.repeats, 1)
    require_at_least("--warmup", args.warmup, 0)
    require_at_least("--tuner-trial-calls", args.tuner_trial_calls, 0)
    if args.min_sample_ms < 0:
        raise ValueError(f"--min-sample-ms must be at least 0, got {args.min_sample_ms:g}")
    config = CollectiveBenchConfig(
        ops=tuple(op.strip() for op in args.op.split(",") if op.strip()),
        sizes_bytes=tuple(parse_sizes(args.sizes)),
        iters=args.repeats,
        warmup=args.warmup,
        dtype=args.dtype,
        algos=tuple(a.strip() for a in args.algo.split(",") if a.strip()),
        emulated=will_emulate(topology, args),
        control=args.control,
        min_sample_ms=args.min_sample_ms,
        tuner_trial_calls=args.tuner_trial_calls,
    )
    _check_algo_names(config.ops, config.algos)  # fail here, before any rank starts
    print(
        f"commfuse bench collectives: {topology.describe()}, {config.iters} timed runs per row (median)",
        file=sys.stderr,
    )
    from commfuse.bench.plot import plot_busbw

    def plot(records: list[dict[str, Any]], path: str) -> None:
        plot_busbw(records, path, title=topology.describe())

    return run_and_report(
        bench_collectives_on_rank,
        config,
        topology,
        args,
        kind="bench collectives",
        heading="Collectives benchmark",
        plot=plot,
    )


def _check_algo_names(ops: tuple[str, ...], algos: tuple[str, ...]) -> None:
    """ValueError for an algorithm name that none of the ops has."""
    from commfuse.bench.collectives import expand_algos

    for algo in algos:
        if algo in ("all", "auto"):
            continue
        if not any(expand_algos(op, (algo,)) for op in ops):
            expand_algos(ops[0], (algo,), strict=True)  # raises, naming the known ones
