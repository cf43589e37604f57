"""``run_fault_tolerant``: a data-parallel run that keeps training when replica groups die.

The launcher side of fault-tolerant training on torchft (PyTorch's per-step fault tolerance):

1. build the cluster (``open_placement``: emulated hosts, or loopback); its ranks (hosts x
   ranks per host) make the replica groups, one per host or ``ft.num_replica_groups`` of
   consecutive ranks (``FaultToleranceConfig.group_layout``);
2. host the lighthouse on host 0's address (``lighthouse.py``), and one TCPStore per life of
   each replica group on its first rank's host (the group's ranks meet there, and its first
   rank's Manager publishes its address there: a restarted group gets a fresh one, with
   nothing of the killed one's);
3. start every rank of every replica group (``replica.py``), and a spare group for each
   group to be killed and restarted (it boots, builds its model and waits); once all ranks
   have joined and every spare is built, tell them to go, so the first quorum holds all
   groups;
4. watch them and inject the faults: a replica group is one failure unit, all its ranks
   killed together (its first rank meets a ``KillFault`` and the launcher kills the others
   at once); it is started again ``restart_after_s`` after its death and each of its ranks
   recovers its state from the same rank of a live group; a ``CutFault``
   takes a host's link down for a while, a ``SlowFault`` reshapes it (``netlab``); any other
   death fails the job;
5. when every replica group has committed the last step (or is gone for good), put the
   per-step reports of all of them together (``accounting.py``).

A watchdog kills the replicas and removes the emulated cluster should the launcher be killed;
the lighthouse lives in the launcher and dies with it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

from commfuse.cluster import DeadlineExceeded, RankError, Topology
from commfuse.cluster.netlab import Netlab
from commfuse.cluster.placement import Placement, open_placement
from commfuse.cluster.rank_runtime import enter_rank
from commfuse.cluster.start import rank_context
from commfuse.cluster.store import HostedStore, host_store
from commfuse.cluster.supervisor import kill_group
from commfuse.cluster.watchdog import Watchdog
from commfuse.ft.accounting import summarize_ft
from commfuse.ft.config import (
    START_TIMEOUT_S,
    CutFault,
    FaultToleranceConfig,
    KillEveryFault,
    KillFault,
    SlowFault,
)
from commfuse.ft.lighthouse import start_lighthouse
from commfuse.ft.loop import ReplicaJob, send
from commfuse.ft.periods import ft_mode
from commfuse.ft.progress import floor_message
from commfuse.ft.replica import run_replica
from commfuse.train.loop import TrainConfig, init_from_step
from commfuse.train.strategy import describe_strategy

#: Environment variables of torchft that would override the timeouts derived here.
_TORCHFT_OVERRIDES = (
    "TORCHFT_TIMEOUT_SEC",
    "TORCHFT_QUORUM_TIMEOUT_SEC",
    "TORCHFT_CONNECT_TIMEOUT_SEC",
    "TORCHFT_LIGHTHOUSE",
    "TORCHFT_MANAGER_PORT",
)


def _replica_process(
    job: ReplicaJob, env: dict[str, str], netns: str | None, conn: Connection, log: str
) -> None:
    os.setsid()  # own session: the launcher and the watchdog stop it with what it started
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        enter_rank(env, netns)
        if ft_mode(job.train.strategy) == "periodic":
            from commfuse.ft.periodic import run_periodic_replica

            send(conn, ("done", run_periodic_replica(job, conn)))
        else:
            send(conn, ("done", run_replica(job, conn)))
        code = 0
    except BaseException:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            send(conn, ("error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: gloo's and torchft's native threads may still be joinable.
        os._exit(code)


@dataclass
class _Life:
    """One start of one rank of one replica group."""

    replica: int
    life: int
    proc: mp.process.BaseProcess
    conn: Connection
    log: str
    ready: bool = False
    result: dict[str, Any] | None = None
    error: str | None = None
    killed_at: float | None = None
    built: bool = False
    """Reported ready, or (a spare) built and waiting for its start."""
    launched: bool = True
    """False while a spare waits for its start."""
    rank: int = 0
    """Its rank in the replica group."""
    exited: bool = False
    """Its pipe closed: the process is gone."""
    going: bool = False
    """Told to go: it trains, and reads progress floors (``progress.py``)."""


@dataclass
class _Job:
    """The launcher's view of the run."""

    lives: list[_Life] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Every fault injected: kind, replica, monotonic time, and the kind's details."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    inbox: queue.Queue[tuple[_Life, tuple[Any, ...] | None]] = field(default_factory=queue.Queue)


def _read(life: _Life, inbox: queue.Queue[tuple[_Life, tuple[Any, ...] | None]]) -> None:
    """Forward ``life``'s messages to the launcher's inbox; None when its pipe closes."""
    try:
        while True:
            inbox.put((life, pickle.loads(life.conn.recv_bytes())))
    except (EOFError, OSError):
        inbox.put((life, None))


def _tail(path: str, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    return ""


def run_fault_tolerant(
    config: TrainConfig,
    ft: FaultToleranceConfig,
    topology: Topology,
    *,
    emulate: bool | None = None,
    timeout_s: float = 600.0,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Train ``config`` with one torchft replica group per host of ``topology`` (or
    ``ft.num_replica_groups``), injecting ``ft.faults``; return the run's record
    (``accounting.summarize_ft``, with ``group_size`` and every rank's final
    ``rank_digests``).

    Args:
        config: the run; its strategy ``TorchDDPConfig()`` (torch DDP, the gradients averaged
            across replica groups through torchft), ``CommfuseDPConfig(compressor=...)``
            (the same, each bucket through that compressor: ``replica.ft_strategy``), or a
            ``PeriodicMethod`` (``diloco(H=50)``, ...: per-period mode, ``periodic.py``).
        ft: the timeout, the replica groups and the faults to inject.
        topology: the hosts and their ranks; a replica group of several ranks trains torch
            DDP inside itself and splits what it exchanges with the other groups among its
            ranks (``group_hook.py`` per step, ``group_comm.py`` per step with a compressor
            and per period).
        emulate: force (True) or forbid (False) the emulated network; None: when possible.
        timeout_s: the whole job's deadline.
        log_dir: where each replica's output goes (``replica{R}.life{L}.log``, or
            ``replica{R}.rank{r}.life{L}.log`` in groups of several ranks); None: a
            temporary folder, removed afterwards.

    Returns:
        The record: steps committed and discarded, events, per-step digests' agreement...

    Raises:
        ValueError: replica groups that do not split the ranks evenly, faults on missing
            hosts or groups, or a strategy other than those above.
        RankError: a replica failed other than by an injected fault.
        DeadlineExceeded: the job passed ``timeout_s``.

    Example:
        ```python
        record = run_fault_tolerant(
            TrainConfig(steps=30),
            FaultToleranceConfig(faults=(KillFault(host=1, at_step=10),)),
            Topology(num_hosts=3, link_mbit=100),
        )
        assert record["replicas_agree"]
        ```
    """
    ft.check_hosts(topology.num_hosts, topology.ranks_per_host)
    ft_mode(config.strategy)  # ValueError before anything starts
    init_from_step(config)  # ValueError: a checkpoint at or past the run's total
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="commfuse-ft-"))
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        return _run(config, ft, topology, emulate=emulate, timeout_s=timeout_s, log_dir=log_dir)


def _run(
    config: TrainConfig,
    ft: FaultToleranceConfig,
    topology: Topology,
    *,
    emulate: bool | None,
    timeout_s: float,
    log_dir: str,
) -> dict[str, Any]:
    num, size = ft.group_layout(topology.num_hosts, topology.ranks_per_host)
    started = time.monotonic()
    deadline = started + timeout_s
    job = _Job()
    with Watchdog() as watchdog, open_placement(topology, emulate=emulate) as placement:
        if placement.lab_id is not None:
            watchdog.guard_lab(placement.lab_id)
        starter: _Starter | None = None
        lighthouse = None
        try:
            lighthouse = start_lighthouse(
                placement.addr_of_host(0),
                netns=placement.netns_of(0),
                timeouts=ft.timeouts,
                min_replicas=ft.min_replicas,
            )
            starter = _Starter(
                config=config,
                ft=ft,
                topology=topology,
                placement=placement,
                watchdog=watchdog,
                job=job,
                lighthouse_url=lighthouse.url,
                num=num,
                size=size,
                log_dir=log_dir,
            )
            for replica in range(num):
                starter.group(replica, 0)
            # The replacement of every replica to be killed and restarted boots with the job
            # (imports, model, DDP) and waits: a restart then takes the fault's delay, not
            # this machine's time to start a torch process.
            spares = {
                f.host: starter.group(f.host, 1)
                for f in ft.faults
                if isinstance(f, KillFault) and f.restart_after_s is not None
            }
            links = [f for f in ft.faults if isinstance(f, (CutFault, SlowFault))]
            if links and placement.lab is None:
                raise ValueError("cut and slow faults need the emulated network (netlab: root)")
            _supervise(
                job,
                ft,
                num,
                spares,
                start=starter.group,
                lab=placement.lab,
                layout=GroupLayout(group_size=size, ranks_per_host=topology.ranks_per_host),
                started=started,
                deadline=deadline,
            )
        finally:
            for entry in job.lives:
                if entry.proc.is_alive():
                    kill_group(entry.proc.pid, signal.SIGKILL)
                entry.proc.join(timeout=10)
                entry.conn.close()
            if lighthouse is not None:
                lighthouse.shutdown()
            for store in starter.stores.values() if starter is not None else ():
                store.close()
    return _summarize(config, ft, topology, job, num=num, size=size, started=started)


@dataclass(kw_only=True)
class _Starter:
    """Starts the lives of the replica groups of one run: their stores and processes."""

    config: TrainConfig
    ft: FaultToleranceConfig
    topology: Topology
    placement: Placement
    watchdog: Watchdog
    job: _Job
    """Where every life started is noted."""
    lighthouse_url: str
    num: int
    """Replica groups."""
    size: int
    """Ranks per replica group."""
    log_dir: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    ctx: ForkServerContext = field(default_factory=rank_context)
    stores: dict[tuple[int, int], HostedStore] = field(default_factory=dict)
    """One TCPStore per life of each replica group."""

    def group(self, replica: int, life: int) -> list[_Life]:
        """Start life ``life`` of replica group ``replica``: every rank of it."""
        # One TCPStore per life of a group, on its first rank's host: the Manager of a
        # group's first rank publishes its address there for the others, and a restarted
        # group must not read a killed one's.
        first = replica * self.size
        netns = self.placement.netns_of(first)
        addr = self.placement.addr_of_host(self.topology.host_of(first))
        store = self.stores[replica, life] = host_store(addr, netns=netns)
        return [self._rank(replica, life, rank, store) for rank in range(self.size)]

    def _rank(self, replica: int, life: int, rank: int, store: HostedStore) -> _Life:
        placement, size = self.placement, self.size
        where = replica * size + rank  # the rank's place in the cluster
        replica_job = ReplicaJob(
            train=self.config,
            ft=self.ft,
            replica=replica,
            num_replicas=self.num,
            life=life,
            addr=placement.addr_of_host(self.topology.host_of(where)),
            store_port=store.port,
            lighthouse=self.lighthouse_url,
            group_rank=rank,
            group_size=size,
            store_addr=store.addr,
        )
        env = _replica_env(placement, where, rank, size, store, self.run_id)
        ours, theirs = self.ctx.Pipe(duplex=True)
        name = f"replica{replica}" + (f".rank{rank}" if size > 1 else "")
        log = str(Path(self.log_dir) / f"{name}.life{life}.log")
        proc = self.ctx.Process(
            target=_replica_process,
            args=(replica_job, env, placement.netns_of(where), theirs, log),
            name=f"commfuse-{name}",
        )
        proc.start()
        theirs.close()
        assert proc.pid is not None
        self.watchdog.guard(proc.pid)
        entry = _Life(
            replica=replica,
            life=life,
            proc=proc,
            conn=ours,
            log=log,
            launched=life == 0,
            rank=rank,
        )
        self.job.lives.append(entry)
        threading.Thread(target=_read, args=(entry, self.job.inbox), daemon=True).start()
        return entry


def _summarize(
    config: TrainConfig,
    ft: FaultToleranceConfig,
    topology: Topology,
    job: _Job,
    *,
    num: int,
    size: int,
    started: float,
) -> dict[str, Any]:
    """The run's record (``accounting.summarize_ft``) with the strategy, the group size and
    every rank's final parameter digest."""
    record = summarize_ft(
        records=job.records,
        faults=job.faults,
        restarts=job.restarts,
        results=[e.result for e in job.lives if e.result is not None],
        num_replicas=num,
        steps=config.steps,
        # A replica group's slots: every one of its ranks trains its own batch.
        batch_samples=int(getattr(config.workload, "batch", 1)) * size,
        wall_s=time.monotonic() - started,
        topology=topology.describe(),
        timeouts=ft.timeouts,
        global_batch=ft.global_batch,
        mode=ft_mode(config.strategy),
        first_step=init_from_step(config),
    )
    record["strategy"] = describe_strategy(config.strategy)
    record["group_size"] = size
    # Every rank's final parameters (a replica group's ranks hold the same ones).
    record["rank_digests"] = sorted(
        (e.replica, e.rank, e.life, e.result["digest"]) for e in job.lives if e.result is not None
    )
    # Each finished rank's choices that decide the bits (``Strategy.choices``).
    record["choices"] = [
        {"replica": e.replica, "rank": e.rank, "life": e.life, **e.result.get("choices", {})}
        for e in sorted(job.lives, key=lambda e: (e.replica, e.rank, e.life))
        if e.result is not None
    ]
    return record


def _replica_env(
    placement: Placement, where: int, rank: int, size: int, store: HostedStore, run_id: str
) -> dict[str, str]:
    """The environment of the rank at ``where`` in the cluster, rank ``rank`` of a replica
    group of ``size``."""
    env = placement.env_of(where, master_addr=store.addr, master_port=store.port, run_id=run_id)
    # The replica group is its own world; the replica groups meet through torchft.
    local = placement.topology.local_rank_of(where)
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local), RUST_LOG="warn")
    for name in _TORCHFT_OVERRIDES:
        env.pop(name, None)
    return env


def _supervise(
    job: _Job,
    ft: FaultToleranceConfig,
    num: int,
    spares: dict[int, list[_Life]],
    *,
    start: Callable[[int, int], list[_Life]],
    lab: Netlab | None,
    layout: GroupLayout,
    started: float,
    deadline: float,
) -> None:
    """Go when all replicas joined; inject the faults; restart the killed; return when all
    are done (``_Supervisor``)."""
    supervisor = _Supervisor(
        job=job, ft=ft, num=num, spares=spares, start=start, lab=lab, layout=layout
    )
    try:
        while len(supervisor.done | supervisor.gone) < num:
            now = time.monotonic()
            if now > deadline:
                raise DeadlineExceeded(
                    f"fault-tolerant run: not finished within {deadline - started:.0f} s",
                    ranks=sorted(set(range(num)) - supervisor.done - supervisor.gone),
                )
            if not supervisor.went and now > started + START_TIMEOUT_S:
                raise DeadlineExceeded(
                    f"replicas did not join within {START_TIMEOUT_S:.0f} s",
                    ranks=[e.replica for e in job.lives if not e.ready],
                )
            supervisor.turn(now)
    finally:
        supervisor.links_up()


@dataclass(frozen=True)
class GroupLayout:
    """Where the replica groups sit: consecutive ranks, ``ranks_per_host`` to a host."""

    group_size: int
    ranks_per_host: int

    def of_group(self, group: int) -> dict[str, Any]:
        """A fault record's names for a fault of replica group ``group`` (a kill): the group,
        and the host of its first rank."""
        host = group * self.group_size // self.ranks_per_host
        return {"replica": group, "groups": [group], "host": host}

    def of_host(self, host: int) -> dict[str, Any]:
        """A fault record's names for a fault of emulated host ``host`` (its link cut or
        slowed): the host, and every replica group with a rank there (``replica``: the
        first)."""
        ranks = range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host)
        groups = sorted({rank // self.group_size for rank in ranks})
        return {"replica": groups[0], "groups": groups, "host": host}


#: Committed steps a live life must be behind the progress floor to be told it (``_Supervisor.
#: _update_floors``).
FLOOR_LAG = 2


@dataclass
class _Supervisor:
    """The launcher's loop, one ``turn`` at a time.

    A killed replica's next life (a spare, started with the job and built) is told to start
    ``restart_after_s`` after the kill. A cut takes a host's link down ``at_s`` after the go,
    for ``for_s``. A replica group still training ``timeout_s`` after the first one finished
    (restarted or cut off, it missed the end) is stopped and counted as gone.
    """

    job: _Job
    ft: FaultToleranceConfig
    num: int
    spares: dict[int, list[_Life]]
    """replica group -> its next life's ranks, built and waiting."""
    start: Callable[[int, int], list[_Life]]
    """Starts life L of replica group R, all its ranks (``start(R, L)``), a spare when
    L > 0."""
    lab: Netlab | None
    layout: GroupLayout
    """Which hosts hold which replica groups (a fault record names both)."""
    pending: dict[int, tuple[float, list[_Life]]] = field(default_factory=dict)
    """replica group -> (when it restarts, its spare's ranks)."""
    done: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    went: bool = False
    all_done_at: float | None = None
    cuts: list[tuple[float, CutFault | SlowFault]] = field(default_factory=list)
    """(when a link goes down or slows, the fault), from the go on."""
    down: dict[int, float] = field(default_factory=dict)
    """host -> when its link comes back up."""
    periodic: list[tuple[float, KillEveryFault, Iterator[int]]] = field(default_factory=list)
    """(when the next kill comes, the fault, its hosts), from the go on."""
    held: dict[tuple[int, int], int] = field(default_factory=dict)
    """(replica group, life) -> the steps it has committed (its reported step + 1)."""
    told: dict[tuple[int, int], int] = field(default_factory=dict)
    """(replica group, life) -> the progress floor last sent to it, while it is below it."""

    def turn(self, now: float) -> None:
        """Cuts and restarts that are due, the end of lonely replicas, then one message."""
        self._links(now)
        self._periodic_kills(now)
        for replica, (at, spare) in list(self.pending.items()):
            if now >= at:
                del self.pending[replica]
                self.job.restarts.append({"replica": replica, "t": now})
                for rank in spare:
                    rank.launched = True
                    rank.conn.send_bytes(b"start")
        if self._lonely(now):
            return
        try:
            life, message = self.job.inbox.get(timeout=0.05)
        except queue.Empty:
            return
        if message is None:
            self._exited(life)
        else:
            self._message(life, message[0], message[1], now)
        self._update_floors()

    def _floor(self) -> int:
        """The progress floor (``progress.py``): the most steps a live life has committed."""
        alive = {(e.replica, e.life) for e in self.job.lives if _alive(e)}
        return max((n for key, n in self.held.items() if key in alive), default=0)

    def _go(self, life: _Life) -> None:
        """Tell ``life`` to go, and its progress floor: 0 for the run's first lives, the floor
        for a restarted one (kept in ``told``, so that all of a group's ranks hear one value)."""
        key = (life.replica, life.life)
        floor = self.told.setdefault(key, self._floor()) if life.life > 0 else 0
        life.conn.send_bytes(b"go")
        life.conn.send_bytes(floor_message(floor))
        life.going = True

    def _update_floors(self) -> None:
        """Tell the progress floor to each live life that fell behind it, lower a told floor
        that a death lowered (so a wait ends), and forget the lives that reached theirs.

        A life is behind when it has committed at least ``FLOOR_LAG`` steps fewer than the
        floor: replicas of one quorum commit each step together, so their reports differ by
        one step at most; two mean it missed a step of a quorum that went on without it (a
        cut link, a stall). It is told once, and again only after it reached that floor.
        """
        if not self.went:
            return
        floor = self._floor()
        lives: dict[tuple[int, int], list[_Life]] = {}
        for e in self.job.lives:
            if _alive(e) and e.going:
                lives.setdefault((e.replica, e.life), []).append(e)
        for key in list(self.told):
            if key not in lives or self.held.get(key, 0) >= self.told[key]:
                del self.told[key]
        for key, ranks in lives.items():
            held = self.held.get(key, 0)
            told = self.told.get(key)
            if told is not None and floor < told:
                send = True  # lowered by a death
            else:
                send = told is None and held + FLOOR_LAG <= floor
            if send:
                self.told[key] = floor
                for rank in ranks:
                    rank.conn.send_bytes(floor_message(floor))

    def _links(self, now: float) -> None:
        for at, cut in [c for c in self.cuts if c[0] <= now]:
            self.cuts.remove((at, cut))
            assert self.lab is not None
            if isinstance(cut, SlowFault):
                self.lab.set_rate(cut.host, cut.link_mbit)
                slow = {"kind": "slow", "t": now, "link_mbit": cut.link_mbit}
                self.job.faults.append(slow | self.layout.of_host(cut.host))
                continue
            self.lab.set_link(cut.host, up=False)
            self.down[cut.host] = now + cut.for_s
            fault = {"kind": "cut", "t": now, "for_s": cut.for_s}
            self.job.faults.append(fault | self.layout.of_host(cut.host))
        for host, until in list(self.down.items()):
            if now >= until:
                del self.down[host]
                assert self.lab is not None
                self.lab.set_link(host, up=True)

    def _periodic_kills(self, now: float) -> None:
        for i, (at, fault, hosts) in enumerate(self.periodic):
            if now < at:
                continue
            self.periodic[i] = (at + fault.every_s, fault, hosts)
            host = next(hosts)
            alive = [
                r
                for r in range(self.num)
                if r not in self.done | self.gone | set(self.pending)
                and all(rank.ready for rank in _current(self.job, r))
            ]
            if host not in alive or len(alive) - 1 < self.ft.min_replicas:
                continue  # already down, or too few would be left
            life = _kill_lives(_current(self.job, host), now)
            kill = {"kind": "kill", "life": life, "t": now, "phase": "timed"}
            self.job.faults.append(kill | self.layout.of_group(host))
            spare = self.start(host, max(e.life for e in self.job.lives if e.replica == host) + 1)
            self.pending[host] = (now + fault.restart_after_s, spare)

    def links_up(self) -> None:
        """Bring back every link still down (the job ended, or failed, inside a cut)."""
        for host in list(self.down):
            assert self.lab is not None
            self.lab.set_link(host, up=True)
            del self.down[host]

    def _lonely(self, now: float) -> bool:
        lonely = [r for r in range(self.num) if r not in self.done | self.gone]
        if not self.done or not lonely:
            return False
        # Replicas in step finish within moments of each other; one still training
        # ``timeout_s`` after the first finished was out of the quorum (restarting, cut off)
        # and has nobody left to rejoin.
        self.all_done_at = now if self.all_done_at is None else self.all_done_at
        if now - self.all_done_at <= self.ft.timeout_s:
            return False
        for replica in lonely:
            self.pending.pop(replica, None)
            for rank in _current(self.job, replica):
                kill_group(rank.proc.pid, signal.SIGKILL)
            self.gone.add(replica)
        return True

    def _exited(self, life: _Life) -> None:
        """``life``'s pipe closed: its process is gone."""
        life.exited = True
        life.proc.join(timeout=10)
        code = life.proc.exitcode
        group = _ranks_of(self.job, life.replica, life.life)
        if life.result is not None:
            if all(e.result is not None for e in group):
                self.done.add(life.replica)
        elif life.replica in self.gone or any(e.killed_at is not None for e in group):
            # An injected kill (its spare waits), a life stopped above, or a rank of a killed
            # group that failed before the launcher's SIGKILL reached it.
            pass
        else:
            why = life.error or f"exited with code {code}\n{_tail(life.log)}"
            raise RankError(life.replica, f"replica {life.replica} (life {life.life}): {why}")

    def _message(self, life: _Life, kind: str, body: Any, now: float) -> None:
        if kind in ("ready", "built"):
            life.ready |= kind == "ready"
            life.built = True
            if self.went and kind == "ready":
                self._go(life)
            elif not self.went and all(e.built for e in self.job.lives):
                # Every replica joined the lighthouse and every spare is built: the first
                # quorum holds everyone, and no fault comes before its replacement is ready.
                self.went = True
                self.cuts = [
                    (now + f.at_s, f)
                    for f in self.ft.faults
                    if isinstance(f, (CutFault, SlowFault))
                ]
                self.periodic = [
                    (now + f.every_s, f, f.hosts(self.num))
                    for f in self.ft.faults
                    if isinstance(f, KillEveryFault)
                ]
                # A link cut or slowed at 0 s is so before anyone trains: told to go first,
                # a replica could have asked for its first quorum through it already.
                self._links(now)
                for entry in self.job.lives:
                    if entry.ready:
                        self._go(entry)
        elif kind == "step":
            self.job.records.append({"replica": life.replica, "life": life.life, **body})
            if body["committed"]:
                key = (life.replica, life.life)
                self.held[key] = max(self.held.get(key, 0), body["step"] + 1)
        elif kind == "kill":
            # The group's first rank kills itself; the group is one failure unit.
            _kill_lives(_ranks_of(self.job, life.replica, life.life), body["t"])
            self.job.faults.append(
                {"kind": "kill", "life": life.life, **body} | self.layout.of_group(life.replica)
            )
            kill = next(
                (f for f in self.ft.faults if isinstance(f, KillFault) and f.host == life.replica),
                None,
            )
            spare = self.spares.pop(life.replica) if life.replica in self.spares else None
            if kill is not None and kill.restart_after_s is not None and spare is not None:
                self.pending[life.replica] = (body["t"] + kill.restart_after_s, spare)
            else:
                self.gone.add(life.replica)
        elif kind == "done":
            life.result = body
        elif kind == "error":
            life.error = body


def _current(job: _Job, replica: int) -> list[_Life]:
    """The ranks of the latest life of replica group ``replica`` that was launched (not a
    spare still waiting)."""
    life = max(e.life for e in job.lives if e.replica == replica and e.launched)
    return _ranks_of(job, replica, life)


def _alive(life: _Life) -> bool:
    """Whether ``life`` runs: launched, not killed, not exited."""
    return life.launched and life.killed_at is None and not life.exited


def _ranks_of(job: _Job, replica: int, life: int) -> list[_Life]:
    """The ranks of life ``life`` of replica group ``replica``."""
    return [e for e in job.lives if (e.replica, e.life) == (replica, life)]


def _kill_lives(ranks: list[_Life], now: float) -> int:
    """SIGKILL every rank of one life of a replica group; returns the life."""
    for rank in ranks:
        rank.killed_at = now if rank.killed_at is None else rank.killed_at
        if rank.proc.is_alive():
            kill_group(rank.proc.pid, signal.SIGKILL)
    return ranks[0].life
