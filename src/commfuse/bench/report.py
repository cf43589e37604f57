"""Run a benchmark on every rank and report it: the table, ``--json`` and ``--markdown``.

Shared by the ``commfuse bench`` sub-commands whose ranks each return the same list of records
(rank 0's is reported) with a ``wrong`` count and an ``emulated`` flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.cluster.topology import Topology


def run_and_report(
    fn: Callable[[Any], list[dict[str, Any]]],
    config: Any,
    topology: Topology,
    args: argparse.Namespace,
    *,
    prog: str,
    heading: str,
    columns: Sequence[tuple[str, Any]],
) -> int:
    """``fn(config)`` on the ranks of ``topology``; print the records as a table, write
    ``args.json`` and a dated ``args.markdown`` report titled ``heading``. Exit code: 1 when the
    job failed or a record has wrong elements, else 0."""
    from commfuse.bench.cli import machine_summary
    from commfuse.bench.table import render
    from commfuse.cluster import DeadlineExceeded, RankError, run
    from commfuse.cluster.netlab import NetlabError

    try:
        results = run(
            fn,
            config,
            net=topology,
            emulate=False if args.no_emulate else None,
            timeout_s=args.timeout,
        )
    except (RankError, DeadlineExceeded, NetlabError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    records = results[0]
    emulated = bool(records and records[0]["emulated"])
    title = f"# {topology.describe()}{'' if emulated else ' (NOT emulated: plain loopback)'}"
    print(title)
    print(render(records, columns))
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
            "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "date"),
            "",
        ]
        Path(args.markdown).write_text("\n".join(lines))
    return 0 if all(r["wrong"] == 0 for r in records) else 1
