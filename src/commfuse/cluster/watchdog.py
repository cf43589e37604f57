"""A job's watchdog: when the launcher dies, even by SIGKILL, its ranks and its network go too.

Each rank leads its own session, so that the launcher can stop a rank with everything the rank
started (``supervisor.kill_group``). The price is that nothing stops them when the launcher
itself is killed without a chance to clean up (SIGKILL, the OOM killer, a crashed job
scheduler): they are no longer in the launcher's process group and keep running, holding their
ports, their GPUs and the emulated cluster's namespaces. ``PR_SET_PDEATHSIG`` would reach only
the rank itself, not its children, and fires when the *thread* that forked it exits.

So the launcher starts one small process per job, the watchdog, in a session of its own, and
keeps the write end of a pipe to it. It tells the watchdog, one line each:

- ``group PID``: a rank started, leading process group PID;
- ``lab ID``: the job runs on emulated cluster ID;
- ``exit``: the launcher is shutting down cleanly; nothing to do. It says so once it has reaped
  its ranks and removed the lab; a launcher killed within that second could, in principle, have
  a reaped rank's group id signalled after the kernel reused it.

The kernel closes the pipe when the launcher dies, however it dies. The watchdog then reads end
of file without ``exit``: it sends SIGKILL to every group it was told of, removes the
emulated cluster by name, says so on stderr and exits. The same pipe idea is how torchrun's
agents and MPI's daemons notice a dead parent.

This file runs as a script (``Watchdog.start``) and imports only the standard library until it
must remove a lab, so that guarding a job costs a few milliseconds, not an import of torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

#: Seconds the killed groups get to disappear before the lab is removed (a namespace whose
#: processes still run keeps existing until they are gone).
_KILL_SETTLE_S = 2.0


class Watchdog:
    """The launcher's side: start the watchdog, tell it about ranks and the lab, stop it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._pipe: IO[str] | None = None

    def start(self) -> None:
        # runpy executes the file without putting its folder on sys.path (where this package's
        # module names could shadow others) and without importing the commfuse package.
        runner = (
            "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-c", runner, os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # out of reach of the Ctrl-C meant for the launcher's group
        )
        self._pipe = self._proc.stdin

    def _say(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            self._pipe.write(line + "\n")
            self._pipe.flush()
        except (BrokenPipeError, ValueError):  # the watchdog is gone: nothing left to guard with
            self._pipe = None

    def guard(self, pid: int) -> None:
        """Kill process group ``pid`` should the launcher die."""
        self._say(f"group {pid}")

    def guard_lab(self, lab_id: str) -> None:
        """Remove emulated cluster ``lab_id`` should the launcher die."""
        self._say(f"lab {lab_id}")

    def stop(self) -> None:
        """The launcher cleaned up itself: let the watchdog exit without doing anything."""
        self._say("exit")
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def watch(lines: IO[str], launcher_pid: int) -> None:
    """The watchdog's side: follow the launcher's lines; at end of file without ``exit``, kill
    the groups still live and remove the lab."""
    groups: list[int] = []
    labs: list[str] = []
    for line in lines:
        word, _, value = line.strip().partition(" ")
        if word == "exit":
            return
        if word == "group":
            groups.append(int(value))
        elif word == "lab":
            labs.append(value)
    killed = []
    for pid in groups:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            # A rank that makes its own session (``spawn``) may not have done so yet: its pid is
            # still the launcher's unreaped child (or init's orphan), so this is the rank.
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        except PermissionError:
            continue
        killed.append(pid)
    if labs:
        deadline = time.monotonic() + _KILL_SETTLE_S
        while any(_group_alive(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        from commfuse.cluster.netlab import down_all  # only now: it imports the package

        for lab_id in labs:
            down_all(lab_id)
    print(
        f"commfuse: the launcher (pid {launcher_pid}) died; killed its ranks' process groups "
        f"{killed or 'none'}"
        + (f" and removed emulated cluster {', '.join(labs)}" if labs else ""),
        file=sys.stderr,
    )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end decides
    watch(sys.stdin, int(sys.argv[1]))
