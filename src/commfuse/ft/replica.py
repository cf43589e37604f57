"""Per-step fault tolerance: one replica group's training loop under torchft, a commit a step
(each rank of a group of several runs it, averaging through ``group_hook.py``).

Every step, in the order torchft's Manager expects (``PerStepLoop.step``):

1. ``manager.start_quorum()``: ask the lighthouse who is alive. When the quorum changed, the
   Manager reconfigures the cross-replica process group; when this replica is behind (it was
   restarted or dropped), it first receives the state of a replica at the newest step
   (``transport.py``), all but the compressor's per-replica accumulators (error-feedback
   residuals, DGC's momentum: each replica's own gradient not sent yet, which a copy would
   send twice), and continues from there;
2. the step's batch is chosen by the committed step (``manager.current_step()``), the replica
   group's index and the number of replica groups (with ``global_batch="fixed"``, by its rank
   in the quorum and the quorum's size: ``data.py``), so a step that fails is retried on the
   same data, and a joiner continues where the others are;
3. forward and backward through torch DDP, whose hook averages the gradients across the
   quorum (``hook.py``);
4. ``manager.should_commit()``: every replica group votes; the step is applied (the optimizer
   steps, the committed step advances) only if no collective of this replica failed. A failed
   step changes nothing: the survivors retry it with the new quorum.

Cost without faults: a round trip to the lighthouse per step, hidden behind the forward, which
runs on the batch of the last quorum while the quorum request is in flight (again only when
the quorum changed the batch); a SHA-256 of the parameters after the last step and every
``digest_every_steps``-th. What a joiner receives, what each attempt reports, and why:
``docs/reliability.md``, "What a joiner receives" and "Inside a replica: the two loops".
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commfuse.compress.base import Compressor
from commfuse.ddp.wrapper import compressor_choices
from commfuse.ft.data import global_batch_slice, loss_scale, sample_range
from commfuse.ft.group_hook import GroupHookState, group_allreduce_hook
from commfuse.ft.hook import FTHookState, ft_allreduce_hook
from commfuse.ft.init_from import load_init_from
from commfuse.ft.loop import (
    ReplicaJob,
    ReplicaLoop,
    init_group_process_group,
    kill_now,
    start_quorum_retrying,
)
from commfuse.train.loop import param_fingerprints, params_digest
from commfuse.train.lr_schedule import ScheduledRates
from commfuse.train.strategy import CommfuseDPConfig, StrategyConfig, TorchDDPConfig
from commfuse.train.torch_ddp import bucket_caps, ddp_choices
from commfuse.workloads import make_workload


def ft_strategy(strategy: StrategyConfig) -> tuple[TorchDDPConfig, Compressor | None]:
    """torch DDP's settings and the compressor (if any) of a fault-tolerant run's strategy:
    ``TorchDDPConfig()`` (``ddp``), or ``CommfuseDPConfig(compressor=...)`` with no other
    setting (``powersgd:rank=4``, ...), whose compressor then runs inside the hook over the
    quorum with gloo's own collectives (``algo=native``).

    Raises:
        ValueError: any other strategy.
    """
    if isinstance(strategy, TorchDDPConfig) and strategy.hook == "none":
        return strategy, None
    if (
        isinstance(strategy, CommfuseDPConfig)
        and strategy.compressor is not None
        and dataclasses.replace(strategy, compressor=None) == CommfuseDPConfig()
    ):
        native = dataclasses.replace(strategy.compressor, algo="native", gather_algo="native")
        return TorchDDPConfig(), native
    raise ValueError(
        "fault-tolerant training runs ddp, or ddp with a commfuse compressor (e.g. "
        f"powersgd:rank=4, with no engine settings); got {type(strategy).__name__}"
    )


def _lay_out_buckets(
    ddp: DistributedDataParallel,
    hook_state: FTHookState | GroupHookState,
    workload: Any,
    job: ReplicaJob,
) -> None:
    """One backward without communication or update, so that DDP rebuilds its buckets in
    gradient order, as its peers' did after their first step: the hook's allreduces pair
    bucket i with bucket i, which must hold the same parameters on every replica."""
    hook_state.local = True
    try:
        batch = workload.batch(0, job.replica, job.num_replicas, seed=job.train.seed)
        workload.loss(ddp, batch).backward()
        ddp.zero_grad(set_to_none=True)
        # The rebuild happens in the next forward; make it now, outside any step.
        workload.loss(ddp, batch).backward()
        ddp.zero_grad(set_to_none=True)
    finally:
        hook_state.local = False


def _digested(job: ReplicaJob, step: int) -> bool:
    """Whether committed step ``step`` reports the parameters' digest (``digest_every_steps``;
    hashing them costs a pass over every parameter, which a short step feels)."""
    every = job.ft.digest_every_steps
    return step == job.train.steps - 1 or (every is not None and (step + 1) % every == 0)


def _step_share(
    manager: Any, job: ReplicaJob, step: int | None = None
) -> tuple[int, list[int] | None, float]:
    """The step (default: the Manager's), this replica's samples ``[start, stop)`` of its global
    batch under the latest quorum (None when it is not participating: the hook sends zeros for
    it), and its loss's scale (``data.py``): what decides the batch, without building it."""
    step = manager.current_step() if step is None else step
    size = int(getattr(job.train.workload, "batch", 1))
    participant = manager.participating_rank()
    if job.ft.global_batch == "shrink" or participant is None:
        # The replica group's slots, all its ranks' (consecutive).
        group = size * job.group_size
        own = [job.replica * group, (job.replica + 1) * group]
        return step, (own if participant is not None else None), 1.0
    participants = manager.num_participants()
    # The replica group's share of the global batch (every rank's slot of every group)...
    start, stop = sample_range(
        "fixed",
        replica=job.replica,
        participant=participant,
        participants=participants,
        num_replicas=job.num_replicas,
        batch=size * job.group_size,
    )
    # ... of which this rank trains its part: its loss weighs it among all ranks' parts.
    mine = _rank_part(job, start, stop)
    scale = loss_scale(
        *mine, participants=participants * job.group_size, total=job.num_slots * size
    )
    return step, [start, stop], scale


def _rank_part(job: ReplicaJob, start: int, stop: int) -> tuple[int, int]:
    """This rank's part of its replica group's samples ``[start, stop)``: the G ranks split
    them in contiguous ranges in group rank order (``data.py``'s rule, inside the group)."""
    size, rank = job.group_size, job.group_rank
    return start + rank * (stop - start) // size, start + (rank + 1) * (stop - start) // size


def _share_batch(workload: Any, job: ReplicaJob, step: int, samples: list[int] | None) -> Any:
    """The batch of ``_step_share``'s share: the rank's own slot unless the fixed global
    batch gives its replica group other samples (this rank trains its part of them)."""
    if job.ft.global_batch == "shrink" or samples is None:
        return workload.batch(step, job.slot, job.num_slots, seed=job.train.seed)
    size = int(getattr(job.train.workload, "batch", 1))
    return global_batch_slice(
        workload,
        step,
        *_rank_part(job, *samples),
        num_replicas=job.num_slots,
        batch=size,
        seed=job.train.seed,
    )


def step_batch(
    workload: Any, manager: Any, job: ReplicaJob, step: int | None = None
) -> tuple[list[int] | None, Any, float]:
    """``_step_share``'s samples and scale with their batch; per-period mode passes its inner
    step."""
    step, samples, scale = _step_share(manager, job, step)
    return samples, _share_batch(workload, job, step, samples), scale


class PerStepLoop(ReplicaLoop):
    """A replica group's rank that commits every step (module docstring): torch DDP with the
    fault-tolerant hook, the quorum asked for while the forward runs."""

    def build(self) -> None:
        """torch DDP over this replica group's own process group (the replica groups meet in
        the Manager's, inside the hook), and the hook; a spare lays out its buckets."""
        from commfuse.ft.quorum_comm import QuorumComm

        job = self.job
        strategy, compressor = ft_strategy(job.train.strategy)
        init_group_process_group(job)
        self.workload = make_workload(job.train.workload, device=self.device)
        self.module = module = self.workload.build_model(job.train.seed)
        self.optimizer = self.workload.make_optimizer(module)
        # The schedule's base rates are the workload's (a checkpoint or a donor's state would
        # put its own step's rate there); each step's rate is a function of the step alone.
        self.rates = ScheduledRates(job.train.lr_schedule, self.optimizer, job.train.steps)
        self.start = load_init_from(job.train, module, self.optimizer)  # 0 without init_from
        self.ddp = DistributedDataParallel(
            module,
            static_graph=strategy.static_graph,
            gradient_as_bucket_view=strategy.bucket_view,
            **bucket_caps(job.train.bucket_cap_mb, strategy.first_bucket_cap_mb),
        )
        self.hook_state = FTHookState(
            comm=QuorumComm(self.process_group),
            compressor=compressor,
            names={id(p): name for name, p in module.named_parameters()},
        )
        self.wired: FTHookState | GroupHookState = self.hook_state
        if job.group_size > 1:
            # Hierarchical: inside the group, then shard by shard across groups (group_hook.py).
            self.wired = GroupHookState(
                comm=self.hook_state.comm,
                group=dist.distributed_c10d._get_default_group(),
                group_size=job.group_size,
                group_rank=job.group_rank,
                compression=self.hook_state,
            )
            self.ddp.register_comm_hook(self.wired, group_allreduce_hook)
        else:
            self.ddp.register_comm_hook(self.hook_state, ft_allreduce_hook)
        # torch's random state at the start of the step in progress: a joiner continues from it.
        self.rng_at_start = torch.get_rng_state()
        # A joiner's state, as the Manager hands it over inside the quorum (on the quorum's
        # thread, while this one runs the forward): loaded once the quorum is in.
        self.pending: list[dict[str, Any]] = []
        # Whether DDP has rebuilt its buckets in gradient order, as every peer past its first
        # backward has (``_lay_out_buckets``).
        self.laid_out = job.life > 0
        if self.laid_out:
            _lay_out_buckets(self.ddp, self.wired, self.workload, job)
        self.quorum_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-quorum")
        self.step_now = -1

    def connect(self) -> None:
        if self.start:
            # The committed step is the data position: the run goes on from the checkpoint's.
            self.manager.load_state_dict({"step": self.start, "batches_committed": 0})
        self.wired.manager, self.wired.on_issue = self.manager, self._on_issue

    def _on_issue(self, bucket: int) -> None:
        kill = self.kill
        if kill is not None and kill.phase == "allreduce" and kill.at_step == self.step_now:
            kill_now(self.conn, kill, self.step_now)

    def done(self) -> bool:
        return bool(self.manager.current_step() >= self.job.train.steps)

    def steps_done(self) -> int:
        return int(self.manager.current_step())

    def state_dict(self) -> dict[str, Any]:
        """The model, the optimizer, the random state of the step's start, and the
        compressor's shared state (a joiner's accumulators are its own: module docstring)."""
        compression: dict[str, Any] = {}
        if self.hook_state.compressor is not None:
            compression = {
                "compressor": self.hook_state.compressor.shared_state_dict(),
                "steps": dict(self.hook_state.steps),
            }
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": self.rng_at_start,
            "compression": compression,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self._load_compression_state(state["compression"], served=True)

    def recover(self, state: dict[str, Any]) -> None:
        """Keep the donor's state for the training thread (``_load_pending``)."""
        self.pending.append(state)

    def _undo_point(self) -> dict[str, Any]:
        """What ``_load_compression_state`` takes to undo the step about to run."""
        if self.hook_state.compressor is None:
            return {}
        return {
            "compressor": self.hook_state.compressor.snapshot(),
            "steps": dict(self.hook_state.steps),
        }

    def _load_compression_state(self, state: dict[str, Any], *, served: bool = False) -> None:
        compressor = self.hook_state.compressor
        if compressor is not None:
            if served:
                compressor.load_shared_state_dict(state["compressor"])
            else:
                compressor.load_state_dict(state["compressor"])
            self.hook_state.steps = {str(k): int(v) for k, v in state["steps"].items()}

    def _load_pending(self) -> bool:
        """Load the joiner's state that came with the quorum, if any (on this thread: nothing
        reads the state meanwhile); returns whether one came."""
        healed = bool(self.pending)
        for state in self.pending:
            self.load_state_dict(state)
        self.pending.clear()
        if healed and not self.laid_out:
            # A first life that missed the first quorums (it was slow to ask) joins peers
            # whose buckets are rebuilt: its own, still in registration order, would pair
            # other parameters with theirs, and its sums would land in the wrong places.
            # (The donor's random state, just loaded, is the step's: kept.)
            rng = torch.get_rng_state()
            _lay_out_buckets(self.ddp, self.wired, self.workload, self.job)
            torch.set_rng_state(rng)
        self.laid_out = True  # by now, or by this step's backward
        return healed

    def _loss(self, step: int, samples: list[int] | None) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss: torch.Tensor = self.workload.loss(
            self.ddp, _share_batch(self.workload, self.job, step, samples)
        )
        return loss

    def step(self, t0: float) -> None:
        """One step (module docstring): the forward while the quorum is asked for, again if
        the quorum changed the batch, the backward through the hook, the vote."""
        job, manager = self.job, self.manager
        # The step's batch as the last quorum would have it; the forward runs on it while
        # the quorum is asked for, and again only if the quorum changed the batch.
        guess = _step_share(manager, job)
        self.rng_at_start = torch.get_rng_state()  # what a joiner is served
        asked = self.quorum_thread.submit(start_quorum_retrying, manager)
        kill = self.kill
        if kill is not None and kill.phase == "compute" and kill.at_step == guess[0]:
            asked.result()
            kill_now(self.conn, kill, guess[0])
        loss = self._loss(*guess[:2])
        t_forward = time.monotonic()
        asked.result()
        t_quorum = time.monotonic()
        healed = self._load_pending()
        self.step_now, samples, scale = share = _step_share(manager, job)
        behind = self.check_behind(self.step_now)
        again = (healed or share != guess) and not behind
        if again:  # the batch is built again only when the quorum changed it
            loss = self._loss(self.step_now, samples)
        self.hook_state.comm.at_quorum(
            manager.participating_rank() or 0, self.process_group.members()
        )
        # A failed step must leave the compressor's state as it found it (error feedback,
        # factors): some replicas may have updated theirs before the failure, others not.
        # A snapshot, not a copy: PowerSGD's keeps its tensors copy-on-write.
        saved = self._undo_point()
        t_saved = time.monotonic()
        sent_before = self.wired.bytes_sent
        if not behind:  # a replica behind the run sends nothing: its quorum fails
            (loss * scale if scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        participants, quorum = manager.num_participants(), self.process_group.quorum
        t_backward = time.monotonic()
        committed = manager.should_commit()
        t_voted = time.monotonic()
        if committed:
            self.rates.apply(self.optimizer.param_groups, self.step_now)
            self.optimizer.step()
        else:
            self._load_compression_state(saved)
        self.report_step(
            step=self.step_now,
            committed=committed,
            participants=participants,
            quorum=quorum,
            loss=float(loss.detach()),
            samples=samples,
            t0=t0,
            t_quorum=t_quorum,
            t_backward=t_backward,
            healed=healed,
            bytes_sent=self.wired.bytes_sent - sent_before,
            t_saved=t_saved,
            t_forward=t_forward,
            t_voted=t_voted,
            t_stepped=time.monotonic(),
            forward_again=again,
        )

    def digests(self, step: int, committed: bool) -> dict[str, Any]:
        digested = committed and _digested(self.job, step)
        fingerprinted = committed and self.job.train.param_fingerprints
        return {
            "digest": params_digest(self.module) if digested else None,
            "fingerprints": param_fingerprints(self.module) if fingerprinted else None,
        }

    def final_record(self) -> dict[str, Any]:
        # What decides the bits beside the configuration (``Strategy.choices``).
        compressor = self.hook_state.compressor
        choices = {
            "ddp": ddp_choices(self.ddp),
            "compressor": None if compressor is None else compressor_choices(compressor),
        }
        return {**super().final_record(), "choices": choices}

    def shutdown(self) -> None:
        self.quorum_thread.shutdown(wait=False)
        self.hook_state.worker.shutdown()
        super().shutdown()


def run_replica(job: ReplicaJob, conn: Connection) -> dict[str, Any]:
    """Train this replica group until ``job.train.steps`` steps are committed (see the module
    docstring); returns its final record. The launcher set the environment and network.

    Args:
        job: the replica group, its life and the run.
        conn: the launcher's end: "ready" and the per-step records go up, "go" comes down.

    Returns:
        ``{"replica", "group_rank", "life", "eval_loss", "eval_accuracy", "digest", "step",
        "recovered_bytes", "served_bytes"}``.

    Raises:
        ValueError: a strategy that ``ft_strategy`` refuses.
    """
    return PerStepLoop(job, conn).run()
