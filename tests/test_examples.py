"""Every script in ``examples/`` runs as a user runs it: ``commfuse launch --nproc 2 SCRIPT``.

Each example checks its own result (the collective's values, the fused MLP against the dense
one) or prints a checksum of the model per rank; replicas that must be identical after
data-parallel training (a wrong or missing gradient average would make them drift apart, since
every rank trains on its own batches) must print the same checksum.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
CHECKSUM = re.compile(r"^\[rank (\d+)\] rank \d+ checksum (\S+)$", re.MULTILINE)
OK = re.compile(r"^\[rank (\d+)\] rank \d+ ok", re.MULTILINE)

#: Examples whose replicas must end identical, and print ``rank R checksum X``.
REPLICATED = {
    "ddp_powersgd_hook.py",
    "data_parallel.py",
    "diloco.py",
    "gossip.py",
    "fsdp2_diloco.py",
    "lightning_powersgd.py",
    "accelerate_powersgd.py",
    "accelerate_diloco.py",
    "transformers_powersgd.py",
}
#: Ranks per example where two would not show it (2 replicas of 2 FSDP2 shards).
NPROC = {"fsdp2_diloco.py": 4}
#: The launch's deadline (a guard against a hang, not a timing) where 240 s is short: the
#: trainers' imports take tens of seconds a rank on a loaded machine (Lightning the longest).
DEADLINE_S = {
    "lightning_powersgd.py": 600,
    "accelerate_powersgd.py": 600,
    "accelerate_diloco.py": 600,
    "transformers_powersgd.py": 600,
}


def launch(script: Path, nproc: int = 2, deadline_s: int = 240) -> subprocess.CompletedProcess[str]:
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from commfuse.cli import main; sys.exit(main())",
            "launch",
            "--nproc",
            str(nproc),
            "--timeout",
            str(deadline_s),
            str(script),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline_s + 60,
    )


def test_the_examples_are_the_ones_the_docs_show() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"ddp_powersgd_hook.py", "data_parallel.py", "diloco.py", "fused_linear.py"} <= names
    assert "collective.py" in names
    shown = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for name in names:
        assert f'--8<-- "examples/{name}"' in shown, f"no page of docs/ includes examples/{name}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        pytest.param(
            p,
            id=p.stem,
            marks=[pytest.mark.timeout(DEADLINE_S[p.name] + 120)] if p.name in DEADLINE_S else [],
        )
        for p in EXAMPLES
    ],
)
def test_example_runs_on_two_ranks(script: Path) -> None:
    nproc = NPROC.get(script.name, 2)
    proc = launch(script, nproc, DEADLINE_S.get(script.name, 240))
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    ranks = [str(r) for r in range(nproc)]
    if script.name in REPLICATED:
        sums = dict(CHECKSUM.findall(proc.stdout))
        assert sorted(sums) == ranks, proc.stdout
        assert len(set(sums.values())) == 1, f"replicas differ after {script.name}: {sums}"
    else:
        assert sorted(OK.findall(proc.stdout)) == ranks, proc.stdout
