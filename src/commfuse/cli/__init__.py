"""The ``commfuse`` command: one module per sub-command, the shared parts in ``common``.

Every sub-command module has ``register(subparsers)``, which adds its parser and the function
it runs (``common.set_command``); ``main`` parses, runs it under the one error handler
(``common.run_command``) and returns the exit status. This package is the only place that parses
command lines; the library below it takes typed objects and explicit settings (besides this
package, only a rank's start-up in ``cluster/`` reads the environment).

``main`` imports only the module of the sub-command it runs: the others appear in the
top-level help as their one line (``COMMANDS``), so ``commfuse --help``, an argument error and
``commfuse simulate`` import neither torch nor the training stack (the command modules import
their heavy parts inside the functions that run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Collection, Sequence

from commfuse import __version__


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CommandEntry:
    """One sub-command of ``commfuse``: its name, the module that registers it, its help line."""

    name: str
    """What the user types (``commfuse simulate``)."""
    module: str
    """The module whose ``register(subparsers)`` adds the sub-command's parser."""
    summary: str
    """Its line in ``commfuse --help``; the module's ``register`` gives the same one (a test
    holds them equal)."""


#: Every sub-command, in help order.
COMMANDS: tuple[_CommandEntry, ...] = (
    _CommandEntry(
        name="launch",
        module="commfuse.cli.launch",
        summary="run a torchrun-style script on N local ranks (optionally on an emulated cluster)",
    ),
    _CommandEntry(
        name="net",
        module="commfuse.cli.net",
        summary="emulated cluster: network namespaces with shaped links (needs root)",
    ),
    _CommandEntry(
        name="tune",
        module="commfuse.cli.tune",
        summary="calibrate alpha/beta/gamma and every algorithm, write a profile, print the "
        "algorithm algo='auto' picks per size",
    ),
    _CommandEntry(
        name="bench",
        module="commfuse.cli.bench",
        summary="benchmarks (nccl-tests style tables, --json records)",
    ),
    _CommandEntry(
        name="simulate",
        module="commfuse.cli.simulate",
        summary="predict step time and its breakdown on a cluster of hundreds to thousands "
        "of ranks",
    ),
    _CommandEntry(
        name="train",
        module="commfuse.cli.train",
        summary="train a workload (charlm, digits) on N ranks with one strategy",
    ),
    _CommandEntry(
        name="compare",
        module="commfuse.cli.compare",
        summary="train several strategies on the same workload; table of step time, bytes, loss",
    ),
    _CommandEntry(
        name="report",
        module="commfuse.cli.report",
        summary="print result JSON files as the tables their commands printed "
        "(--markdown: as Markdown)",
    ),
)


def build_parser(registered: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``commfuse`` parser with every sub-command registered (``registered=None``), or only
    those named in ``registered``, the others standing as their help line alone."""
    parser = argparse.ArgumentParser(
        prog="commfuse",
        description="Spend less time communicating in distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"commfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in COMMANDS:
        if registered is None or entry.name in registered:
            importlib.import_module(entry.module).register(sub)
        else:
            sub.add_parser(entry.name, help=entry.summary)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` names: its first word that is not an option (``commfuse``'s own
    options, ``--help`` and ``--version``, take no value), or None."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``commfuse`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    from commfuse.cli.common import run_command

    args_list = list(sys.argv[1:] if argv is None else argv)
    command = command_of(args_list)
    parser = build_parser([command] if command is not None else [])
    args = parser.parse_args(args_list)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return run_command(args)
