"""``commfuse launch``: start N local ranks of a script under the torchrun contract.

A script written for ``torchrun`` runs unchanged: every rank gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT, and ``init_process_group()`` with the
default ``env://`` finds the store this launcher hosts. With ``--hosts``/``--link`` each host's
ranks run inside that host's network namespace of an emulated cluster (netlab), and gloo is
pointed at the host's interface with GLOO_SOCKET_IFNAME.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from commfuse.cluster.errors import LaunchError
from commfuse.cluster.failures import notice_poster
from commfuse.cluster.placement import Placement, open_placement
from commfuse.cluster.store import host_store
from commfuse.cluster.supervisor import JobResult, kill_group, supervise
from commfuse.cluster.topology import Topology
from commfuse.cluster.watchdog import Watchdog


@dataclass
class _PopenRank:
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_exit(self) -> int:
        return self.proc.wait()


def script_command(
    target: str, args: Sequence[str], *, module: bool = False, no_python: bool = False
) -> list[str]:
    """The argv of one rank: ``python -u script args`` (or ``-m module``, or a raw program)."""
    if no_python:
        if shutil.which(target) is None and not os.path.exists(target):
            raise LaunchError(f"program {target!r} not found; give a path or a command on PATH")
        return [target, *args]
    if module:
        return [sys.executable, "-u", "-m", target, *args]
    if not os.path.isfile(target):
        raise LaunchError(
            f"script {target!r} does not exist; give the path of a Python file (or -m module)"
        )
    return [sys.executable, "-u", target, *args]


def _start_ranks(
    command: Sequence[str],
    placement: Placement,
    *,
    master_addr: str,
    master_port: int,
    run_id: str,
    extra_env: dict[str, str] | None = None,
    watchdog: Watchdog | None = None,
) -> list[_PopenRank]:
    """Popen one process per rank, each in its own session (so we can stop its whole tree),
    each guarded by ``watchdog`` (should this process die without stopping them)."""
    ranks: list[_PopenRank] = []
    topology = placement.topology
    try:
        for rank in range(topology.world_size):
            env = placement.env_of(
                rank, master_addr=master_addr, master_port=master_port, run_id=run_id
            )
            env.update(extra_env or {})
            netns = placement.netns_of(rank)
            argv = list(command) if netns is None else ["ip", "netns", "exec", netns, *command]
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            ranks.append(_PopenRank(proc))
            if watchdog is not None:
                watchdog.guard(proc.pid)
    except BaseException:
        for started in ranks:
            started.proc.kill()
            started.proc.wait()
        raise
    return ranks


def launch(
    command: Sequence[str],
    topology: Topology,
    *,
    emulate: bool | None = None,
    timeout_s: float | None = None,
    extra_env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> JobResult:
    """Run ``command`` as every rank of ``topology``; returns when all exit or one fails.

    A watchdog (``watchdog.py``) stops the ranks and removes the emulated cluster should this
    process be killed without the chance to do it itself."""
    run_id = uuid.uuid4().hex[:12]
    with Watchdog() as watchdog, open_placement(topology, emulate=emulate) as placement:
        if placement.lab_id is not None:
            watchdog.guard_lab(placement.lab_id)
        hosted = host_store(placement.master_addr, netns=placement.master_netns)
        try:
            ranks = _start_ranks(
                command,
                placement,
                master_addr=hosted.addr,
                master_port=hosted.port,
                run_id=run_id,
                extra_env=extra_env,
                watchdog=watchdog,
            )
            try:
                return supervise(
                    ranks,
                    [(r.proc.stdout, r.proc.stderr) for r in ranks],
                    host_of=topology.host_of,
                    timeout_s=timeout_s,
                    stdout=stdout,
                    stderr=stderr,
                    on_failure=notice_poster(hosted.store),
                )
            except BaseException:
                # Ctrl-C before supervise() took over the signals: stop the ranks anyway.
                for rank in ranks:
                    if rank.proc.poll() is None:
                        kill_group(rank.pid, signal.SIGKILL)
                    rank.proc.wait()
                raise
        finally:
            hosted.close()
