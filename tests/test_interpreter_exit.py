"""A script may leave the interpreter right after its last collective.

gloo's work-loop thread takes the GIL after a collective to release the tensors it held; if the
interpreter is finalising by then, the process dies of SIGABRT after the script had done
everything right (``commfuse.comm.interpreter_exit``). ``scripts/exit_after_collective.py``
makes that certain without the guard (both ranks die in every launch) and checks its sum.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "exit_after_collective.py"
LAUNCH = "import sys; from commfuse.cli import main; sys.exit(main())"


@pytest.mark.slow
def test_a_rank_that_exits_while_gloo_still_needs_the_interpreter_exits_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, "launch", "--nproc", "2", "--timeout", "60", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 0] rank 0 of 2 sums",
        "[rank 1] rank 1 of 2 sums",
    ], proc.stdout
