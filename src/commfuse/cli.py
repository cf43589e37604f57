"""The ``commfuse`` command. Each sub-command lives beside the code it drives and registers here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from commfuse import __version__


def build_parser() -> argparse.ArgumentParser:
    from commfuse.bench import cli as bench_cli
    from commfuse.cluster import launch_cli, net_cli

    parser = argparse.ArgumentParser(
        prog="commfuse",
        description="Spend less time communicating in distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"commfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch_cli.register(sub)
    net_cli.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print("commfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
