"""Load the machine while a test runs: busy processes on every core, optionally memory held
and touched, and a disk kept writing.

A distributed test that passes on a quiet machine can still depend on timing: which replica
asks the lighthouse first, which bucket is ready first, whether a heartbeat arrives before a
quorum forms. A loaded machine stretches those windows by orders of magnitude (a process may
wait hundreds of milliseconds for a core), so a race that a quiet run hides shows up in a few
runs. The load is plain processes, started here and killed here by their PIDs:

1. ``num_cpu`` processes spin on floating-point work (default: two per core, a load average
   about twice the cores, like a machine shared with package installs and other jobs);
2. ``memory_mb`` is split over a few processes that allocate it and touch every page again
   and again, so it stays resident and the page cache shrinks;
3. ``disk_mb`` is written (and fsynced) over and over into a temporary directory by one
   process, which keeps the disk's queue busy; the directory is removed at the end.

Each process also exits by itself once its parent is gone (it checks its parent's PID), so a
test killed by its timeout leaves nothing running.

In Python, ``with under_stress(num_cpu=8): ...``; for pytest, the ``stressed`` fixture of the
repository's ``tests/conftest.py``; for any command (a test file, the whole suite), the
repository's script: ``python tests/scripts/stress.py --cpu 8 --memory-mb 512 -- pytest -q
tests``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

#: What each load process runs (``python -c``: no import of commfuse or torch, so starting
#: one costs little). argv: kind, parent PID, then the kind's argument.
_WORKER = r"""
import os, sys, time
kind, parent = sys.argv[1], int(sys.argv[2])
def orphaned():
    return os.getppid() != parent
if kind == "cpu":
    x = 1.0
    while not orphaned():
        for _ in range(200000):
            x = x * 1.0000001 + 1e-9
            if x > 1e6:
                x = 1.0
elif kind == "memory":
    block = bytearray(int(sys.argv[3]) << 20)
    while not orphaned():
        for i in range(0, len(block), 4096):
            block[i] = (block[i] + 1) & 0xFF
        time.sleep(0.05)
elif kind == "disk":
    path, size = sys.argv[3], int(sys.argv[4]) << 20
    chunk = os.urandom(1 << 20)
    while not orphaned():
        with open(path, "wb") as f:
            for _ in range(max(1, size >> 20)):
                f.write(chunk)
                if orphaned():
                    break
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)
"""

#: Memory is held by at most this many processes (each touches its share).
_MEMORY_PROCESSES = 2


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StressConfig:
    """What ``under_stress`` loads the machine with."""

    num_cpu: int | None = None
    """Busy processes (None: two per core)."""
    memory_mb: int = 0
    """MiB held resident and touched (0: none)."""
    disk_mb: int = 0
    """MiB written and fsynced over and over (0: no disk load)."""

    def __post_init__(self) -> None:
        if self.num_cpu is not None and self.num_cpu < 0:
            raise ValueError(f"num_cpu must be >= 0 processes, got {self.num_cpu}")
        if self.memory_mb < 0 or self.disk_mb < 0:
            raise ValueError(
                f"memory_mb and disk_mb must be >= 0, got {self.memory_mb} and {self.disk_mb}"
            )

    @property
    def cpu_processes(self) -> int:
        return 2 * cores() if self.num_cpu is None else self.num_cpu


@dataclasses.dataclass
class Stress:
    """The load processes of one ``under_stress`` block."""

    config: StressConfig
    pids: list[int] = dataclasses.field(default_factory=list)
    """Every load process started (the memory and disk ones too)."""
    workdir: str | None = None
    """The disk load's temporary directory (None without disk load)."""


@contextlib.contextmanager
def under_stress(
    *, num_cpu: int | None = None, memory_mb: int = 0, disk_mb: int = 0
) -> Iterator[Stress]:
    """Load the machine for the duration of the block (see the module docstring).

    Args:
        num_cpu: busy processes (None: two per core).
        memory_mb: MiB held resident and touched, split over up to two processes.
        disk_mb: MiB written and fsynced over and over in a temporary directory.

    Yields:
        The ``Stress`` with the PIDs of the load; they are killed (SIGKILL, by PID) and reaped
        when the block ends, however it ends, and the temporary directory removed.

    Raises:
        ValueError: a negative count or size.

    Example:
        ```python
        with under_stress(num_cpu=8, memory_mb=256):
            record = run_fault_tolerant(config, FaultToleranceConfig(), topology)
        ```
    """
    config = StressConfig(num_cpu=num_cpu, memory_mb=memory_mb, disk_mb=disk_mb)
    load = Stress(config)
    procs: list[subprocess.Popen[bytes]] = []
    parent = str(os.getpid())

    def start(kind: str, *args: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, kind, parent, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        load.pids.append(proc.pid)

    try:
        for _ in range(config.cpu_processes):
            start("cpu")
        if config.memory_mb:
            parts = min(_MEMORY_PROCESSES, config.memory_mb)
            for i in range(parts):
                share = config.memory_mb // parts + (1 if i < config.memory_mb % parts else 0)
                start("memory", str(share))
        if config.disk_mb:
            load.workdir = tempfile.mkdtemp(prefix="commfuse-stress-")
            start("disk", os.path.join(load.workdir, "load.bin"), str(config.disk_mb))
        yield load
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        if load.workdir is not None:
            shutil.rmtree(load.workdir, ignore_errors=True)
