"""``commfuse simulate``: predict step time (or one collective) on a cluster of any size.

commfuse simulate --ranks 1024                                   # default workload and cluster
commfuse simulate --workload dlrm --ranks 1024 --chunks 1,8     # fused vs unfused All-to-All
commfuse simulate --cluster two-dc --ranks 256 --strategy what-if \
    --strategy what-if:local_sgd_period=100                       # DP vs syncing every 100 steps
commfuse simulate --ranks 256 --strategy ddp --strategy powersgd:rank=4 --strategy diloco:H=50
commfuse simulate --op broadcast --sizes 16M --algo lp,tree --scale 2:1024 --plot b.png
commfuse simulate --op all_reduce --sizes 64K:64M --algo ring,rabenseifner --ranks 1024
commfuse simulate --validate --runs 3 --json validation.json      # real runs on netlab
commfuse simulate --validate --save-cluster c.json; commfuse simulate --cluster c.json ...

Each --strategy gives one series: a `commfuse train` strategy spec, priced from its typed
config (its compressor's message per bucket, its period H), or a plan no strategy makes,
`what-if:algo=NAME,compression_ratio=R,local_sgd_period=H`. --chunks (the fused operators'
chunks) and --compression-gbps (the machine's compression rate) apply to every series, and a
comma list in --chunks multiplies them. --algo, --compression-ratio and --local-sgd-period are
what-if's keys as flags (comma lists in --algo and --local-sgd-period give one series each).
--scale gives a table (and --plot a PNG) over rank counts. --op prices one collective instead of a step: one series per --algo, one row
per size of --sizes (the vocabulary of `bench collectives --sizes`) and rank count.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Any

from commfuse.bench.records import of_kind, to_text
from commfuse.cli.common import (
    Subparsers,
    add_bucket_cap_argument,
    add_command,
    add_output_arguments,
    output_path,
    require_at_least,
)
from commfuse.cli.output import write_file, write_output
from commfuse.cli.spec import build, parse_value, split_spec
from commfuse.units import format_size, parse_sizes


def register(sub: Subparsers) -> None:
    from commfuse.sim.builtins import MODEL_PROFILES
    from commfuse.sim.cluster import PRESETS

    parser = add_command(
        sub,
        "simulate",
        _run_simulate,
        help="predict step time and its breakdown on a cluster of hundreds to thousands of ranks",
        doc=__doc__,
    )
    parser.add_argument(
        "--cluster",
        default="dgx-h100",
        help=f"preset ({', '.join(PRESETS)}) or cluster JSON (default dgx-h100)",
    )
    parser.add_argument("--profile", help="a `commfuse tune` profile whose corrections apply")
    parser.add_argument("--ranks", type=int, help="ranks to simulate (default: the cluster's)")
    parser.add_argument(
        "--workload",
        default="transformer",
        metavar="NAME[:key=value,...]",
        help=f"built-in workload ({', '.join(sorted(MODEL_PROFILES))}) with its sizes as "
        "for `commfuse train`, e.g. transformer:num_layers=48 (default transformer, 1.3B "
        "parameters)",
    )
    parser.add_argument(
        "--op", help="price this collective instead of a step (all_reduce, broadcast, ...)"
    )
    parser.add_argument(
        "--sizes",
        default="16M",
        help="with --op: message sizes, comma list (4K,1M) or doubling range (4K:64M) "
        "(default 16M)",
    )
    parser.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="SPEC",
        help="a training strategy, as for `commfuse train`, or what-if:algo=NAME,"
        "compression_ratio=R,local_sgd_period=H (repeat for several series)",
    )
    parser.add_argument(
        "--algo",
        default="auto",
        help="with --op: algorithm(s), comma list; else what-if's algo (--strategy what-if:algo=)",
    )
    add_bucket_cap_argument(parser)
    parser.add_argument("--no-overlap", action="store_true", help="all_reduce after backward")
    parser.add_argument(
        "--compression-ratio",
        type=float,
        default=1.0,
        help="what-if's compression_ratio (--strategy what-if:compression_ratio=R)",
    )
    parser.add_argument(
        "--compression-gbps",
        type=float,
        default=0.0,
        help="compression + decompression rate, GB/s of input (0: free)",
    )
    parser.add_argument(
        "--chunks", default="1", help="fused operators' chunks, comma list (1: unfused)"
    )
    parser.add_argument(
        "--local-sgd-period",
        default="1",
        help="what-if's local_sgd_period, comma list (--strategy what-if:local_sgd_period=H)",
    )
    parser.add_argument(
        "--straggler", action="append", default=[], metavar="RANK:SLOWDOWN[:DELAY_US]"
    )
    parser.add_argument("--scale", help="rank counts: comma list or doubling range (2:1024)")
    parser.add_argument(
        "--trace", metavar="PATH", type=output_path, help="write a Chrome trace of rank 0's step"
    )
    add_output_arguments(parser, json="the records", plot="the curve over --scale (PNG)")
    parser.add_argument(
        "--validate",
        action="store_true",
        help="run configurations for real on the emulated cluster and print the error",
    )
    parser.add_argument("--hosts", type=int, default=4, help="with --validate: emulated hosts")
    parser.add_argument("--link", default="1gbit", help="with --validate: link rate")
    parser.add_argument(
        "--quick", action="store_true", help="with --validate: fewer configurations"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="with --validate: calibrate and validate N times"
    )
    parser.add_argument(
        "--repeats", type=int, help="with --validate: timed runs per configuration (default 7)"
    )
    parser.add_argument(
        "--save-cluster",
        metavar="PATH",
        type=output_path,
        help="with --validate: write the calibrated cluster JSON (then --cluster PATH)",
    )


def _parse_ranks(text: str) -> list[int]:
    """``"1,2,4"`` or a doubling range ``"2:1024"``."""
    ranks: list[int] = []
    for part in text.split(","):
        try:
            bounds = [int(x) for x in part.split(":", 1)]
        except ValueError:
            raise ValueError(
                f"bad --scale {text!r}: use a comma list (1,2,4) or a range (2:1024)"
            ) from None
        if len(bounds) == 2:
            lo, hi = bounds
            if lo > hi:
                raise ValueError(f"bad --scale {text!r}: a range runs from low to high ({hi}:{lo})")
            r = lo
            while 0 < r <= hi:
                ranks.append(r)
                r *= 2
        else:
            ranks.append(bounds[0])
    if not ranks or min(ranks) < 1:
        raise ValueError(f"bad --scale {text!r}: rank counts must be >= 1")
    return ranks


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes integers, comma separated, got {text!r}") from None


#: The name of ``--strategy``'s plan that no training strategy makes.
_WHAT_IF = "what-if"


def _what_if(
    *,
    algo: str = "auto",
    compression_ratio: float = 1.0,
    local_sgd_period: int = 1,
    bucket_cap_mb: float,
    overlap: bool,
    compression_gbyte_per_s: float,
    fused_chunks: int,
) -> Any:
    """The plan of ``what-if:algo=NAME,compression_ratio=R,local_sgd_period=H`` (its keys: the
    algorithm of every collective, the bytes sent over the bytes of the gradients, the steps
    between synchronisations), with the settings every series shares (the flags)."""
    from commfuse.sim.plan import CommPlan

    return CommPlan(
        algorithm=algo,
        bucket_cap_mb=bucket_cap_mb,
        overlap=overlap,
        compression_ratio=compression_ratio,
        compression_gbyte_per_s=compression_gbyte_per_s,
        fused_chunks=fused_chunks,
        local_sgd_period=local_sgd_period,
    )


def _what_if_flags(args: argparse.Namespace, chunks: list[int]) -> list[tuple[str, str, int]]:
    """``(label, what-if spec, chunks)`` per series the what-if flags give (--algo,
    --chunks and --local-sgd-period comma lists, --compression-ratio), labelled by what
    varies."""
    algos = args.algo.split(",")
    periods = _ints(args.local_sgd_period, "--local-sgd-period")
    out = []
    for algo, k, h in itertools.product(algos, chunks, periods):
        label = (
            ",".join(
                part
                for part, many in (
                    (algo, len(algos) > 1),
                    (f"fused x{k}" if k > 1 else "unfused", len(chunks) > 1),
                    (f"sync/{h}", len(periods) > 1),
                )
                if many
            )
            or "step"
        )
        spec = f"{_WHAT_IF}:algo={algo},compression_ratio={args.compression_ratio!r},"
        out.append((label, spec + f"local_sgd_period={h}", k))
    return out


def _plans(args: argparse.Namespace) -> dict[str, Any]:
    """Every series' plan by its label: one per --strategy and --chunks value (or per the
    what-if flags' values without a --strategy)."""
    chunks = _ints(args.chunks, "--chunks")
    if not args.strategy:
        series = _what_if_flags(args, chunks)
    else:
        what_if = [
            flag
            for flag, given in (
                ("--algo", args.algo != "auto"),
                ("--compression-ratio", args.compression_ratio != 1.0),
                ("--local-sgd-period", args.local_sgd_period != "1"),
            )
            if given
        ]
        if what_if:
            raise ValueError(
                f"--strategy sets what {', '.join(what_if)} would: give one or the other "
                "(with --strategy, a what-if plan is --strategy what-if:algo=NAME,"
                "compression_ratio=R,local_sgd_period=H)"
            )
        series = [
            (spec.strip() + (f",fused x{k}" if len(chunks) > 1 else ""), spec, k)
            for spec, k in itertools.product(args.strategy, chunks)
        ]
    return {label: _plan_of(spec, k, args) for label, spec, k in series}


def _plan_of(text: str, chunks: int, args: argparse.Namespace) -> Any:
    """The plan of one series: a what-if spec's, or a training strategy's (``plan_for``,
    which imports torch: a what-if plan does not)."""
    shared = {
        "bucket_cap_mb": args.bucket_cap_mb,
        "overlap": not args.no_overlap,
        "compression_gbyte_per_s": args.compression_gbps,
        "fused_chunks": chunks,
    }
    spec = split_spec(text, what="strategy")
    if spec.name == _WHAT_IF:
        return build(_what_if, spec.options, where=f"strategy {_WHAT_IF}", fixed=shared)
    from commfuse.cli.spec import strategy_from_spec
    from commfuse.train.sim_plan import plan_for

    return plan_for(strategy_from_spec(text), **shared)


def _cluster(args: argparse.Namespace) -> Any:
    from commfuse.sim.cluster import Straggler, load_cluster

    cluster = load_cluster(args.cluster)
    if args.profile:
        cluster = dataclasses.replace(cluster, profile_path=args.profile)
    if args.ranks is not None:
        require_at_least("--ranks", args.ranks, 1)
        cluster = cluster.with_ranks(args.ranks)
    stragglers = []
    for text in args.straggler:
        parts = text.split(":")
        try:
            stragglers.append(
                Straggler(
                    rank=int(parts[0]),
                    slowdown=float(parts[1]),
                    delay_us=float(parts[2]) if len(parts) > 2 else 0.0,
                )
            )
        except (ValueError, IndexError):
            raise ValueError(f"bad --straggler {text!r}: use RANK:SLOWDOWN[:DELAY_US]") from None
    if stragglers:
        cluster = dataclasses.replace(cluster, stragglers=tuple(stragglers))
    return cluster


def _run_simulate(args: argparse.Namespace) -> int:
    if args.validate:
        from commfuse.bench.sim_validate import run_validation

        return run_validation(
            hosts=args.hosts,
            link=args.link,
            json_path=args.json,
            quick=args.quick,
            reps=args.repeats,
            runs=args.runs,
            profile=args.profile,
            cluster_path=args.save_cluster,
            write=lambda path, text: write_output(args, path, text),
        )
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from commfuse.sim import scale
    from commfuse.sim.builtins import MODEL_PROFILES
    from commfuse.sim.step import chrome_trace, simulate_step

    cluster = _cluster(args)
    ranks = _parse_ranks(args.scale) if args.scale else [cluster.world_size]
    print(
        f"cluster {cluster.name}: {cluster.ranks_per_host} ranks/host, "
        f"{cluster.inter_gbit_per_s:g} Gbit/s per host, {cluster.flops_per_s / 1e12:g} TFLOP/s "
        f"per rank"
        + (
            f", {cluster.num_datacenters} data centers at {cluster.interdc_gbit_per_s:g} Gbit/s"
            if cluster.num_datacenters > 1
            else ""
        )
    )
    if args.op:
        sizes_bytes = parse_sizes(args.sizes)
        records = [
            {"bytes": nbytes, **record}
            for nbytes in sizes_bytes
            for record in scale.collective_curve(
                cluster, args.op, args.algo.split(","), nbytes, ranks
            )
        ]
        title = f"{args.op} {args.sizes} on {cluster.name}"
    else:
        workload = split_spec(args.workload, what="workload")
        if workload.name not in MODEL_PROFILES:
            known = ", ".join(sorted(MODEL_PROFILES))
            raise ValueError(f"unknown workload {workload.name!r}; known: {known}")
        where = f"workload {workload.name}"
        # Every built-in workload's settings are sizes: whole numbers.
        sizes = {
            key: parse_value(value, int, key=key, where=where)
            for key, value in workload.options.items()
        }
        factory: Any = MODEL_PROFILES[workload.name]

        def make(p: int) -> Any:
            extra = {"world_size": p} if workload.name == "dlrm" else {}
            try:
                return factory(**sizes, **extra)
            except TypeError as err:
                raise ValueError(f"{where}: {err}") from None

        plans = _plans(args)
        if len(ranks) == 1 and len(plans) == 1:
            return _one(
                cluster.with_ranks(ranks[0]),
                make(ranks[0]),
                next(iter(plans.values())),
                args,
                chrome_trace,
                simulate_step,
            )
        records = scale.step_curve(cluster, make, plans, ranks)
        title = f"{workload.text} step on {cluster.name}"
    from commfuse.cli.report import render_result

    records = [record.to_json() for record in of_kind("simulate --scale", records)]
    print(render_result(records))
    if args.plot:
        if len({r.get("bytes") for r in records}) > 1:  # a line per algorithm and size
            records_to_plot = [
                {**r, "series": f"{r['series']} {format_size(r['bytes'])}"} for r in records
            ]
        else:
            records_to_plot = records
        plotted = write_file(
            args, args.plot, lambda p: scale.plot_curve(records_to_plot, p, title=title)
        )
        if plotted is not None:
            print(f"plot written to {plotted}")
    if args.json:
        write_output(args, args.json, to_text("simulate --scale", records))
    return 0


def _one(
    cluster: Any,
    workload: Any,
    plan: Any,
    args: argparse.Namespace,
    chrome_trace: Any,
    simulate_step: Any,
) -> int:
    import time

    began = time.perf_counter()
    result = simulate_step(cluster, workload, plan)
    took = time.perf_counter() - began
    r = result.as_dict()
    step = r["step_us"]
    print(
        f"workload {workload.name}: {workload.param_bytes / 1e9:.2f} GB of parameters per rank, "
        f"{workload.flops / 1e12:.2f} TFLOP per step per rank; plan {plan.describe()}"
    )
    print(
        f"predicted step on {cluster.world_size} ranks: {step / 1e3:.3f} ms "
        f"(simulated in {took * 1e3:.0f} ms)"
    )
    for key, label in (
        ("compute_us", "compute"),
        ("exposed_comm_us", "exposed communication"),
        ("overlapped_comm_us", "overlapped communication"),
    ):
        print(f"  {label:<26} {r[key] / 1e3:>10.3f} ms  {r[key] / step * 100:>5.1f}% of the step")
    for kind, us in r["comm_us"].items():
        print(f"  {kind + ' collectives in flight':<26} {us / 1e3:>10.3f} ms")
    if args.trace:
        ranks = [0, *[s.rank for s in cluster.stragglers[:3]]]
        events: list[int] = []
        traced = write_file(
            args,
            args.trace,
            lambda p: events.append(chrome_trace(result.timeline, p, ranks=ranks)),
        )
        if traced is not None:
            print(f"Chrome trace ({events[-1]} events) written to {traced}")
    if args.json:
        write_output(args, args.json, to_text("simulate", {"ranks": cluster.world_size, **r}))
    return 0
