"""``commfuse.cluster.run(fn, world_size=...)``: call a function on N fresh rank processes.

Each rank is a fresh process (forked from a server that has already imported torch, see
``start.py``) with the torchrun environment, the default process group already initialized
(gloo unless told otherwise), inside its emulated host's namespace when a netlab is used. The call returns every rank's return value, or raises ``RankError`` with the
first failing rank's exception and traceback; the other ranks are stopped, never left hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import IO, Any, TypeVar

from commfuse.cluster.errors import DeadlineExceeded, RankError
from commfuse.cluster.failures import notice_poster
from commfuse.cluster.placement import open_placement
from commfuse.cluster.rank_runtime import (
    enter_rank,
    init_default_group,
    pack_exception,
    unpack_exception,
)
from commfuse.cluster.start import rank_context
from commfuse.cluster.store import host_store
from commfuse.cluster.supervisor import JobResult, kill_group, supervise
from commfuse.cluster.topology import Topology
from commfuse.cluster.watchdog import Watchdog

T = TypeVar("T")


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    netns: str | None,
    out_w: Connection,
    err_w: Connection,
    result_w: Connection,
    backend: str | None,
    pg_timeout_s: float,
) -> None:
    os.setsid()  # own session: the supervisor stops the rank with everything it started
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    enter_rank(env, netns)
    code = 1
    try:
        if backend is not None:
            init_default_group(backend, timeout_s=pg_timeout_s)
        value = fn(*args, **kwargs)
        _send_by_value(result_w, ("ok", value))
        code = 0
    except BaseException as exc:
        # The traceback travels in the RankError; not printing it keeps the report single.
        _send_by_value(result_w, ("err", pack_exception(exc), time.monotonic()))
    finally:
        if backend is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without the interpreter's teardown: native threads of gloo and c10d that are
        # still joinable when C++ destructors run abort the process now and then ("terminate
        # called without an active exception", SIGABRT, about 1 launch in 20 under load),
        # after the rank's work and result were complete. Nothing is left to flush: the result
        # went through a synchronous pipe, stdout and stderr were flushed just above.
        os._exit(code)


class _MpRank:
    def __init__(self, proc: mp.process.BaseProcess) -> None:
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_exit(self) -> int:
        self.proc.join()
        code = self.proc.exitcode
        return 0 if code is None else code


def _reader(conn: Connection) -> IO[bytes]:
    return os.fdopen(os.dup(conn.fileno()), "rb")


def run(
    fn: Callable[..., T],
    *args: Any,
    world_size: int | None = None,
    net: Topology | None = None,
    emulate: bool | None = None,
    backend: str | None = "gloo",
    timeout_s: float | None = 300.0,
    pg_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[T]:
    """Call ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

    Give either ``world_size`` (ranks on one host, plain loopback) or ``net`` (a Topology, such
    as 4 hosts on 1 Gbit/s links, emulated when possible). ``fn`` must be importable (defined at
    module level). ``backend=None`` leaves process-group set-up to ``fn``.

    Args:
        fn: the function each rank calls; importable (defined at module level).
        args: positional arguments for ``fn`` (picklable).
        world_size: ranks on one host, on plain loopback; or give ``net``.
        net: a ``Topology`` (hosts, ranks per host, link rate), emulated when possible.
        emulate: force (True) or forbid (False) the emulated network; None: when useful and
            allowed.
        backend: the process group's backend; None leaves process-group set-up to ``fn``.
        timeout_s: the whole job's deadline.
        pg_timeout_s: the process group's own timeout.
        kwargs: keyword arguments for ``fn`` (picklable).

    Returns:
        Every rank's return value, in rank order.

    Raises:
        RankError: a rank raised; carries its rank, exception and traceback (the other ranks are
            stopped).
        DeadlineExceeded: the job passed ``timeout_s``.
        ValueError: neither ``world_size`` nor ``net``, or a ``world_size`` that disagrees with
            ``net``'s.

    Example:
        ```python
        def probe() -> int:
            return torch.distributed.get_rank()

        assert run(probe, world_size=2) == [0, 1]
        ```
    """
    if net is None:
        if world_size is None or world_size < 1:
            raise ValueError("run() needs world_size >= 1 or a Topology in net=")
        net = Topology(num_hosts=1, ranks_per_host=world_size)
    elif world_size is not None and world_size != net.world_size:
        raise ValueError(
            f"world_size={world_size} disagrees with the topology's {net.world_size} ranks"
        )
    ctx = rank_context()
    run_id = uuid.uuid4().hex[:12]
    # The watchdog stops the ranks (and removes the emulated cluster) should this process be
    # killed without the chance to do it itself.
    with Watchdog() as watchdog, open_placement(net, emulate=emulate) as placement:
        if placement.lab_id is not None:
            watchdog.guard_lab(placement.lab_id)
        hosted = host_store(placement.master_addr, netns=placement.master_netns)
        procs: list[_MpRank] = []
        streams: list[tuple[IO[bytes] | None, IO[bytes] | None]] = []
        results: dict[int, tuple[Any, ...]] = {}
        readers: list[threading.Thread] = []
        try:
            for rank in range(net.world_size):
                env = placement.env_of(
                    rank, master_addr=hosted.addr, master_port=hosted.port, run_id=run_id
                )
                proc, stream, reader = _start_rank(
                    ctx,
                    rank,
                    (fn, args, kwargs, env, placement.netns_of(rank)),
                    backend=backend,
                    pg_timeout_s=pg_timeout_s,
                    watchdog=watchdog,
                    results=results,
                )
                procs.append(proc)
                streams.append(stream)
                readers.append(reader)
            job = supervise(
                procs,
                streams,
                host_of=net.host_of,
                timeout_s=timeout_s,
                on_failure=notice_poster(hosted.store),
            )
        except BaseException:
            # A rank failed to start, or Ctrl-C came before supervise() took over the signals:
            # stop the ranks already started (they would wait for the others until pg_timeout_s).
            for started in procs:
                if started.proc.is_alive():
                    kill_group(started.pid, signal.SIGKILL)
                started.proc.join()
            raise
        finally:
            hosted.close()
        for reader in readers:
            reader.join(timeout=5.0)
    _raise_failure(fn, job, results, net.world_size)
    return [results[rank][1] for rank in range(net.world_size)]


def _start_rank(
    ctx: Any,
    rank: int,
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], dict[str, str], str | None],
    *,
    backend: str | None,
    pg_timeout_s: float,
    watchdog: Watchdog,
    results: dict[int, tuple[Any, ...]],
) -> tuple[_MpRank, tuple[IO[bytes] | None, IO[bytes] | None], threading.Thread]:
    """Start rank ``rank``'s process (``_rank_main``), guarded by ``watchdog``: ``call`` is
    ``(fn, args, kwargs, env, netns)``; returns the process, its stdout and stderr streams,
    and the thread that puts its result in ``results``."""
    out_r, out_w = ctx.Pipe(duplex=False)
    err_r, err_w = ctx.Pipe(duplex=False)
    res_r, res_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_rank_main,
        args=(*call, out_w, err_w, res_w, backend, pg_timeout_s),
        name=f"commfuse-rank{rank}",
    )
    proc.start()
    assert proc.pid is not None
    watchdog.guard(proc.pid)
    for conn in (out_w, err_w, res_w):
        conn.close()
    stream = (_reader(out_r), _reader(err_r))
    out_r.close()
    err_r.close()
    reader = threading.Thread(target=_collect, args=(rank, res_r, results), daemon=True)
    reader.start()
    return _MpRank(proc), stream, reader


def _raise_failure(
    fn: Callable[..., Any], job: JobResult, results: dict[int, tuple[Any, ...]], world_size: int
) -> None:
    """Raise what stopped the job (``supervise``'s ``job``), if anything did: an interrupt,
    the first rank's error, the deadline, a rank that died or ended without a result."""
    if job.interrupted:
        raise KeyboardInterrupt
    if job.failure is not None:
        failed = job.failure.rank
        if failed in results and results[failed][0] == "err":
            # A rank whose collective broke because a peer failed may exit before that peer:
            # report the error raised first (CLOCK_MONOTONIC is shared by the ranks' processes).
            failed = min(
                (r for r, res in results.items() if res[0] == "err"),
                key=lambda r: (results[r][2], r),
            )
            raise unpack_exception(failed, results[failed][1])
        if job.timed_out:
            raise DeadlineExceeded(
                f"{getattr(fn, '__name__', fn)}: {job.failure.error}",
                ranks=[r for r, c in job.exit_codes.items() if c is None or c < 0],
            )
        raise RankError(failed, job.failure.describe())
    missing = [rank for rank in range(world_size) if rank not in results]
    if missing:
        raise RankError(missing[0], "exited with code 0 without returning a result")


def _send_by_value(conn: Connection, message: tuple[Any, ...]) -> None:
    """Send with the standard pickle, which copies tensors' bytes. ``Connection.send`` uses
    torch's reductions, which hand a CPU tensor over as a shared-memory file descriptor that the
    receiver fetches from the sender later; the rank ``os._exit``s right after sending, and a
    receiver that came too late failed with "connection reset" (seen with a 2-rank result of a
    few KB)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _collect(rank: int, conn: Connection, results: dict[int, tuple[Any, ...]]) -> None:
    try:
        results[rank] = pickle.loads(conn.recv_bytes())
    except EOFError:
        pass
    finally:
        conn.close()
