"""One replica group's training loop under torchft (each rank of a group of several runs it,
averaging through ``group_hook.py``).

Every step, in the order torchft's Manager expects:

1. ``manager.start_quorum()``: ask the lighthouse who is alive. When the quorum changed, the
   Manager reconfigures the cross-replica process group; when this replica is behind (it was
   restarted or dropped), it first receives the state of a replica at the newest step
   (``transport.py``) and continues from there. It takes everything but the compressor's
   per-replica accumulators (``Compressor.own_state``: error-feedback residuals, DGC's
   momentum), which are each replica's own gradient not sent yet: summed over the replicas,
   they and what was sent make the true gradients' sum, and a copy of the donor's would send
   its gradient twice. A joiner keeps its own instead: none after a restart, those of its
   last committed step if it only fell behind;
2. the step's batch is chosen by the committed step (``manager.current_step()``), the replica
   group's index and the number of replica groups (with ``global_batch="fixed"``, by its rank
   in the quorum and the quorum's size: ``data.py``), so a step that fails is retried on the
   same data, and a joiner continues where the others are;
3. forward and backward through torch DDP, whose hook averages the gradients across the
   quorum (``hook.py``);
4. ``manager.should_commit()``: every replica group votes; the step is applied (the optimizer
   steps, the committed step advances) only if no collective of this replica failed. A failed
   step changes nothing: the survivors retry it with the new quorum.

The quorum is a round trip to the lighthouse that a short step feels, and the forward does
not need it: the forward runs on the batch of the last quorum while the quorum request is in
flight on a thread of its own (the Manager waits for it, as ``use_async_quorum=False``
asks). A joiner's state that arrives with the quorum is loaded on the training thread once
the quorum is in, and the forward runs again when that state, or the quorum's step, rank or
size, changed the batch. A joiner is served the torch random state of the step's start.

Each attempt is reported to the launcher as it happens (a killed replica's history survives
it): the step, whether it committed, the quorum's size, the loss, monotonic times and, after a
commit of the last step (and of every ``digest_every_steps``-th), the SHA-256 of the
parameters, which the launcher compares across replicas.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore
from torch.nn.parallel import DistributedDataParallel

from commfuse.compress.base import Compressor
from commfuse.ft.config import START_TIMEOUT_S, FaultToleranceConfig, KillFault
from commfuse.ft.data import global_batch_slice, loss_scale, sample_range
from commfuse.ft.group_hook import GroupHookState, group_allreduce_hook
from commfuse.ft.hook import FTHookState, ft_allreduce_hook
from commfuse.ft.init_from import load_init_from
from commfuse.ft.progress import BehindTheRun, behind_the_run, read_floor
from commfuse.ft.require import require_torchft
from commfuse.train.loop import TrainConfig, params_digest
from commfuse.train.lr_schedule import ScheduledRates
from commfuse.train.strategy import CommfuseDPConfig, StrategyConfig, TorchDDPConfig
from commfuse.train.torch_ddp import bucket_caps
from commfuse.workloads import make_workload


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


def no_report(conn: Connection, message: tuple[Any, ...]) -> None:
    """What a replica group's ranks other than its first send for a step: nothing."""


def kill_now(conn: Connection, fault: KillFault, step: int, **extra: Any) -> None:
    """Report the kill time (and ``extra``) to the launcher, then SIGKILL this replica
    group's process."""
    send(conn, ("kill", {"step": step, "t": time.monotonic(), "phase": fault.phase, **extra}))
    os.kill(os.getpid(), signal.SIGKILL)


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


def _step_batch(
    workload: Any, manager: Any, job: ReplicaJob, step: int | None = None
) -> tuple[list[int] | None, Any, float]:
    """``_step_share``'s samples and scale with their batch; per-period mode passes its inner
    step."""
    step, samples, scale = _step_share(manager, job, step)
    return samples, _share_batch(workload, job, step, samples), scale


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
    in at once (``use_async_quorum=False``: it recovers inside ``start_quorum``)."""
    from torchft import Manager

    timeouts = job.ft.timeouts
    op_timeout = timedelta(seconds=timeouts.op_timeout_s)
    return Manager(
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


def run_replica(job: ReplicaJob, conn: Connection) -> dict[str, Any]:
    """Train this replica group until ``job.train.steps`` steps are committed (see the module
    docstring); returns its final record. The launcher set the environment and network.

    Args:
        job: the replica group, its life and the run.
        conn: the launcher's end: "ready" and the per-step records go up, "go" comes down.

    Returns:
        ``{"replica", "life", "digest", "step", "recovered_bytes", "served_bytes"}``.

    Raises:
        ValueError: a strategy that ``ft_strategy`` refuses.
    """
    require_torchft()
    from commfuse.ft.process_group import AlarmedProcessGroupGloo
    from commfuse.ft.quorum_comm import QuorumComm
    from commfuse.ft.transport import ChecksummedHTTPTransport

    strategy, compressor = ft_strategy(job.train.strategy)
    timeouts = job.ft.timeouts
    op_timeout = timedelta(seconds=timeouts.op_timeout_s)
    # torch DDP needs a process group: this replica group's own; the replica groups meet in
    # the Manager's process group, inside the hook.
    init_group_process_group(job)
    device = torch.device("cpu")
    workload = make_workload(job.train.workload, device=device)
    module = workload.build_model(job.train.seed)
    optimizer = workload.make_optimizer(module)
    # The schedule's base rates are the workload's (a checkpoint or a donor's state would put
    # its own step's rate there); each step's rate is a function of the step alone.
    rates = ScheduledRates(job.train.lr_schedule, optimizer, job.train.steps)
    start = load_init_from(job.train, module, optimizer)  # 0 without init_from
    ddp = DistributedDataParallel(
        module,
        static_graph=strategy.static_graph,
        gradient_as_bucket_view=strategy.bucket_view,
        **bucket_caps(job.train.bucket_cap_mb, strategy.first_bucket_cap_mb),
    )

    def state_dict() -> dict[str, Any]:
        return {
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "torch_rng": at_start["torch_rng"],
            "compression": served_compression_state(),
        }

    def served_compression_state() -> dict[str, Any]:
        if hook_state.compressor is None:
            return {}
        # A joiner's accumulators are its own (see the module docstring).
        state = hook_state.compressor.shared_state_dict()
        return {"compressor": state, "steps": dict(hook_state.steps)}

    def undo_point() -> dict[str, Any]:
        """What ``load_compression_state`` takes to undo the step about to run."""
        if hook_state.compressor is None:
            return {}
        return {"compressor": hook_state.compressor.snapshot(), "steps": dict(hook_state.steps)}

    def load_compression_state(state: dict[str, Any], *, served: bool = False) -> None:
        compressor = hook_state.compressor
        if compressor is not None:
            if served:
                compressor.load_shared_state_dict(state["compressor"])
            else:
                compressor.load_state_dict(state["compressor"])
            hook_state.steps = {str(k): int(v) for k, v in state["steps"].items()}

    # torch's random state at the start of the step in progress: a joiner continues from it.
    at_start: dict[str, Any] = {"torch_rng": torch.get_rng_state()}
    # A joiner's state, as the Manager hands it over inside the quorum (on the quorum's
    # thread, while this one runs the forward): loaded once the quorum is in.
    pending: list[dict[str, Any]] = []

    def load_state_dict(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        load_compression_state(state["compression"], served=True)

    process_group = AlarmedProcessGroupGloo(timeout=op_timeout)
    hook_state = FTHookState(
        comm=QuorumComm(process_group),
        compressor=compressor,
        names={id(p): name for name, p in module.named_parameters()},
    )
    wired: FTHookState | GroupHookState = hook_state
    if job.group_size > 1:
        # Hierarchical: inside the group, then shard by shard across groups (group_hook.py).
        wired = GroupHookState(
            comm=hook_state.comm,
            group=dist.distributed_c10d._get_default_group(),
            group_size=job.group_size,
            group_rank=job.group_rank,
            compression=hook_state,
        )
        ddp.register_comm_hook(wired, group_allreduce_hook)
    else:
        ddp.register_comm_hook(hook_state, ft_allreduce_hook)
    # Whether DDP has rebuilt its buckets in gradient order, as every peer past its first
    # backward has (``_lay_out_buckets``).
    laid_out = job.life > 0
    if laid_out:
        _lay_out_buckets(ddp, wired, workload, job)
        # A spare: everything is built; the launcher says when the restart happens.
        send(conn, ("built", {"replica": job.replica, "life": job.life}))
        if conn.recv_bytes() != b"start":
            raise RuntimeError("the launcher did not say start")
    transport = ChecksummedHTTPTransport(job.addr, timeout=op_timeout)
    manager = make_manager(job, process_group, transport, state_dict, pending.append)
    if start:
        # The committed step is the data position: the run goes on from the checkpoint's.
        manager.load_state_dict({"step": start, "batches_committed": 0})
    quorum_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-quorum")
    kills = [f for f in job.ft.faults if isinstance(f, KillFault) and f.host == job.replica]
    # The group's first rank meets the fault; the launcher kills the group's other ranks.
    kills = kills if job.life == 0 and job.group_rank == 0 else []
    kill = kills[0] if kills else None
    step_now = -1

    def on_issue(bucket: int) -> None:
        if kill is not None and kill.phase == "allreduce" and kill.at_step == step_now:
            kill_now(conn, kill, step_now)

    wired.manager, wired.on_issue = manager, on_issue
    # The group's first rank reports its steps (the others train the same steps in step).
    step_report = send if job.group_rank == 0 else no_report
    send(conn, ("ready", {"replica": job.replica, "life": job.life}))
    if conn.recv_bytes() != b"go":
        raise RuntimeError("the launcher did not say go")
    # The progress floor (progress.py) follows the go; a death may lower it later.
    floor = read_floor(conn, wait=True)
    try:
        while manager.current_step() < job.train.steps:
            t0 = time.monotonic()
            floor = read_floor(conn, floor)
            # The step's batch as the last quorum would have it; the forward runs on it while
            # the quorum is asked for, and again only if the quorum changed the batch.
            guess = _step_share(manager, job)
            at_start["torch_rng"] = torch.get_rng_state()  # what a joiner is served
            asked = quorum_thread.submit(start_quorum_retrying, manager)
            if kill is not None and kill.phase == "compute" and kill.at_step == guess[0]:
                asked.result()
                kill_now(conn, kill, guess[0])
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(ddp, _share_batch(workload, job, *guess[:2]))
            t_forward = time.monotonic()
            asked.result()
            t_quorum = time.monotonic()
            healed = bool(pending)
            for state in pending:
                load_state_dict(state)  # on this thread: nothing reads the state meanwhile
            pending.clear()
            if healed and not laid_out:
                # A first life that missed the first quorums (it was slow to ask) joins peers
                # whose buckets are rebuilt: its own, still in registration order, would pair
                # other parameters with theirs, and its sums would land in the wrong places.
                # (The donor's random state, just loaded, is the step's: kept.)
                rng = torch.get_rng_state()
                _lay_out_buckets(ddp, wired, workload, job)
                torch.set_rng_state(rng)
            laid_out = True  # by now, or by this step's backward
            step_now, samples, scale = share = _step_share(manager, job)
            behind = behind_the_run(step_now, floor, job.group_size, device)
            if behind:
                manager.report_error(BehindTheRun(step_now, floor))
            again = (healed or share != guess) and not behind
            if again:  # the batch is built again only when the quorum changed it
                optimizer.zero_grad(set_to_none=True)
                loss = workload.loss(ddp, _share_batch(workload, job, step_now, samples))
            hook_state.comm.at_quorum(manager.participating_rank() or 0, process_group.members())
            # A failed step must leave the compressor's state as it found it (error feedback,
            # factors): some replicas may have updated theirs before the failure, others not.
            # A snapshot, not a copy: PowerSGD's keeps its tensors copy-on-write.
            saved = undo_point()
            t_saved = time.monotonic()
            sent_before = wired.bytes_sent
            if not behind:  # a replica behind the run sends nothing: its quorum fails
                (loss * scale if scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
            participants, quorum = manager.num_participants(), process_group.quorum
            t_backward = time.monotonic()
            committed = manager.should_commit()
            t_voted = time.monotonic()
            if committed:
                rates.apply(optimizer.param_groups, step_now)
                optimizer.step()
            else:
                load_compression_state(saved)
            t_stepped = time.monotonic()
            error = manager.errored()
            digest = committed and _digested(job, step_now)
            step_report(
                conn,
                (
                    "step",
                    {
                        "step": step_now,
                        "committed": bool(committed),
                        "participants": participants,
                        "quorum": quorum,
                        "loss": float(loss.detach()),
                        "t0": t0,
                        "t_quorum": t_quorum,
                        "t_saved": t_saved,
                        "t_forward": t_forward,
                        "t_backward": t_backward,
                        "t_voted": t_voted,
                        "t_stepped": t_stepped,
                        "t": time.monotonic(),
                        "digest": params_digest(module) if digest else None,
                        "healed": healed,
                        "forward_again": again,
                        "samples": samples,
                        "bytes": wired.bytes_sent - sent_before,
                        "error": None if error is None else str(error.original_exception),
                        "behind": floor if behind else None,
                    },
                ),
            )
            if behind:
                time.sleep(job.ft.timeouts.heartbeat_interval_s)  # the next quorum, not a spin
        held_out = workload.evaluate(module) if job.train.evaluate else {}
        return {
            "replica": job.replica,
            "group_rank": job.group_rank,
            "life": job.life,
            "eval_loss": held_out.get("loss"),
            "eval_accuracy": held_out.get("accuracy"),
            "digest": params_digest(module),
            "step": manager.current_step(),
            "recovered_bytes": transport.bytes_received,
            "served_bytes": transport.bytes_sent,
        }
    finally:
        quorum_thread.shutdown(wait=False)
        hook_state.worker.shutdown()
        manager.shutdown(wait=False)
        transport.shutdown(wait=False)
