"""A pool of persistent rank processes, so multi-rank tests do not pay a torch start per test.

Starting a rank costs seconds (importing torch, joining the process group) and CI has two
cores, so each world size gets one pool per test session. ``pool.run(fn, *args)`` calls ``fn``
on every rank with the default process group ready, and returns the per-rank results, or raises
the first failing rank's exception (``RankError``, original exception in ``.exc``). Every call
has a deadline: ranks that do not answer in time are named in ``DeadlineExceeded`` and the pool
is rebuilt, so a hung collective fails its test instead of hanging CI.

After any failure the process group is rebuilt (new store prefix) before the next call: a
collective abandoned half-way may leave messages in flight that would corrupt the next one.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from commfuse.cluster.errors import DeadlineExceeded, RankError
from commfuse.cluster.failures import clear_failure
from commfuse.cluster.placement import open_placement
from commfuse.cluster.rank_runtime import enter_rank, pack_exception, unpack_exception
from commfuse.cluster.start import rank_context
from commfuse.cluster.store import HostedStore, host_store
from commfuse.cluster.topology import Topology

T = TypeVar("T")

#: How long the after-call health check may take before the group is declared broken.
_HEALTH_TIMEOUT_S = 10.0
#: After one rank fails, how long the others get to finish before the pool is rebuilt.
FAILURE_GRACE_S = 5.0


def _init_group(backend: str, generation: int, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    client = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"pool-gen{generation}/", client),  # type: ignore[attr-defined]
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )


def _worker_main(
    conn: Connection, env: dict[str, str], netns: str | None, backend: str, pg_timeout_s: float
) -> None:
    os.setsid()
    enter_rank(env, netns)
    generation = 0
    try:
        _init_group(backend, generation, pg_timeout_s)
        conn.send(("ready", None))
    except BaseException as exc:
        conn.send(("err", pack_exception(exc)))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "stop":
            # Leave without the interpreter's shutdown: tearing down torch with a live gloo
            # group takes about a second per rank, and a test session closes many pools.
            # Nothing is left to save; the streams are flushed first.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if kind == "reset":
            generation = message[1]
            try:
                _init_group(backend, generation, pg_timeout_s)
                conn.send(("ok", None))
            except BaseException as exc:
                conn.send(("err", pack_exception(exc)))
            continue
        _, fn, args, kwargs = message
        try:
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except BaseException as exc:
            reply = ("err", pack_exception(exc))
        # Answer first, check the group after: a rank whose call finished must not be held (and
        # blamed in DeadlineExceeded) while the health check waits for a peer still in the call.
        conn.send(reply)
        conn.send(("health", _group_healthy(pg_timeout_s)))


def _group_healthy(timeout_s: float) -> bool:
    """Whether the process group still works after a call: a test that provoked a timeout or
    left an unmatched operation behind breaks it for the next test, so the pool rebuilds it."""
    import torch
    import torch.distributed as dist

    token = torch.zeros(1)
    try:
        work = dist.all_reduce(token, async_op=True)
        assert work is not None
        work.wait(datetime.timedelta(seconds=min(timeout_s, _HEALTH_TIMEOUT_S)))
    except Exception:
        return False
    return True


class RankPool:
    """``world_size`` persistent ranks with a process group; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        pg_timeout_s: float = 30.0,
        net: Topology | None = None,
    ) -> None:
        if net is not None and net.world_size != world_size:
            raise ValueError(
                f"world_size={world_size} disagrees with the topology's {net.world_size} ranks"
            )
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.topology = net or Topology(num_hosts=1, ranks_per_host=world_size)
        self._stack: contextlib.ExitStack | None = None
        self._store: HostedStore | None = None
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._generation = 0
        self._needs_reset = False

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._procs:
            return
        ctx = rank_context()
        stack = contextlib.ExitStack()
        try:
            placement = stack.enter_context(open_placement(self.topology))
            store = host_store(placement.master_addr, netns=placement.master_netns)
            stack.callback(store.close)
            run_id = uuid.uuid4().hex[:12]
            for rank in range(self.world_size):
                env = placement.env_of(
                    rank, master_addr=store.addr, master_port=store.port, run_id=run_id
                )
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child, env, placement.netns_of(rank), self.backend, self.pg_timeout_s),
                    name=f"commfuse-pool{self.world_size}-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._stack, self._store = stack, store
            self._gather("start", self.timeout_s + 60.0)
        except BaseException:
            self._kill()
            stack.close()
            raise

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._needs_reset = False
        if self._stack is not None:
            self._stack.close()
            self._stack, self._store = None, None

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        timeout_s: float | None = None,
        failure_grace_s: float = FAILURE_GRACE_S,
        **kwargs: Any,
    ) -> list[T]:
        """``fn(*args, **kwargs)`` on every rank; results in rank order.

        After the first rank fails, the others get ``failure_grace_s`` to reply before the pool
        is rebuilt; a test of how survivors fail gives them as long as the deadline it asserts
        (the pool posts no failure notice: a survivor waiting on a live neighbour that gave up
        raises once a rank that lost a peer posts one, or else at its deadline)."""
        self.start()
        if self._needs_reset:
            self._generation += 1
            if self._store is not None and self._store.store is not None:
                clear_failure(self._store.store)  # the failure that made us reset is over
            try:
                self._send_all(("reset", self._generation))
                self._gather("process-group reset", self.timeout_s)
            except (RankError, DeadlineExceeded):
                self._kill()
                self.start()
            self._needs_reset = False
        self._send_all(("call", fn, args, kwargs))
        return self._gather(
            getattr(fn, "__qualname__", repr(fn)),
            self.timeout_s if timeout_s is None else timeout_s,
            health=True,
            failure_grace_s=failure_grace_s,
        )

    def _send_all(self, message: tuple[Any, ...]) -> None:
        for conn in self._conns:
            conn.send(message)

    def _gather(
        self,
        what: str,
        timeout_s: float,
        *,
        health: bool = False,
        failure_grace_s: float = FAILURE_GRACE_S,
    ) -> list[Any]:
        """Every rank's reply to the last message; ``health``: a call, followed by health reports."""
        replies: dict[int, tuple[Any, ...]] = {}
        died = False
        first_error: int | None = None
        first_error_at = 0.0
        deadline = time.monotonic() + timeout_s
        by_conn: dict[int, int] = {id(conn): rank for rank, conn in enumerate(self._conns)}
        while len(replies) < self.world_size:
            pending = [conn for rank, conn in enumerate(self._conns) if rank not in replies]
            left = deadline - time.monotonic()
            if first_error is not None:
                left = min(left, first_error_at + failure_grace_s - time.monotonic())
            ready = wait(pending, timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                break
            for ready_conn in ready:
                rank = by_conn[id(ready_conn)]
                try:
                    replies[rank] = self._conns[rank].recv()
                except EOFError:
                    code = self._procs[rank].exitcode
                    replies[rank] = ("err", (f"rank process died (exit code {code})", "", None))
                    died = True
                if replies[rank][0] == "err" and first_error is None:
                    first_error, first_error_at = rank, time.monotonic()
        missing = [rank for rank in range(self.world_size) if rank not in replies]
        if health and not missing and not died:
            self._read_health()
        if missing or died:
            self._kill()  # stuck or dead ranks cannot be reused: the next call rebuilds the pool
        if first_error is not None:
            self._needs_reset = bool(self._procs)
            error = unpack_exception(first_error, replies[first_error][1])
            error.partial_results = {
                r: reply[1] for r, reply in replies.items() if reply[0] == "ok"
            }
            raise error
        if missing:
            done = sorted(replies)
            raise DeadlineExceeded(
                f"{what}: rank(s) {missing} of {self.world_size} did not finish within {timeout_s:g} s "
                f"(finished: {done}); the pool was rebuilt",
                ranks=missing,
            )
        return [replies[rank][1] for rank in range(self.world_size)]

    def _read_health(self) -> None:
        """Consume each rank's after-call health report: a broken group is rebuilt before the next
        call; a rank that does not report in time cannot be trusted and the pool is replaced."""
        deadline = time.monotonic() + _HEALTH_TIMEOUT_S + FAILURE_GRACE_S
        healthy = True
        for conn in self._conns:
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self._kill()
                    return
                healthy = bool(conn.recv()[1]) and healthy
            except (EOFError, OSError):
                self._kill()
                return
        if not healthy:
            self._needs_reset = True


_POOLS: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, *, backend: str = "gloo") -> RankPool:
    """The session's pool for a world size, started on first use."""
    key = (world_size, backend)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend=backend)
    pool = _POOLS[key]
    pool.start()
    return pool


def close_pools() -> None:
    """Close every pool ``get_pool`` started and forget them (the test session's end)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
