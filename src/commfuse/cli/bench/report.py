"""Run a benchmark on every rank and report it: the table, ``--json`` and ``--markdown``.

Shared by the ``commfuse bench`` sub-commands whose ranks each return the same list of records
(rank 0's is reported) with a ``wrong`` count and an ``emulated`` flag.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.cli.common import run_on_ranks
from commfuse.cluster.topology import Topology


def machine_summary() -> dict[str, Any]:
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


def run_and_report(
    fn: Callable[[Any], list[dict[str, Any]]],
    config: Any,
    topology: Topology,
    args: argparse.Namespace,
    *,
    heading: str,
    columns: Sequence[tuple[str, Any]],
) -> int:
    """``fn(config)`` on the ranks of ``topology``; print the records as a table, write
    ``args.json`` and a dated ``args.markdown`` report titled ``heading``. Exit code: 1 when a
    record has wrong elements, else 0 (a failed job raises, see ``common.run_command``)."""
    from commfuse.bench.table import control_note, render

    records = run_on_ranks(fn, config, topology=topology, args=args)[0]
    emulated = bool(records and records[0]["emulated"])
    title = f"# {topology.describe()}{'' if emulated else ' (NOT emulated: plain loopback)'}"
    print(title)
    print(render(records, columns))
    note = control_note(records)
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.markdown:
        machine = machine_summary()
        lines = [
            f"# {heading}, {machine['date']}",
            "",
            f"Command: `{' '.join(sys.argv)}`",
            "",
            title.lstrip("# "),
            "",
            render(records, columns, markdown=True),
            "",
            note or "No A/A control in this run.",
            "",
            "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "date"),
            "",
        ]
        Path(args.markdown).write_text("\n".join(lines))
    return 0 if all(r["wrong"] == 0 for r in records) else 1
