"""What a fault-tolerant run is configured with: one timeout, replica groups and faults.

One setting, ``timeout_s``, decides how fast a dead peer is noticed, and every other wait is
derived from it (``Timeouts``), so that no layer waits on a dead peer far longer than the
others (torchft's defaults are 60 s for the Manager and gloo and 5 s for the lighthouse's
heartbeat, set in three places):

1. the lighthouse declares a replica dead when it has not heard its heartbeat for
   ``timeout_s``, and waits as long for the stragglers of a new quorum;
2. each replica's Manager heartbeats five times per ``timeout_s``: enough that one late
   heartbeat does not drop a live replica, few enough that the heartbeats' RPCs (a replica's
   Manager thread and the lighthouse each spend CPU on every one) stay a small share of a
   step on a machine whose cores the replicas share;
3. a collective, a commit vote and the transfer of a joiner's state may take
   ``_OP_TIMEOUT_FACTOR * timeout_s``: longer than a heartbeat, since a large message on a slow
   link is not a failure, but bounded, so a peer cut off without closing its sockets (a link
   that is down) is noticed by gloo too;
4. in per-period mode (local SGD, DiLoCo: ``commfuse.ft.periodic``) a quorum is asked for
   at the start of each period, and a replica that joins mid-period waits for the others to
   finish theirs: its quorum request may take ``_PERIOD_COVER`` periods more, a period's time
   being measured by the replica itself (``Timeouts.period_quorum_timeout_s``);
5. the launcher's own deadlines (a replica's start-up, the whole job) are commfuse's and are
   the job's ``timeout_s`` in ``run_fault_tolerant``.

This module imports neither torch nor torchft: the command line builds these objects.

Design notes: ``docs/reliability.md``, "One timeout: a replica killed outright".
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Literal, TypeAlias

#: Collectives, commit votes and state transfers may take this many ``timeout_s``.
_OP_TIMEOUT_FACTOR = 5.0
#: Heartbeats per ``timeout_s``.
_HEARTBEATS_PER_TIMEOUT = 5
#: Periods a quorum request covers on top of ``quorum_timeout_s`` in per-period mode.
_PERIOD_COVER = 2.0
#: Seconds a replica may take from its start to joining the lighthouse (and the ranks of a
#: replica group to find each other: separate processes, seconds apart on a busy machine).
START_TIMEOUT_S = 120.0
#: Quorum requests a Manager repeats after a timeout before its replica gives up.
_QUORUM_RETRIES = 3
#: Who trains a missing replica group's samples (``data.py``): ``fixed`` keeps the global
#: batch by giving the survivors more samples per step, ``shrink`` lets it shrink.
GlobalBatch: TypeAlias = Literal["fixed", "shrink"]
GLOBAL_BATCH_CHOICES: tuple[GlobalBatch, ...] = ("fixed", "shrink")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Every wait of a fault-tolerant run, derived from one ``timeout_s`` (``derive``)."""

    heartbeat_timeout_s: float
    """The lighthouse drops a replica it has not heard from for this long."""
    join_timeout_s: float
    """The lighthouse waits this long for heartbeating stragglers before forming a quorum."""
    quorum_tick_s: float
    """How often the lighthouse re-checks a quorum it is waiting for."""
    heartbeat_interval_s: float
    """Each replica's Manager heartbeats this often."""
    op_timeout_s: float
    """A collective (gloo), a commit vote, a state transfer: the Manager's ``timeout``."""
    quorum_timeout_s: float
    """How long a Manager waits for the lighthouse to form a quorum."""
    quorum_retries: int
    """How many times a Manager asks again for a quorum that timed out (a replica cut off
    from the lighthouse keeps asking until its link is back)."""

    @classmethod
    def derive(cls, timeout_s: float) -> Timeouts:
        """Every timeout from the one setting (see the module docstring).

        Raises:
            ValueError: ``timeout_s`` is not positive.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        op = _OP_TIMEOUT_FACTOR * timeout_s
        return cls(
            heartbeat_timeout_s=timeout_s,
            join_timeout_s=timeout_s,
            quorum_tick_s=min(0.1, timeout_s / 20),
            heartbeat_interval_s=timeout_s / _HEARTBEATS_PER_TIMEOUT,
            op_timeout_s=op,
            # A quorum waits for a dead peer's heartbeat to expire, then for the join timeout.
            quorum_timeout_s=op + 2 * timeout_s,
            quorum_retries=_QUORUM_RETRIES,
        )

    def period_quorum_timeout_s(self, period_s: float) -> float:
        """How long a replica of per-period mode waits for a quorum when a period takes
        ``period_s`` seconds (its inner steps, as the replica measured them): a joiner asks
        while the others are in the middle of a period, and the quorum forms when they
        finish it.

        Raises:
            ValueError: ``period_s`` is negative.
        """
        if period_s < 0:
            raise ValueError(f"period_s must be >= 0, got {period_s}")
        return self.quorum_timeout_s + _PERIOD_COVER * period_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillFault:
    """SIGKILL one replica group's ranks at a step, and start them again after a delay."""

    host: int
    """The replica group whose ranks are killed: with one group per emulated host (the
    default), that host."""
    at_step: int
    """The step during which they are killed (0-based; in per-period mode an inner step)."""
    phase: Literal["allreduce", "compute"] = "allreduce"
    """allreduce: as the step's first gradient allreduce is handed to gloo, before any of it
    leaves, so that every peer's allreduce of the step waits for a part that never comes (in
    per-period mode the first outer exchange at or after ``at_step``); compute: before the
    forward pass."""
    restart_after_s: float | None = 5.0
    """Seconds from the kill to the restart; None: never restarted."""

    def __post_init__(self) -> None:
        if self.host < 0 or self.at_step < 0:
            raise ValueError(f"host and at_step must be >= 0, got {self.host}, {self.at_step}")
        if self.phase not in ("allreduce", "compute"):
            raise ValueError(f"phase must be allreduce or compute, got {self.phase!r}")
        if self.restart_after_s is not None and self.restart_after_s < 0:
            raise ValueError(f"restart_after_s must be >= 0, got {self.restart_after_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CutFault:
    """Take one host's link down for a while (``ip link set down`` on its veth, then up): its
    frames are lost and its sockets stay open, so its peers notice only by their timeouts."""

    host: int
    """The emulated host whose link goes down."""
    at_s: float
    """Seconds after the replicas start training (0: down before any of them begins)."""
    for_s: float = 5.0
    """Seconds the link stays down."""

    def __post_init__(self) -> None:
        if self.host < 0 or self.at_s < 0 or not self.for_s > 0:
            raise ValueError(
                f"host and at_s must be >= 0 and for_s > 0, got {self.host}, {self.at_s}, "
                f"{self.for_s}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowFault:
    """Slow one host's link down to a rate (its ``tbf`` on both ends of its veth): a straggler
    that every synchronous step waits for."""

    host: int
    """The emulated host whose link is slowed."""
    link_mbit: float
    """Its new rate, Mbit/s in each direction (``10mbit`` on the command line)."""
    at_s: float = 0.0
    """Seconds after the replicas start training."""

    def __post_init__(self) -> None:
        if self.host < 0 or self.at_s < 0 or not self.link_mbit > 0:
            raise ValueError(
                f"host and at_s must be >= 0 and link_mbit > 0, got {self.host}, {self.at_s}, "
                f"{self.link_mbit}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillEveryFault:
    """SIGKILL a replica group every ``every_s`` seconds, the host drawn from a seeded
    generator (the same schedule for the same seed), and restart it ``restart_after_s`` after
    the kill or once its new process is built, whichever is later. A kill that would leave
    fewer than ``min_replicas`` replica groups alive is skipped."""

    every_s: float
    """Seconds between kills, from the start of training."""
    restart_after_s: float = 5.0
    """Seconds from a kill to the restart (at the earliest)."""
    seed: int = 0
    """Seed of the hosts' draw."""

    def __post_init__(self) -> None:
        if not self.every_s > 0 or self.restart_after_s < 0:
            raise ValueError(
                f"every_s must be > 0 and restart_after_s >= 0, got {self.every_s}, "
                f"{self.restart_after_s}"
            )

    def hosts(self, num_hosts: int) -> Iterator[int]:
        """The hosts to kill, in order (endless; deterministic in ``seed``)."""
        draw = random.Random(self.seed)
        while True:
            yield draw.randrange(num_hosts)


#: Every fault that a run can inject.
Fault: TypeAlias = "KillFault | CutFault | SlowFault | KillEveryFault"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultToleranceConfig:
    """Fault-tolerant data parallelism on torchft: one replica group per emulated host, or
    ``num_replica_groups`` of them."""

    timeout_s: float = 2.0
    """A peer silent this long is dead; every other timeout derives from it (``Timeouts``)."""
    min_replicas: int = 1
    """Fewest replica groups that may commit a step (the lighthouse forms no smaller
    quorum)."""
    faults: tuple[Fault, ...] = ()
    """Faults to inject (``KillFault``, ``CutFault``, ``SlowFault``, ``KillEveryFault``)."""
    global_batch: GlobalBatch = "shrink"
    """While a replica group is missing: ``fixed``, the survivors train its samples too (more
    per step, the global batch unchanged); ``shrink``, its samples are lost (``data.py``)."""
    num_replica_groups: int | None = None
    """Replica groups the ranks (hosts x ranks per host) are split into, consecutive ranks
    together; None: one per host. A group of several ranks trains torch DDP inside itself and
    meets the other groups rank by rank through torchft (``group_hook.py``,
    ``group_comm.py``); it is one
    failure unit: a kill takes all its ranks, a restart recovers each from its peer rank."""
    digest_every_steps: int | None = None
    """Per-step mode: every replica hashes its parameters (SHA-256) after every this many
    committed steps, so that the record compares them step by step (``step_digests_agree``);
    None: after the last step only (``replicas_agree``), as a run without torchft does."""

    def __post_init__(self) -> None:
        Timeouts.derive(self.timeout_s)  # ValueError on a bad timeout
        if self.digest_every_steps is not None and self.digest_every_steps < 1:
            raise ValueError(
                "digest_every_steps must be at least 1 (None: the last step only), "
                f"got {self.digest_every_steps}"
            )
        if self.global_batch not in GLOBAL_BATCH_CHOICES:
            raise ValueError(
                f"global_batch must be one of {', '.join(GLOBAL_BATCH_CHOICES)}, "
                f"got {self.global_batch!r}"
            )
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {self.min_replicas}")
        if self.num_replica_groups is not None and self.num_replica_groups < 1:
            raise ValueError(
                f"num_replica_groups must be at least 1, got {self.num_replica_groups}"
            )
        for fault in self.faults:
            if not isinstance(fault, (KillFault, CutFault, SlowFault, KillEveryFault)):
                raise ValueError(
                    "faults must be KillFault, CutFault, SlowFault or KillEveryFault objects, "
                    f"got {type(fault).__name__}"
                )
        hosts = [f.host for f in self.faults if isinstance(f, KillFault)]
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"at most one kill per host, got hosts {sorted(hosts)}")

    @property
    def timeouts(self) -> Timeouts:
        """Every wait, derived from ``timeout_s``."""
        return Timeouts.derive(self.timeout_s)

    def group_layout(self, num_hosts: int, ranks_per_host: int = 1) -> tuple[int, int]:
        """(replica groups, ranks per group) of a cluster of ``num_hosts`` x
        ``ranks_per_host`` ranks: ``num_replica_groups`` of them, or one per host.

        Raises:
            ValueError: the groups do not split the ranks evenly.
        """
        ranks = num_hosts * ranks_per_host
        groups = num_hosts if self.num_replica_groups is None else self.num_replica_groups
        if ranks % groups:
            raise ValueError(
                f"{groups} replica groups do not split {num_hosts} hosts x {ranks_per_host} "
                f"ranks evenly; pick a divisor of {ranks}"
            )
        return groups, ranks // groups

    def check_hosts(self, num_hosts: int, ranks_per_host: int = 1) -> None:
        """ValueError unless the replica groups split the ranks evenly, every fault names a
        host (a cut or slow link) or a replica group (a kill) of the run, and a quorum of
        ``min_replicas`` can exist.

        Raises:
            ValueError: a fault out of range, groups that do not split the ranks, or
                ``min_replicas`` more than the replica groups.
        """
        groups, _ = self.group_layout(num_hosts, ranks_per_host)
        if self.min_replicas > groups:
            raise ValueError(
                f"min_replicas {self.min_replicas} is more than the {groups} replica groups"
            )
        for fault in self.faults:
            if isinstance(fault, KillFault) and fault.host >= groups:
                raise ValueError(f"kill of group {fault.host}: the run has {groups} groups")
            if isinstance(fault, (CutFault, SlowFault)) and fault.host >= num_hosts:
                raise ValueError(f"fault on host {fault.host}: the run has {num_hosts} hosts")
