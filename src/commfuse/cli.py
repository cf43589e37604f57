"""The ``commfuse`` command. Each sub-command lives beside the code it drives and registers here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from commfuse import __version__

#: Modules that each add one sub-command with ``register(subparsers)``, in help order.
_COMMAND_MODULES = (
    "commfuse.cluster.launch_cli",
    "commfuse.cluster.net_cli",
    "commfuse.collectives.tune_cli",
    "commfuse.bench.cli",
    "commfuse.sim.cli",
    "commfuse.train.train_cli",
    "commfuse.train.compare_cli",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="commfuse",
        description="Spend less time communicating in distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"commfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub)
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
