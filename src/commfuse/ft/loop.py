"""``ReplicaLoop``: the life of one replica group under torchft, whatever its unit of commit.

torchft's ``Manager`` (PyTorch's fault tolerance: a lighthouse that forms quorums, a commit
vote, live recovery of a joiner from a healthy peer) asks a training loop for two callbacks:
the state it serves a joiner, and what to do with the state it receives. Both modes share
everything around them; a subclass per mode (``replica.PerStepLoop``: every step is a
commit; ``periodic.PerPeriodLoop``: local SGD and DiLoCo, every period is one) says what an
attempt trains. One life of one rank of a replica group (``run``):

1. ``build``: the model, its optimizer, its communication (the mode's);
2. a spare (a restarted life) reports "built" and waits for "start": the launcher restarts
   it the moment a kill's ``restart_after_s`` has passed, not after a torch process's boot;
3. the state transport (``transport.py``) and the Manager (``make_manager``), whose
   callbacks are ``serve`` (this replica is a donor) and ``recover`` (it is a joiner);
4. "ready" goes up, "go" comes down, then the progress floor (``progress.py``);
5. ``step`` until ``done``: one attempt at a step or a period each, reported to the launcher
   as it happens (``report_step``: a killed replica's history survives it);
6. the final record (``final_record``), and the Manager and the transport shut down.

Only a replica group's first rank reports its attempts and meets a ``KillFault`` (the launcher
kills the group's other ranks with it). What a record holds, and why each mode trains as it
does: ``docs/reliability.md``, "Inside a replica: the two loops".
"""

from __future__ import annotations

import abc
import dataclasses
import os
import pickle
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore

from commfuse.ft.config import START_TIMEOUT_S, FaultToleranceConfig, KillFault
from commfuse.ft.lighthouse import announce
from commfuse.ft.progress import BehindTheRun, behind_the_run, read_floor
from commfuse.ft.require import require_torchft
from commfuse.train.loop import TrainConfig, params_digest


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaJob:
    """What the launcher tells one life of one replica group."""

    train: TrainConfig
    """The run (workload, steps, seed; the strategy as ``periods.ft_mode`` accepts it)."""
    ft: FaultToleranceConfig
    """Timeouts and faults."""
    replica: int
    """This replica group's index (its emulated host)."""
    num_replicas: int
    """Replica groups the run starts with (the data is split among them)."""
    life: int
    """0 for the first start, 1 after the first restart, ..."""
    addr: str
    """This replica's host address (it listens and is reached there)."""
    store_port: int
    """Port of this replica group's TCPStore on ``addr``."""
    lighthouse: str
    """The lighthouse's URL."""
    group_rank: int = 0
    """This rank's place in its replica group (``group_hook.py``)."""
    group_size: int = 1
    """Ranks in each replica group."""
    store_addr: str = ""
    """Address of the replica group's TCPStore ("": ``addr``; a group spanning hosts keeps
    it on its first rank's)."""

    @property
    def slot(self) -> int:
        """This rank's slot of a step's global batch (shrink: its own batch)."""
        return self.replica * self.group_size + self.group_rank

    @property
    def num_slots(self) -> int:
        """Slots of a step's global batch: every rank of every replica group."""
        return self.num_replicas * self.group_size


def send(conn: Connection, message: tuple[Any, ...]) -> None:
    """One message to the launcher (plain data, pickled here: no shared-memory tensors)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _no_report(conn: Connection, message: tuple[Any, ...]) -> None:
    """What a replica group's ranks other than its first send for a step: nothing."""


def kill_now(conn: Connection, fault: KillFault, step: int, **extra: Any) -> None:
    """Report the kill time (and ``extra``) to the launcher, then SIGKILL this replica
    group's process."""
    send(conn, ("kill", {"step": step, "t": time.monotonic(), "phase": fault.phase, **extra}))
    os.kill(os.getpid(), signal.SIGKILL)


def start_quorum_retrying(
    manager: Any, timeout_s: float | None = None, *, shrink_only: bool = False
) -> None:
    """``manager.start_quorum()``, asked again for as long as it times out: a replica cut off
    from the lighthouse (its link down) waits for its link, then rejoins by live recovery.
    The launcher stops it should the others finish first. ``timeout_s``: each request's
    (None: the Manager's ``quorum_timeout``). ``shrink_only``: the lighthouse admits only
    members of the last quorum (a newcomer waits for the next one)."""
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    while True:
        try:
            manager.start_quorum(timeout=timeout, shrink_only=shrink_only)
            return
        except TimeoutError:
            # torchft 0.2.0 keeps the failed request and raises its error again at the next
            # start_quorum; forget it, and ask anew.
            manager._quorum_future = None


def init_group_process_group(job: ReplicaJob) -> None:
    """The default process group: this replica group's own ranks (one rank: a world of one).
    A group of several meets at its own store (one per life of the group: nothing stale from
    a killed one), under a prefix of its own beside torchft's keys."""
    if job.group_size == 1:
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        return
    op_timeout = timedelta(seconds=job.ft.timeouts.op_timeout_s)
    store = TCPStore(
        job.store_addr or job.addr, job.store_port, is_master=False, timeout=op_timeout
    )
    # Its ranks start as processes of their own, seconds apart on a busy machine: they wait
    # for each other as long as a replica may take to start, then build the group, whose
    # collectives keep the operations' timeout.
    arrived = PrefixStore("commfuse/arrived", store)
    arrived.set(str(job.group_rank), "1")
    arrived.wait([str(r) for r in range(job.group_size)], timedelta(seconds=START_TIMEOUT_S))
    dist.init_process_group(
        "gloo",
        store=PrefixStore("commfuse/group", store),
        rank=job.group_rank,
        world_size=job.group_size,
        timeout=op_timeout,
    )


def make_manager(
    job: ReplicaJob,
    process_group: Any,
    transport: Any,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> Any:
    """This replica group's torchft ``Manager``: its quorum through ``job.lighthouse``, its
    collectives on ``process_group``, a joiner's state through ``transport`` (what
    ``state_dict`` returns on a healthy replica, handed to ``load_state_dict`` on the
    joiner), every wait from ``job.ft``'s one timeout, and a quorum that a joiner takes part
    in at once (``use_async_quorum=False``: it recovers inside ``start_quorum``). The
    lighthouse has heard of the replica group when this returns (``lighthouse.announce``)."""
    from torchft import Manager

    timeouts = job.ft.timeouts
    op_timeout = timedelta(seconds=timeouts.op_timeout_s)
    manager = Manager(
        pg=process_group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=job.ft.min_replicas,
        use_async_quorum=False,  # a joiner takes part in the very step it recovered in
        timeout=op_timeout,
        quorum_timeout=timedelta(seconds=timeouts.quorum_timeout_s),
        connect_timeout=op_timeout,
        rank=job.group_rank,
        world_size=job.group_size,
        store_addr=job.store_addr or job.addr,
        store_port=job.store_port,
        lighthouse_addr=job.lighthouse,
        replica_id=f"replica_{job.replica:03d}",
        hostname=job.addr,
        heartbeat_interval=timedelta(seconds=timeouts.heartbeat_interval_s),
        quorum_retries=timeouts.quorum_retries,
        checkpoint_transport=transport,
        init_sync=False,  # every replica builds the same model from the seed
    )
    if job.group_rank == 0:
        # Known to the lighthouse before this replica reports ready (``lighthouse.announce``).
        from torchft.manager import REPLICA_ID_KEY

        store = TCPStore(
            job.store_addr or job.addr, job.store_port, is_master=False, timeout=op_timeout
        )
        announce(job.lighthouse, store.get(REPLICA_ID_KEY).decode(), op_timeout)
    return manager


class ReplicaLoop(abc.ABC):
    """One life of one rank of a replica group (module docstring); ``run`` trains it.

    A subclass builds the model and its communication (``build``), gives the Manager to what
    needs it (``connect``), says when the run is over (``done``), trains one attempt per
    ``step`` and reports it with ``report_step``, and names its state (``state_dict``,
    ``load_state_dict``); ``serve`` and ``recover`` are the Manager's callbacks.

    Args:
        job: the replica group, its life and the run.
        conn: the launcher's end: "ready" and the per-attempt records go up, "go" comes down.
    """

    workload: Any
    """The run's workload (``build``)."""
    module: torch.nn.Module
    """The replica's model (``build``)."""

    def __init__(self, job: ReplicaJob, conn: Connection) -> None:
        require_torchft()
        from commfuse.ft.process_group import AlarmedProcessGroupGloo

        self.job, self.conn = job, conn
        self.op_timeout = timedelta(seconds=job.ft.timeouts.op_timeout_s)
        self.device = torch.device("cpu")
        # The process group of the quorum: the Manager reconfigures it at each quorum change.
        self.process_group = AlarmedProcessGroupGloo(timeout=self.op_timeout)
        kills = [f for f in job.ft.faults if isinstance(f, KillFault) and f.host == job.replica]
        # The group's first rank meets the fault; the launcher kills the group's other ranks.
        self.kill = kills[0] if kills and job.life == 0 and job.group_rank == 0 else None
        # The group's first rank reports its attempts (the others train the same in step).
        self.report = send if job.group_rank == 0 else _no_report
        self.floor = 0
        """The progress floor (``progress.py``), as the launcher last said it."""
        self.behind = False
        """Whether the attempt in progress is behind the floor (it trains nothing)."""

    @abc.abstractmethod
    def build(self) -> None:
        """The model, its optimizer and communication; for a spare, all it does before the
        launcher says "start"."""

    def make_transport(self) -> Any:
        """What carries a joiner's state: ``ChecksummedHTTPTransport`` on this host."""
        from commfuse.ft.transport import ChecksummedHTTPTransport

        return ChecksummedHTTPTransport(self.job.addr, timeout=self.op_timeout)

    @abc.abstractmethod
    def connect(self) -> None:
        """Give ``self.manager`` to what needs it (the hook, the communicator)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the run's last step is committed."""

    @abc.abstractmethod
    def step(self, t0: float) -> None:
        """One attempt, begun at monotonic time ``t0``, ending with ``report_step``."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This replica's state, as a joiner takes it over."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over ``state_dict``'s ``state``."""

    @abc.abstractmethod
    def digests(self, step: int, committed: bool) -> dict[str, str | None]:
        """The digests that attempt ``step``'s record carries (None: not computed)."""

    @abc.abstractmethod
    def steps_done(self) -> int:
        """The steps this replica committed (inner steps in per-period mode)."""

    def serve(self) -> dict[str, Any]:
        """The Manager's ``state_dict``: what this replica hands a joiner."""
        return self.state_dict()

    def recover(self, state: dict[str, Any]) -> None:
        """The Manager's ``load_state_dict``: a donor's state arrived, inside the quorum."""
        self.load_state_dict(state)

    def run(self) -> dict[str, Any]:
        """Train until ``done`` (module docstring); returns ``final_record``."""
        job, conn = self.job, self.conn
        self.build()
        if job.life > 0:
            # A spare: everything is built; the launcher says when the restart happens.
            send(conn, ("built", {"replica": job.replica, "life": job.life}))
            if conn.recv_bytes() != b"start":
                raise RuntimeError("the launcher did not say start")
        self.transport = self.make_transport()
        self.manager = make_manager(
            job, self.process_group, self.transport, self.serve, self.recover
        )
        self.connect()
        send(conn, ("ready", {"replica": job.replica, "life": job.life}))
        if conn.recv_bytes() != b"go":
            raise RuntimeError("the launcher did not say go")
        # The progress floor follows the go; a death may lower it later.
        self.floor = read_floor(conn, wait=True)
        try:
            while not self.done():
                t0 = time.monotonic()
                self.floor = read_floor(conn, self.floor)
                self.step(t0)
            return self.final_record()
        finally:
            self.shutdown()

    def check_behind(self, step: int) -> bool:
        """Whether the quorum's ``step`` is behind the progress floor; if so the attempt
        fails (reported to the Manager) and trains nothing."""
        self.behind = behind_the_run(step, self.floor, self.job.group_size, self.device)
        if self.behind:
            self.manager.report_error(BehindTheRun(step, self.floor))
        return self.behind

    def report_step(
        self,
        *,
        step: int,
        committed: bool,
        participants: int,
        quorum: list[int] | None,
        loss: float | None,
        samples: list[int] | None,
        t0: float,
        t_quorum: float,
        t_backward: float,
        healed: bool,
        bytes_sent: int,
        **extra: Any,
    ) -> None:
        """Send the launcher attempt ``step``'s record: what both modes report, the mode's
        ``extra`` (times, counts), the end time, ``digests``, and the Manager's error. An
        attempt behind the run then waits a heartbeat: for the next quorum, not a spin."""
        error = self.manager.errored()
        record = {
            "step": step,
            "committed": bool(committed),
            "participants": participants,
            "quorum": quorum,
            "loss": loss,
            "samples": samples,
            "t0": t0,
            "t_quorum": t_quorum,
            "t_backward": t_backward,
            **extra,
            "t": time.monotonic(),
            **self.digests(step, committed),
            "healed": healed,
            "bytes": bytes_sent,
            "error": None if error is None else str(error.original_exception),
            "behind": self.floor if self.behind else None,
        }
        self.report(self.conn, ("step", record))
        if self.behind:
            time.sleep(self.job.ft.timeouts.heartbeat_interval_s)

    def final_record(self) -> dict[str, Any]:
        """What the launcher gets at the end: the model's held-out scores (with
        ``evaluate``) and digest, the committed steps, the bytes of state received and
        served."""
        held_out = self.workload.evaluate(self.module) if self.job.train.evaluate else {}
        return {
            "replica": self.job.replica,
            "group_rank": self.job.group_rank,
            "life": self.job.life,
            "eval_loss": held_out.get("loss"),
            "eval_accuracy": held_out.get("accuracy"),
            "digest": params_digest(self.module),
            "step": self.steps_done(),
            "recovered_bytes": self.transport.bytes_received,
            "served_bytes": self.transport.bytes_sent,
        }

    def shutdown(self) -> None:
        """Stop the Manager and the transport without waiting for their threads."""
        self.manager.shutdown(wait=False)
        self.transport.shutdown(wait=False)
