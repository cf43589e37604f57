"""Watch a job's rank processes: prefix their output, stop all when one fails, name the culprit.

The policy is torchrun's (and MPI's): a job is as good as its worst rank. When any rank exits
non-zero the job reports the rank that failed *first* with the last line it wrote to stderr,
which for a Python rank is the exception, and the others are stopped (they would otherwise wait
for it inside a collective until their deadline). Before stopping them the supervisor posts the
failure (``on_failure``: the launcher writes the job's failure notice, ``failures.py``) and
gives them ``FAILURE_GRACE_S`` to finish by themselves: a rank in a collective with the dead one
then raises ``PeerFailureError`` naming it, which is what its log should say. A job deadline
catches a rank that hangs without failing; Ctrl-C or SIGTERM stops everything.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

#: Lines a rank prints that say nothing about the job, dropped from its output. c10d asks for
#: the peer's host name of every store connection; inside an emulated host there is no
#: resolver, so each rank warned once (err=-3, EAI_AGAIN) about a lookup nothing needs.
_KNOWN_NOISE = ("The hostname of the client socket cannot be retrieved",)

#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 3.0
#: Seconds the other ranks get to exit by themselves after one failed: a rank in a collective with
#: the dead one raises PeerFailureError within about 2 s of the death (its waits read the notice
#: every 0.5 s, ``comm/watch.py``), which tests/test_peer_failure.py checks under this grace.
FAILURE_GRACE_S = 5.0


class _RankProcess(Protocol):
    """What the supervisor needs of a rank, whether it came from Popen or multiprocessing."""

    @property
    def pid(self) -> int | None: ...

    def wait_exit(self) -> int:
        """Block until the process exits; its exit code (negative: killed by that signal)."""
        ...


def _how_it_ended(exit_code: int | None) -> str:
    """``was killed by SIGKILL``, ``failed with exit code 1``, ``exited cleanly`` or ``did not
    finish`` (None: the rank did not exit by itself)."""
    if exit_code is None:
        return "did not finish"
    if exit_code < 0:
        return f"was killed by {signal.Signals(-exit_code).name}"
    return f"failed with exit code {exit_code}" if exit_code else "exited cleanly"


@dataclass
class RankFailure:
    """The first rank that failed, and how."""

    rank: int
    host: int
    exit_code: int | None
    """None when the rank did not exit by itself (deadline or interrupt)."""
    error: str
    """The rank's last line on stderr (the exception for a Python rank), or a description."""

    def how(self) -> str:
        """``was killed by SIGKILL``, ``failed with exit code 1`` or ``did not finish``."""
        return _how_it_ended(self.exit_code)

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}) {self.how()}: {self.error}"


@dataclass
class JobResult:
    exit_codes: dict[int, int | None]
    failure: RankFailure | None = None
    interrupted: bool = False
    timed_out: bool = False
    stderr_tail: dict[int, list[str]] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)
    """The ranks still running when the job ended, which the launcher stopped."""

    def endings(self) -> str:
        """How every rank but the first failure ended: a rank that crashed on its own after
        the failure (a signal, not the launcher's) is told apart from one the launcher stopped."""
        first = None if self.failure is None else self.failure.rank
        return ", ".join(
            f"rank {rank} "
            + ("was stopped by the launcher" if rank in self.stopped else _how_it_ended(code))
            for rank, code in sorted(self.exit_codes.items())
            if rank != first
        )

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.interrupted

    @property
    def returncode(self) -> int:
        if self.interrupted:
            return 130
        return 0 if self.failure is None else 1


def _start_pump(
    rank: int,
    stream: IO[bytes],
    sink: IO[str],
    lock: threading.Lock,
    tail: collections.deque[str] | None,
) -> threading.Thread:
    """Copy one rank's stream to ours line by line with a ``[rank N]`` prefix, on a thread."""
    thread = threading.Thread(target=_pump, args=(rank, stream, sink, lock, tail), daemon=True)
    thread.start()
    return thread


def _pump(
    rank: int,
    stream: IO[bytes],
    sink: IO[str],
    lock: threading.Lock,
    tail: collections.deque[str] | None,
) -> None:
    prefix = f"[rank {rank}] "
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if any(noise in line for noise in _KNOWN_NOISE):
                continue
            if tail is not None and line.strip():
                tail.append(line)
            with lock:
                sink.write(prefix + line + "\n")
                sink.flush()


def kill_group(pid: int | None, sig: int, *, group_only: bool = False) -> None:
    """Signal a rank's whole process group (it leads its own session), then the rank itself.

    ``group_only`` skips the fallback to the pid alone: for a rank already reaped, whose pid may
    belong to an unrelated process by now.
    """
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        if group_only:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def supervise(
    procs: Sequence[_RankProcess],
    streams: Sequence[tuple[IO[bytes] | None, IO[bytes] | None]],
    *,
    host_of: Callable[[int], int],
    timeout_s: float | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    on_failure: Callable[[RankFailure], None] | None = None,
    failure_grace_s: float = FAILURE_GRACE_S,
) -> JobResult:
    """Run until every rank exits, one fails, the deadline passes or we are interrupted.

    After the first failure, ``on_failure(failure)`` runs, and the other ranks get
    ``failure_grace_s`` to exit by themselves before they are stopped."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    lock = threading.Lock()
    tails = {rank: collections.deque[str](maxlen=20) for rank in range(len(procs))}
    pumps: list[threading.Thread] = []
    err_pumps: dict[int, threading.Thread] = {}
    for rank, (rank_out, rank_err) in enumerate(streams):
        if rank_out is not None:
            pumps.append(_start_pump(rank, rank_out, out, lock, None))
        if rank_err is not None:
            err_pumps[rank] = _start_pump(rank, rank_err, err, lock, tails[rank])
            pumps.append(err_pumps[rank])

    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, proc in enumerate(procs):
        threading.Thread(
            target=lambda r=rank, p=proc: exits.put((r, p.wait_exit())), daemon=True
        ).start()

    interrupted = threading.Event()
    restore = _install_interrupt_handlers(interrupted)
    exit_codes: dict[int, int | None] = dict.fromkeys(range(len(procs)))
    result = JobResult(exit_codes=exit_codes)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while any(code is None for code in exit_codes.values()):
            if interrupted.is_set():
                result.interrupted = True
                break
            if deadline is not None and time.monotonic() > deadline:
                result.timed_out = True
                break
            try:
                rank, code = exits.get(timeout=0.05)
            except queue.Empty:
                continue
            exit_codes[rank] = code
            if code != 0:
                # Let the pump drain the rank's last lines so the message can name the error.
                if rank in err_pumps:
                    err_pumps[rank].join(timeout=1.0)
                result.failure = RankFailure(
                    rank=rank, host=host_of(rank), exit_code=code, error=_last_error(tails[rank])
                )
                if on_failure is not None:
                    on_failure(result.failure)
                _await_exits(exit_codes, exits, interrupted, time.monotonic() + failure_grace_s)
                break
        if result.timed_out:
            running = [r for r, c in exit_codes.items() if c is None]
            result.failure = RankFailure(
                rank=running[0],
                host=host_of(running[0]),
                exit_code=None,
                error=f"ranks {running} still running after the {timeout_s:g} s deadline",
            )
    finally:
        result.stopped = _stop_all(procs, exit_codes, exits)
        restore()
        for pump in pumps:
            pump.join(timeout=2.0)
    result.stderr_tail = {rank: list(tail) for rank, tail in tails.items()}
    return result


#: The prefix torch.distributed's excepthook puts on each traceback line: ``[rank1]: ``.
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def _last_error(tail: collections.deque[str]) -> str:
    for line in reversed(tail):
        text = _TORCH_RANK_PREFIX.sub("", line).strip()
        if text and not text.startswith(("File ", "^", "~")):
            return text
    return "no error message on stderr"


def _await_exits(
    exit_codes: dict[int, int | None],
    exits: queue.Queue[tuple[int, int]],
    interrupted: threading.Event,
    until: float,
) -> None:
    """Record the ranks' exits until every rank has exited, ``until`` passes or Ctrl-C."""
    while any(c is None for c in exit_codes.values()) and not interrupted.is_set():
        left = until - time.monotonic()
        if left <= 0:
            return
        try:
            rank, code = exits.get(timeout=min(left, 0.05))
        except queue.Empty:
            continue
        exit_codes[rank] = code


def _stop_all(
    procs: Sequence[_RankProcess],
    exit_codes: dict[int, int | None],
    exits: queue.Queue[tuple[int, int]],
) -> list[int]:
    """SIGTERM every live rank, SIGKILL what is left after the grace period; returns the ranks
    it stopped."""
    live = [r for r, c in exit_codes.items() if c is None]
    for rank in live:
        kill_group(procs[rank].pid, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    while any(exit_codes[r] is None for r in live) and time.monotonic() < deadline:
        try:
            rank, code = exits.get(timeout=0.05)
            exit_codes[rank] = code
        except queue.Empty:
            pass
    for rank in live:
        if exit_codes[rank] is None:
            kill_group(procs[rank].pid, signal.SIGKILL)
    while any(exit_codes[r] is None for r in live):
        rank, code = exits.get(timeout=10.0)
        exit_codes[rank] = code
    # Reap grandchildren a rank left in its group (dataloader workers, shells).
    for proc in procs:
        kill_group(proc.pid, signal.SIGKILL, group_only=True)
    return live


def _install_interrupt_handlers(flag: threading.Event) -> Callable[[], None]:
    """Turn SIGINT/SIGTERM into a flag the supervisor loop checks; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        flag.set()

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
