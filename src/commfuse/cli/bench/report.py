"""Report a benchmark's records: the table, the A/A control's line, ``--json``, ``--markdown``
and ``--plot``, the same way for every ``commfuse bench`` sub-command.

Every ``bench`` command's ranks each return the same list of records (rank 0's is reported),
typed as the command's kind of record (``commfuse.bench.records``); the table and the control
line are those ``commfuse report`` prints from the ``--json`` file (``commfuse.cli.report``),
so a table in a report and the command's output never differ.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from commfuse.bench.records import Kind
from commfuse.cli.common import run_on_ranks
from commfuse.cli.output import write_file, write_output
from commfuse.cluster.topology import Topology

#: Writes a plot of the records to a path (``args.plot``).
Plot = Callable[[list[dict[str, Any]], str], None]


def _machine_summary() -> dict[str, Any]:
    """Date, Python, torch, platform, CPUs and processor of this machine, for a report."""
    import torch

    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def _network_title(records: list[dict[str, Any]], topology: Topology) -> str:
    """``topology``'s description, saying so where the job ran on plain loopback."""
    emulated = bool(records and records[0].get("emulated"))
    return f"{topology.describe()}{'' if emulated else ' (NOT emulated: plain loopback)'}"


def _report_records(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    *,
    kind: Kind,
    title: str,
    heading: str,
    plot: Plot | None = None,
) -> int:
    """Print ``title``, the table of ``rows`` as records of ``kind`` and their A/A control
    line; write ``args.json``, a dated ``args.markdown`` report titled ``heading`` (command,
    table, control, machine) and ``args.plot`` with ``plot``. Exit code: 1 when a record has
    wrong elements, else 0 (a failed job raises, see ``common.run_command``)."""
    from commfuse.bench.records import dumps, of_kind
    from commfuse.cli.report import control_line, render_result

    typed = of_kind(kind, rows)
    records = [record.to_json() for record in typed]
    note = control_line(records)
    print(f"# {title}")
    print(render_result(records))
    if note:
        print(note)
    if args.json:
        write_output(args, args.json, dumps(typed))
    if args.markdown:
        machine = _machine_summary()
        lines = [
            f"# {heading}, {machine['date']}",
            "",
            f"Command: `commfuse {' '.join(sys.argv[1:])}`",
            "",
            title,
            "",
            render_result(records, markdown=True),
            "",
            note or "No A/A control in this run.",
            "",
            "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "date"),
            "",
        ]
        write_output(args, args.markdown, "\n".join(lines))
    if args.plot and plot is not None:
        write_file(args, args.plot, lambda path: plot(records, str(path)))
    return 0 if all(r.get("wrong", 0) == 0 for r in records) else 1


def run_and_report(
    fn: Callable[[Any], list[dict[str, Any]]],
    config: Any,
    topology: Topology,
    args: argparse.Namespace,
    *,
    kind: Kind,
    heading: str,
    title: Callable[[list[dict[str, Any]]], str] | None = None,
    plot: Plot | None = None,
) -> int:
    """``fn(config)`` on the ranks of ``topology``, then ``_report_records`` of rank 0's
    records as records of ``kind``; ``title`` makes the line above the table from them
    (default: the network)."""
    records = run_on_ranks(fn, config, topology=topology, args=args)[0]
    line = title(records) if title is not None else _network_title(records, topology)
    return _report_records(records, args, kind=kind, title=line, heading=heading, plot=plot)


def plot_steps(label: str) -> Plot:
    """The plot of ``bench ddp`` and ``bench strategies``: each row's median step (ms), its
    fastest and slowest round as a whisker, rows named by ``record[label]``."""

    def plot(records: list[dict[str, Any]], path: str) -> None:
        from commfuse.bench.plot import plot_bars

        plot_bars(
            records,
            path,
            label=lambda r: str(r[label]),
            bars=[("median step", "step_s")],
            scale=1e3,
            unit="step time (ms)",
            spread=("step_s_min", "step_s_max"),
        )

    return plot
