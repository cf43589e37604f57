"""Per-period fault tolerance: local SGD, DiLoCo and streaming DiLoCo on torchft.

DiLoCo (Douillard et al., "DiLoCo: Distributed low-communication training of language
models", 2023) lets every replica train alone for H inner steps and meet only to average its
pseudo-gradient ``anchor - params``, to which an outer optimizer is applied; streaming DiLoCo
(Douillard et al., "Streaming DiLoCo with overlapping communication", 2025) synchronises the
model fragment by fragment at staggered steps. torchft decides who meets; the unit of commit
is a *period*, the inner steps up to a synchronisation and it (``periods.sync_points``: every
H steps for DiLoCo, F times per H for streaming DiLoCo, every step of a warm-up). Per period
(``PerPeriodLoop.step``), on each replica group:

1. ``start_quorum`` at the period's start (a retry's ``shrink_only``: the failed quorum's
   survivors); a replica that is behind receives a healthy one's state (``transport.py``)
   and trains the period as a full member, skipping the inner steps it is late by;
2. a snapshot of this replica's state, what a period that fails early rolls back to;
3. the inner steps, no quorum and no communication among them, each on its own batch
   (``data.py``), through commfuse's ``PeriodicSyncOptimizer`` over the quorum
   (``QuorumComm``; ``GroupQuorumComm`` for a group of several ranks, each sending its shard):
   at the period's end the pseudo-gradient is averaged across the quorum (compressed by the
   method's outer compressor, if any), then the outer step;
4. ``should_commit``: the period counts only if none of its exchanges failed. A failed
   exchange keeps the inner steps: each replica rolls back to just before the period's last
   optimizer step, with that step's gradients, and retries only that step and the exchange.

Cost without faults: a quorum and a commit vote per period, not per step. Without faults the
run equals the run without torchft bit for bit with two replicas, or an all-gather outer
compressor. Why the retry keeps the inner steps, what it rolls back, what a joiner receives
and skips, why not torchft's own ``DiLoCo``: ``docs/reliability.md``, "Per-period mode" and
"Inside a replica: the two loops".
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commfuse.ft.init_from import load_init_from
from commfuse.ft.loop import (
    ReplicaJob,
    ReplicaLoop,
    init_group_process_group,
    kill_now,
    start_quorum_retrying,
)
from commfuse.ft.periods import ft_periodic_config, sync_points
from commfuse.ft.replica import step_batch
from commfuse.localsgd import PeriodicMethod, PeriodicSyncOptimizer
from commfuse.train.loop import param_fingerprints
from commfuse.train.lr_schedule import ScheduledRates
from commfuse.train.periodic import periodic_choices
from commfuse.train.torch_ddp import bucket_caps, ddp_choices
from commfuse.workloads import make_workload


def state_digest(obj: object) -> str:
    """SHA-256 (16 hex digits) of a nest of dicts, lists, tensors and plain values: every
    tensor's dtype, shape and bytes, every other value's ``repr``, dict items by key."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()[:16]


def _feed(digest: Any, obj: object) -> None:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().contiguous().cpu()
        digest.update(f"T{flat.dtype}{tuple(flat.shape)}".encode())
        digest.update(flat.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        digest.update(b"{")
        for key in sorted(obj, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, obj[key])
        digest.update(b"}")
    elif isinstance(obj, (list, tuple)):
        digest.update(b"[")
        for value in obj:
            _feed(digest, value)
        digest.update(b"]")
    else:
        digest.update(repr(obj).encode())


def _part_digests(state: dict[str, Any]) -> dict[str, str]:
    """``state_digest`` of each part of a replica's state (``model``, ``anchors``,
    ``outer_momenta``, ``inner_optimizer``, ``compressor``, ``pending``, ``counters``,
    ``rng``): what a donor served and a joiner loaded are compared part by part."""
    periodic = state["periodic"]
    parts = {
        "model": state["model"],
        "anchors": periodic["anchors"],
        "outer_momenta": periodic["momenta"],
        "inner_optimizer": periodic["inner"],
        "compressor": periodic["compressor"],
        "pending": periodic["pending"],
        "counters": [periodic["step_count"], periodic["exchanges_started"], periodic["in_sync_at"]],
        "rng": state["torch_rng"],
    }
    return {name: state_digest(part) for name, part in parts.items()}


def _time_inner_step(workload: Any, module: torch.nn.Module, job: ReplicaJob) -> float:
    """Seconds of one forward and backward here, on a copy of ``module`` (a forward may
    change buffers, such as batch norm's statistics): the first estimate of a period's time,
    before any period was measured."""
    probe = copy.deepcopy(module)
    batch = workload.batch(0, job.replica, job.num_replicas, seed=job.train.seed)
    start = time.monotonic()
    workload.loss(probe, batch).backward()
    return time.monotonic() - start


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """A copy of every parameter's gradient (None where it has none)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    """Give every parameter the gradient ``_grads`` copied."""
    if len(grads) != len(params):
        raise RuntimeError(f"{len(grads)} gradients kept for {len(params)} parameters")
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def work_kept_for_retry(
    pre_sync: dict[str, Any] | None, kept: dict[str, Any], *, retrying: bool
) -> dict[str, Any]:
    """What a failed attempt at a period keeps for the next attempt (module docstring).

    ``pre_sync`` is the attempt's point before the period's last optimizer step (None: the
    attempt failed before it got there), ``kept`` what the attempt began with, ``retrying``
    whether it was a retry of the exchange. An attempt that failed at its exchange keeps its
    inner steps (the last step's gradients, the losses, the samples, the skipped count). A
    retry that failed before its exchange (its quorum's process group could not be built: a
    peer died meanwhile) rolls back to where it began, the point before the last optimizer
    step, so it keeps what it began with: were it to keep nothing, the next attempt would
    find this replica an inner step short of the period's end and not retrying. A first
    attempt that failed before its exchange rolls back to the period's start and keeps
    nothing.
    """
    if pre_sync is not None:
        return {k: pre_sync[k] for k in ("grads", "losses", "samples", "skipped")}
    return dict(kept) if retrying else {}


@dataclasses.dataclass(kw_only=True)
class _Attempt:
    """What one attempt at a period did, as far as it got (an exchange may fail anywhere)."""

    skip: int
    """The inner steps it skipped (a late joiner's), or the failed attempt's it resumes."""
    inner_s: float
    """Seconds per inner step, measured when it trains more than one."""
    losses: list[float] = dataclasses.field(default_factory=list)
    samples: list[int] | None = None
    trained: int = 0
    """Forward and backward passes."""
    pre_sync: dict[str, Any] | None = None
    """The point before the period's last optimizer step, with that step's gradients, its
    losses and samples: what a failed exchange rolls back to (None: the period's start)."""


class PerPeriodLoop(ReplicaLoop):
    """A replica group's rank that commits every period (module docstring).

    Raises:
        ValueError: a strategy that is not a ``PeriodicMethod``, or that
            ``periods.ft_periodic_config`` refuses (from ``run``).
    """

    def build(self) -> None:
        """The model, its inner optimizer under ``PeriodicSyncOptimizer`` over the quorum,
        the periods, and a first measure of an inner step's time."""
        from commfuse.ft.group_comm import GroupQuorumComm
        from commfuse.ft.quorum_comm import QuorumComm

        job = self.job
        strategy = job.train.strategy
        if not isinstance(strategy, PeriodicMethod):
            raise ValueError(
                f"per-period mode runs a PeriodicMethod, got {type(strategy).__name__}"
            )
        # A copy: this replica owns its compressor's state.
        self.config = config = copy.deepcopy(ft_periodic_config(strategy))
        self.workload = workload = make_workload(job.train.workload, device=self.device)
        self.module = module = workload.build_model(job.train.seed)
        self.optimizer = workload.make_optimizer(module)
        # Each inner step's rate is a function of its step in the whole run (``rates.apply``).
        self.rates = ScheduledRates(job.train.lr_schedule, self.optimizer, job.train.steps)
        # With init_from, the run's inner steps are those after the checkpoint's step
        # (``first``): the periods count from there, each inner step trains the batch of its
        # step in the whole run (``init_from.py``).
        self.first = load_init_from(job.train, module, self.optimizer)
        self.quorum = QuorumComm(self.process_group)
        self.comm: QuorumComm | GroupQuorumComm = self.quorum
        self.trainer: torch.nn.Module = module
        if job.group_size > 1:
            # A group of several ranks: torch DDP inside it at every inner step (over the
            # host's loopback), so its ranks hold the same replica; its outer exchanges are
            # split among its ranks, each sending its shard across groups (group_comm.py).
            init_group_process_group(job)
            group = dist.distributed_c10d._get_default_group()
            self.trainer = DistributedDataParallel(
                module, **bucket_caps(job.train.bucket_cap_mb, None)
            )
            self.comm = GroupQuorumComm(self.quorum, group, job.group_rank, job.group_size)
        # The quorum's communicator speaks the Communicator interface the optimizer uses.
        self.periodic = PeriodicSyncOptimizer(self.optimizer, module, self.comm, config)  # type: ignore[arg-type]
        self.points = sync_points(config, job.train.steps - self.first)
        self.longest = max(b - a for a, b in zip([0, *self.points], self.points, strict=False))
        # The longest a period took here per inner step: the quorum's timeout follows it.
        self.step_s = _time_inner_step(workload, module, job)
        # An inner step's time as measured in the last committed period (a joiner's measure
        # of how late it is, served with the state).
        self.inner_step_s = self.step_s
        # When each state transfer to this replica began, and the inner steps a joiner skips.
        self.recv_started: list[float] = []
        self.catch_up: int | None = None
        # The work a period whose exchange failed keeps for its retry (see the module
        # docstring): the gradients of its last inner step (this replica is one optimizer
        # step and one exchange short of the period's end), and its losses and samples.
        # Empty at a period's start.
        self.kept: dict[str, Any] = {}
        # What this replica served and recovered since the last period's start, part by part.
        self.served: list[dict[str, str]] = []
        self.recovered: list[dict[str, str]] = []
        self.inner_now, self.period_now = -1, -1

    def make_transport(self) -> Any:
        """The state transport, noting when a transfer to this replica begins."""
        return _timed_transport(self.job.addr, self.op_timeout, self.recv_started)

    def connect(self) -> None:
        from commfuse.ft.group_comm import GroupQuorumComm

        if isinstance(self.comm, GroupQuorumComm):
            self.comm.manager = self.manager
        self.quorum.on_issue = self._on_issue

    def _on_issue(self) -> None:
        kill = self.kill
        if kill is not None and kill.phase == "allreduce" and self.inner_now >= kill.at_step:
            kill_now(self.conn, kill, self.inner_now, period=self.period_now)

    def done(self) -> bool:
        return bool(self.manager.current_step() >= len(self.points))

    def steps_done(self) -> int:
        return self.first + self.periodic.step_count

    def state_dict(self) -> dict[str, Any]:
        """The model, the periodic optimizer's state (anchors, outer momenta, inner
        optimizer, compressor, counters), the random state and an inner step's time; in a
        failed period, the last inner step's gradients (module docstring)."""
        state = {
            "model": self.module.state_dict(),
            "periodic": self.periodic.state_dict(),
            "torch_rng": torch.get_rng_state(),
            # How long an inner step takes here: a joiner's measure of how late it is.
            "inner_step_s": self.inner_step_s,
        }
        if self.kept:
            # A joiner admitted to a retry (its recovery failed: module docstring) receives
            # the donor's point in the period.
            state["grads"] = self.kept["grads"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.periodic.load_state_dict(state["periodic"])
        torch.set_rng_state(state["torch_rng"])

    def serve(self) -> dict[str, Any]:
        # The Manager asks only when a peer recovers from this replica: at a period's start.
        state = self.state_dict()
        self.served.append(_part_digests(state))
        return state

    def recover(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self.kept.clear()
        # The others began the period when the quorum formed; this replica begins it once
        # its state has arrived and is loaded, that many inner steps later.
        late_s = time.monotonic() - self.recv_started[-1] if self.recv_started else 0.0
        per_step = float(state.get("inner_step_s") or 0.0)
        self.catch_up = int(late_s / per_step) if per_step > 0 else 0
        if state.get("grads") is not None:
            # The others retry the exchange of a period this replica did not train (its own
            # recovery into that period failed, which made it a member of the failed
            # quorum): it takes the donor's last step, so the quorum's average weighs the
            # donor's pseudo-gradient twice; it names no samples of its own.
            self.kept.update(grads=state["grads"], losses=[], samples=None, skipped=0)
        self.recovered.append(_part_digests(self.state_dict()))  # what this replica holds now

    def step(self, t0: float) -> None:
        """One attempt at the period the quorum is at (module docstring)."""
        manager = self.manager
        timeout_s = self.job.ft.timeouts.period_quorum_timeout_s(self.step_s * self.longest)
        # A retry's quorum is the failed one's survivors (see the module docstring).
        start_quorum_retrying(manager, timeout_s, shrink_only=bool(self.kept))
        t_quorum = time.monotonic()
        healed = self.recovered[-1] if self.recovered else None
        served_now = self.served[-1] if self.served else None
        self.recovered.clear()
        self.served.clear()
        period = self.period_now = manager.current_step()
        begin, end = (self.points[period - 1] if period else 0), self.points[period]
        self.check_behind(period)  # if so, it trains nothing and its exchanges are abandoned
        if manager.errored() is None:  # else the group may not be built
            self.comm.at_quorum(manager.participating_rank() or 0, self.process_group.members())
        participants, quorum_id = manager.num_participants(), self.process_group.quorum
        snapshot = copy.deepcopy(self.state_dict())
        # A retry of the exchange (``recover`` may have made this replica one, in the quorum).
        resume = bool(self.kept)
        late = self.catch_up or 0
        self.catch_up = None
        attempt = _Attempt(
            skip=self._steps_to_skip(late if healed is not None and not resume else 0, end - begin),
            inner_s=self.inner_step_s,
        )
        syncs, sent_before = len(self.periodic.syncs), self.quorum.bytes_sent
        self._train(attempt, period, begin, end, snapshot, resume)
        t_sync = time.monotonic()
        committed = manager.should_commit()
        if committed:
            self.step_s = max(self.step_s, (t_sync - t_quorum) / (end - begin))
            if attempt.trained > 1 and not resume:
                self.inner_step_s = attempt.inner_s
            self.kept.clear()
        else:
            self._roll_back(attempt, snapshot, syncs, resume)
        self.report_step(
            step=period,
            committed=committed,
            participants=participants,
            quorum=quorum_id,
            loss=sum(attempt.losses) / len(attempt.losses) if attempt.losses else None,
            samples=attempt.samples,
            t0=t0,
            t_quorum=t_quorum,
            t_backward=t_sync,
            healed=healed is not None,
            bytes_sent=self.quorum.bytes_sent - sent_before,
            first_step=self.first + begin,
            inner_steps=end - begin,
            # A failed attempt whose inner steps the retry keeps; a retry.
            kept=bool(self.kept),
            retry=resume,
            trained_steps=attempt.trained,
            skipped_steps=attempt.skip,
            losses=attempt.losses,
            healed_parts=healed,
            served_parts=served_now,
        )

    def _steps_to_skip(self, late: int, inner_steps: int) -> int:
        """The first inner steps of the period a joiner late by ``late`` skips (module
        docstring), at most all but one, so that the others do not wait for it at the
        exchange: its pseudo-gradient covers fewer steps, and its share of the skipped ones
        is lost. Only where a period is one exchange of the whole model (not streaming
        DiLoCo's fragments, whose exchanges land at fixed inner steps)."""
        skip = late
        if self.config.num_fragments > 1 or self.config.overlap_steps > 0:
            skip = 0
        skip = min(skip, inner_steps - 1)
        if self.job.group_size > 1:
            # Every rank of the group measured its own lateness: the group skips as one (its
            # ranks' DDP collectives must pair up), by the latest rank's count.
            agreed = torch.tensor([skip], device=self.periodic.params[0].device)
            dist.all_reduce(agreed, dist.ReduceOp.MAX)
            skip = int(agreed)
        return skip

    def _train(
        self,
        attempt: _Attempt,
        period: int,
        begin: int,
        end: int,
        snapshot: dict[str, Any],
        resume: bool,
    ) -> None:
        """The period's inner steps ``[begin, end)`` and its exchange, or for a retry
        (``resume``) the last inner step's update and the exchange; an exchange that fails
        is reported to the Manager and raises the quorum's alarm."""
        manager, periodic = self.manager, self.periodic
        if manager.errored() is not None:
            # Its recovery failed, or it is behind the run: this replica cannot train the
            # period; the others' exchanges with it are abandoned now rather than at their
            # timeout.
            self.process_group.raise_alarm()
            return
        if periodic.step_count != (end - 1 if resume else begin):
            raise RuntimeError(
                f"replica {self.job.replica} is at inner step {periodic.step_count}, its "
                f"period {period} covers [{begin}, {end})"
                + (" and it retries the exchange" if resume else "")
            )
        try:
            if resume:
                kept = self.kept
                attempt.pre_sync = {"state": snapshot, **kept}
                attempt.losses, attempt.samples = list(kept["losses"]), kept["samples"]
                attempt.skip = kept["skipped"]
                _set_grads(periodic.params, kept["grads"])
                self.inner_now = self.first + end - 1
                self.rates.apply(self.optimizer.param_groups, self.first + end - 1)
                periodic.step()  # the last step's update, then the exchange
            else:
                periodic.step_count += attempt.skip  # the inner steps it skips
                self._inner_steps(attempt, period, begin + attempt.skip, end)
            if self.first + end == self.job.train.steps:
                periodic.finish()
        except Exception as failure:  # an exchange failed: a peer died or timed out
            manager.report_error(failure)
            self.process_group.raise_alarm()

    def _inner_steps(self, attempt: _Attempt, period: int, begin: int, end: int) -> None:
        """Inner steps ``[begin, end)``, each ended by the periodic optimizer's step (the
        last one's with the outer exchange); keeps the point before the last update."""
        periodic, kill = self.periodic, self.kill
        t_inner = time.monotonic()
        for inner in range(begin, end):
            step = self.inner_now = self.first + inner  # the inner step in the whole run
            if kill is not None and kill.phase == "compute" and kill.at_step == step:
                kill_now(self.conn, kill, step, period=period)
            # With global_batch="fixed" the quorum of this period splits every inner step's
            # global batch (data.py): a missing replica's samples are trained by the others,
            # as in per-step mode.
            attempt.samples, batch, scale = step_batch(self.workload, self.manager, self.job, step)
            periodic.zero_grad()
            loss = self.workload.loss(self.trainer, batch)
            (loss * scale if scale != 1.0 else loss).backward()
            attempt.losses.append(float(loss.detach()))
            attempt.trained += 1
            if inner == end - 1:
                attempt.inner_s = (time.monotonic() - t_inner) / attempt.trained
                attempt.pre_sync = {
                    "state": copy.deepcopy(self.state_dict()),
                    "grads": _grads(periodic.params),
                    "losses": list(attempt.losses),
                    "samples": attempt.samples,
                    "skipped": attempt.skip,
                }
            self.rates.apply(self.optimizer.param_groups, step)
            periodic.step()  # the outer exchange after the period's last step

    def _roll_back(
        self, attempt: _Attempt, snapshot: dict[str, Any], syncs: int, resume: bool
    ) -> None:
        """After a failed attempt: a fresh group at the next quorum, this replica's state
        as the attempt's ``pre_sync`` (or ``snapshot``) had it, and the work the retry
        keeps (``work_kept_for_retry``)."""
        # The group of this quorum is broken (or was never built), and its alarm is raised:
        # the next quorum builds a fresh one even when its members are the same, which
        # torchft's Manager alone would not (it reconfigures when the quorum's id changes).
        self.process_group.renew()
        self.manager._quorum_id = -1
        pre_sync = attempt.pre_sync
        self.load_state_dict(snapshot if pre_sync is None else pre_sync["state"])
        del self.periodic.syncs[syncs:]
        keep = work_kept_for_retry(pre_sync, self.kept, retrying=resume)
        self.kept.clear()
        self.kept.update(keep)

    def digests(self, step: int, committed: bool) -> dict[str, Any]:
        """The outer model's and outer momenta's digests of a committed period, and with
        ``param_fingerprints`` each parameter's at its end (as the run without torchft
        records after the period's last inner step: ``testing/bits.py`` keys them so)."""
        if not committed:
            return {"digest": None, "outer_digest": None, "fingerprints": None}
        fingerprinted = self.job.train.param_fingerprints
        return {
            "digest": state_digest(self.periodic.anchors),
            "outer_digest": state_digest(self.periodic.momenta),
            "fingerprints": param_fingerprints(self.module) if fingerprinted else None,
        }

    def final_record(self) -> dict[str, Any]:
        # What decides the bits beside the configuration (``Strategy.choices``), as the run
        # without torchft records them; a group of several ranks steps torch DDP inside it.
        choices = periodic_choices(self.periodic)
        if isinstance(self.trainer, DistributedDataParallel):
            choices["ddp"] = ddp_choices(self.trainer)
        return {
            **super().final_record(),
            "periods": self.manager.current_step(),
            "choices": choices,
        }


def _timed_transport(addr: str, timeout: timedelta, started: list[float]) -> Any:
    """A ``ChecksummedHTTPTransport`` on ``addr`` that appends to ``started`` the monotonic
    time at which each transfer to this replica begins."""
    from commfuse.ft.transport import ChecksummedHTTPTransport

    class _Transport(ChecksummedHTTPTransport):
        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> Any:
            started.append(time.monotonic())
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    return _Transport(addr, timeout=timeout)


def run_periodic_replica(job: ReplicaJob, conn: Connection) -> dict[str, Any]:
    """Train this replica group period by period until ``job.train.steps`` inner steps are
    committed (see the module docstring); returns its final record.

    Args:
        job: the replica group, its life and the run (a ``PeriodicMethod`` strategy).
        conn: the launcher's end: "ready" and the per-period records go up, "go" comes down.

    Returns:
        ``{"replica", "group_rank", "life", "eval_loss", "eval_accuracy", "digest", "step",
        "recovered_bytes", "served_bytes", "periods", "choices"}``; ``step`` counts inner
        steps.

    Raises:
        ValueError: a strategy that ``periods.ft_periodic_config`` refuses.
    """
    return PerPeriodLoop(job, conn).run()
