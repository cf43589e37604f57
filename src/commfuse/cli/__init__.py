"""The ``commfuse`` command: one module per sub-command, the shared parts in ``common``.

Every sub-command module has ``register(subparsers)``, which adds its parser and the function
it runs (``common.set_command``); ``main`` parses, runs it under the one error handler
(``common.run_command``) and returns the exit status. This package is the only place that parses
command lines; the library below it takes typed objects and explicit settings (besides this
package, only a rank's start-up in ``cluster/`` reads the environment).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from commfuse import __version__

#: Modules that each add one sub-command with ``register(subparsers)``, in help order.
_COMMAND_MODULES = (
    "commfuse.cli.launch",
    "commfuse.cli.net",
    "commfuse.cli.tune",
    "commfuse.cli.bench",
    "commfuse.cli.simulate",
    "commfuse.cli.train",
    "commfuse.cli.compare",
    "commfuse.cli.report",
)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``commfuse`` parser, every sub-command registered."""
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
    """Run ``commfuse`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    from commfuse.cli.common import run_command

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return run_command(args)
