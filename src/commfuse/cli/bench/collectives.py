"""``commfuse bench collectives``: time collectives over a size sweep, nccl-tests style.

commfuse bench collectives --hosts 4 --link 1gbit --op all_reduce --sizes 16M --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    add_control_argument,
    add_device_arguments,
    add_output_arguments,
    add_timeout_argument,
    add_topology_arguments,
    require_at_least,
    run_on_ranks,
    set_command,
    topology_from_args,
    will_emulate,
)
from commfuse.units import parse_sizes

#: The embedded default: a short sweep on an emulated 4-host, 1 Gbit/s cluster.
DEFAULT_SIZES = "64K,1M,16M"
DEFAULT_OPS = "all_reduce,broadcast,all_gather"


def register(bench_sub: Subparsers) -> None:
    coll = bench_sub.add_parser(
        "collectives",
        help="time collectives over a size sweep: time, algbw, busbw, percent of link, wrong elements",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(coll, default_hosts=4, default_link="1gbit")
    add_device_arguments(coll)
    coll.add_argument(
        "--op", default=DEFAULT_OPS, help=f"comma list of collectives (default {DEFAULT_OPS})"
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
        "--dtype",
        default="float32",
        choices=["float32", "float64", "float16", "bfloat16", "int32", "int64"],
    )
    add_control_argument(
        coll, what="time the first algorithm twice (the second with buffers of its own)"
    )
    add_output_arguments(
        coll,
        json="one record per row",
        markdown="a dated report (table, machine, versions)",
        plot="busbw vs size, one line per algorithm (PNG/SVG/PDF)",
    )
    add_timeout_argument(coll, default_s=600.0)
    set_command(coll, run_bench_collectives)


def run_bench_collectives(args: argparse.Namespace) -> int:
    from commfuse.bench.collectives import (
        CollectiveBenchConfig,
        bench_collectives_on_rank,
    )
    from commfuse.bench.table import control_note, render

    topology = topology_from_args(args)
    require_at_least("--repeats", args.repeats, 1)
    config = CollectiveBenchConfig(
        ops=tuple(op.strip() for op in args.op.split(",") if op.strip()),
        sizes_bytes=tuple(parse_sizes(args.sizes)),
        iters=args.repeats,
        warmup=args.warmup,
        dtype=args.dtype,
        algos=tuple(a.strip() for a in args.algo.split(",") if a.strip()),
        emulated=will_emulate(topology, args),
        control=args.control,
    )
    check_algo_names(config.ops, config.algos)  # fail here, before any rank starts
    print(
        f"commfuse bench collectives: {topology.describe()}, {config.iters} timed runs per row (median)",
        file=sys.stderr,
    )
    results = run_on_ranks(bench_collectives_on_rank, config, topology=topology, args=args)
    records = results[0]
    emulated = bool(records and records[0]["emulated"])
    print(f"# {topology.describe()}{'' if emulated else ' (NOT emulated: plain loopback)'}")
    print(render(records))
    note = control_note(records, "algorithm")
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.plot:
        from commfuse.bench.plot import plot_busbw

        plot_busbw(records, args.plot, title=topology.describe())
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(records, " ".join(sys.argv), emulated))
    return 0 if all(r["wrong"] == 0 for r in records) else 1


def check_algo_names(ops: tuple[str, ...], algos: tuple[str, ...]) -> None:
    """ValueError for an algorithm name that none of the ops has."""
    from commfuse.bench.collectives import expand_algos

    for algo in algos:
        if algo in ("all", "auto"):
            continue
        if not any(expand_algos(op, (algo,)) for op in ops):
            expand_algos(ops[0], (algo,), strict=True)  # raises, naming the known ones


def markdown_report(records: list[dict[str, Any]], command: str, emulated: bool) -> str:
    """A dated Markdown report of the collectives table, with the command and the machine."""
    from commfuse.bench.table import control_note, render
    from commfuse.cli.bench.report import machine_summary

    machine = machine_summary()
    lines = [
        f"# Collectives benchmark, {machine['date']}",
        "",
        f"Command: `{command}`",
        "",
        f"Network: {'emulated (netlab: namespaces, veth, tbf)' if emulated else 'plain loopback (not emulated)'}",
        "",
        render(records, markdown=True),
        "",
        control_note(records, "algorithm") or "No A/A control in this run.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "date"),
        "",
    ]
    return "\n".join(lines)
