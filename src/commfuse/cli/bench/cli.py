"""``commfuse bench cli``: wall time of ``commfuse`` commands end to end, across source trees.

commfuse bench cli --command=--help --command "simulate --ranks 16384" --command "import commfuse.sim"
commfuse bench cli --tree old=/path/to/old/src --tree new=src --repeats 10 --control --json out.json

Each sample is the whole command in a fresh interpreter (start, imports, work, exit) with
PYTHONPATH set to the tree's src, so two checkouts compare on the same Python and packages. Per
command the trees run in balanced rounds (an order, then its reverse); ratios are to the first
tree, the median over rounds of the same round's ratio; --control times the first tree twice
(A/A). Each record also says whether the command imported torch and its slowest imports
(python -X importtime). See ``commfuse.bench.cli_latency``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    add_control_argument,
    add_output_arguments,
    require_at_least,
    set_command,
)

#: Commands timed when no --command is given.
DEFAULT_COMMANDS = (
    "--help",
    "simulate --ranks 1024",
    "simulate --ranks 16384",
    "import commfuse.sim",
)


def register(bench_sub: Subparsers) -> None:
    parser = bench_sub.add_parser(
        "cli",
        help="wall time of commfuse commands end to end (fresh interpreters), across source trees",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="ARGS",
        help="commfuse arguments to time, or 'import X'; repeat (default: "
        + "; ".join(DEFAULT_COMMANDS)
        + ")",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="a source tree (the src folder of a checkout); repeat, the first is the baseline "
        "(default: this=the src this commfuse runs from)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (default 10)")
    add_control_argument(parser, what="time the first tree twice (NAME')")
    add_output_arguments(
        parser,
        json="one record per command and tree",
        markdown="a dated report (table, machine, versions)",
        plot="each command's median wall time per tree, fastest to slowest round (PNG/SVG/PDF)",
    )
    set_command(parser, run_bench_cli)


def _trees(texts: list[str]) -> tuple[tuple[str, str], ...]:
    if not texts:
        import commfuse

        return (("this", str(Path(commfuse.__file__).resolve().parents[1])),)
    trees = []
    for text in texts:
        name, eq, src = text.partition("=")
        if not eq or not name.strip() or not src.strip():
            raise ValueError(f"bad --tree {text!r}: use NAME=SRC, e.g. old=../old/src")
        trees.append((name.strip(), str(Path(src.strip()).resolve())))
    return tuple(trees)


def _plot(records: list[dict[str, Any]], path: str) -> None:
    from commfuse.bench.plot import plot_bars

    plot_bars(
        records,
        path,
        label=lambda r: f"{r['command']} [{r['tree']}]",
        bars=[("median wall time", "wall_s")],
        scale=1e3,
        unit="wall time of the whole command (ms)",
        spread=("wall_s_min", "wall_s_max"),
    )


def run_bench_cli(args: argparse.Namespace) -> int:
    from commfuse.bench.cli_latency import CliLatencyConfig, bench_cli_latency
    from commfuse.cli.bench.report import report_records

    require_at_least("--repeats", args.repeats, 1)
    config = CliLatencyConfig(
        commands=tuple(args.command or DEFAULT_COMMANDS),
        trees=_trees(args.tree),
        rounds=args.repeats,
        control=args.control,
        environment=dict(os.environ),
    )
    print(
        f"commfuse bench cli: {len(config.commands)} command(s) x {len(config.trees)} tree(s), "
        f"{config.rounds} rounds (balanced orders), fresh interpreters",
        file=sys.stderr,
    )
    records = bench_cli_latency(config)
    trees = ", ".join(f"{name}={src}" for name, src in config.trees)
    return report_records(
        records,
        args,
        title=f"whole commands in fresh interpreters on {config.python}; trees {trees}",
        heading="Wall time of commfuse commands",
        plot=_plot,
    )
