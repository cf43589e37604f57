"""``commfuse.testing.stress``: the load starts, is there for the block, and leaves nothing.

The load's processes are found by their PIDs (no process of another test is touched): each
is alive inside the block, and gone (reaped, not a zombie) after it, however the block ends;
the disk load's directory is removed; the command-line form (``tests/scripts/stress.py``) returns the command's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import commfuse.testing.stress as stress_module
from commfuse.testing.stress import StressConfig, under_stress

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from stress import main  # tests/scripts/stress.py, the developers' command

stress_path = stress_module.__file__


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_load_runs_inside_the_block_and_nothing_is_left_after_it() -> None:
    with under_stress(num_cpu=2, memory_mb=2, disk_mb=1) as load:
        assert len(load.pids) == 2 + 2 + 1  # cpu, two memory holders, one disk writer
        assert all(_alive(pid) for pid in load.pids)
        assert load.workdir is not None and Path(load.workdir).is_dir()
    assert not any(_alive(pid) for pid in load.pids)
    assert not Path(load.workdir).exists()


def test_a_failing_block_stops_the_load_too() -> None:
    with pytest.raises(RuntimeError, match="inside"), under_stress(num_cpu=1) as load:
        raise RuntimeError("inside")
    assert load.pids and not any(_alive(pid) for pid in load.pids)


def test_a_load_process_whose_parent_died_stops_by_itself() -> None:
    # A parent that starts the load and is SIGKILLed (a test killed by its timeout) before
    # its cleanup: the orphaned load notices and exits.
    # (The module alone, by its path: importing the package would import torch.)
    code = (
        "import importlib.util, os, signal, sys\n"
        f"spec = importlib.util.spec_from_file_location('stress', {str(stress_path)!r})\n"
        "module = sys.modules['stress'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "with module.under_stress(num_cpu=1, memory_mb=1) as load:\n"
        "    print(' '.join(map(str, load.pids)), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_the_command_line_runs_the_command_under_load_and_returns_its_status() -> None:
    assert main(["--cpu", "1", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    with pytest.raises(SystemExit):
        main(["--cpu", "1"])  # no command


def test_counts_and_sizes_are_checked() -> None:
    assert StressConfig().cpu_processes == 2 * len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="num_cpu"):
        StressConfig(num_cpu=-1)
    with pytest.raises(ValueError, match="memory_mb and disk_mb"):
        StressConfig(memory_mb=-1)
