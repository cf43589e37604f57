"""The simulator and the command import only what they use: torch is for the ranks.

``import commfuse.sim`` and the cost models under it are arithmetic; ``commfuse --help``, an
argument error and ``commfuse simulate`` run without importing torch (it takes seconds to
import, far longer than the simulation). Each check runs a fresh interpreter on this checkout's
package and reads its ``sys.modules`` at the end: a module already imported by the test runner
proves nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import commfuse
from commfuse.cli import COMMANDS, build_parser, command_of

#: Packages that a command which only parses, prints help or simulates must not import.
HEAVY = ("torch", "numpy", "scipy", "matplotlib")
#: The subset the simulator may not import (numpy runs its event engine).
NOT_IN_SIMULATOR = ("torch", "scipy", "matplotlib")

_SRC = str(Path(commfuse.__file__).resolve().parents[1])


def _imported_after(code: str) -> tuple[list[str], str]:
    """(top-level packages of ``HEAVY`` that ``code`` left imported, its stdout) in a fresh
    interpreter on this checkout."""
    probe = (
        f"{code}\n"
        "import sys as _s, json as _j\n"
        f"_heavy = sorted({{m.split('.')[0] for m in _s.modules}} & set({HEAVY!r}))\n"
        "print('HEAVY=' + _j.dumps(_heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": _SRC}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    assert last.startswith("HEAVY="), proc.stdout
    return json.loads(last.removeprefix("HEAVY=")), out


def _command(argv: list[str]) -> str:
    """Code that runs ``commfuse ARGV`` the way the console script does and keeps going."""
    return (
        "import contextlib, io\n"
        "from commfuse.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        f"        rc = main({argv!r})\n"
        "    except SystemExit as stop:\n"
        "        rc = stop.code\n"
        "print('rc', rc)\n"
    )


@pytest.mark.parametrize(
    "module",
    ["commfuse.sim", "commfuse.collectives.cost", "commfuse.collectives.tuner", "commfuse.cli"],
)
def test_the_simulator_and_the_cost_models_import_no_torch(module: str) -> None:
    heavy, _ = _imported_after(f"import {module}")
    assert not set(heavy) & set(NOT_IN_SIMULATOR), (module, heavy)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("argv", "rc"),
    [
        ([], 2),
        (["--help"], 0),
        (["--version"], 0),
        (["no-such-command"], 2),
        (["simulate", "--help"], 0),
        (["simulate", "--no-such-flag"], 2),
        (["simulate", "--ranks", "many"], 2),
        (["train", "--help"], 0),
        (["report", "--help"], 0),
        (["tune", "--help"], 0),
        (["net", "--help"], 0),
        (["launch", "--help"], 0),
        (["launch", "--nproc", "x", "script.py"], 2),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_help_and_argument_errors_import_nothing_heavy(argv: list[str], rc: int) -> None:
    heavy, out = _imported_after(_command(argv))
    assert out.endswith(f"rc {rc}"), out
    assert heavy == [], (argv, heavy)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--ranks", "1024"],
        ["simulate", "--workload", "dlrm", "--ranks", "256", "--chunks", "1,8"],
        ["simulate", "--op", "broadcast", "--algo", "lp,tree", "--scale", "2:64"],
    ],
    ids=" ".join,
)
def test_simulate_runs_without_torch(argv: list[str]) -> None:
    heavy, out = _imported_after(_command(argv))
    assert out.endswith("rc 0"), out
    assert not set(heavy) & set(NOT_IN_SIMULATOR), (argv, heavy)


def test_the_help_lines_are_the_ones_each_command_registers() -> None:
    """``COMMANDS`` stands in for the modules it does not import: same names, same order, same
    help line as the full parser."""
    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    registered = {choice.dest: choice.help for choice in sub._choices_actions}
    assert list(registered) == [entry.name for entry in COMMANDS]
    assert registered == {entry.name: entry.summary for entry in COMMANDS}


def test_command_of_finds_the_sub_command() -> None:
    assert command_of(["simulate", "--ranks", "8"]) == "simulate"
    assert command_of(["--help"]) is None and command_of([]) is None
    assert command_of(["--version", "bench", "fused"]) == "bench"
