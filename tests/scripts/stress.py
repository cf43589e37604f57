"""Run a command on a loaded machine: ``commfuse.testing.under_stress`` from the shell, a tool
for commfuse's own developers (does a test, or the whole suite, pass on a busy machine?).

    python tests/scripts/stress.py --cpu 8 --memory-mb 512 -- python -m pytest -q tests

The exit status is the command's; the load is killed by PID when the command ends.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from commfuse.testing.stress import StressConfig, cores, under_stress


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``[--cpu N] [--memory-mb M] [--disk-mb D] -- CMD`` and run ``CMD`` under load."""
    parser = argparse.ArgumentParser(
        prog="python tests/scripts/stress.py",
        description="Run a command while busy processes load every core (and optionally "
        "memory and disk); the load is killed when the command ends.",
    )
    parser.add_argument("--cpu", type=int, default=None, help="busy processes (two per core)")
    parser.add_argument("--memory-mb", type=int, default=0, help="MiB held and touched")
    parser.add_argument("--disk-mb", type=int, default=0, help="MiB written over and over")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        config = StressConfig(num_cpu=args.cpu, memory_mb=args.memory_mb, disk_mb=args.disk_mb)
    except ValueError as error:
        parser.error(str(error))
    with under_stress(
        num_cpu=config.num_cpu, memory_mb=config.memory_mb, disk_mb=config.disk_mb
    ) as s:
        print(
            f"stress: {config.cpu_processes} busy processes on {cores()} cores, "
            f"{config.memory_mb} MiB memory, {config.disk_mb} MiB disk (pids {s.pids})",
            file=sys.stderr,
            flush=True,
        )
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
