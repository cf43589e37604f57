"""Per-period fault tolerance: local SGD, DiLoCo and streaming DiLoCo on torchft.

DiLoCo (Douillard et al., "DiLoCo: Distributed low-communication training of language
models", 2023) lets every replica train alone for H inner steps and meet only to average its
pseudo-gradient ``anchor - params``, to which an outer optimizer is applied; streaming DiLoCo
(Douillard et al., "Streaming DiLoCo with overlapping communication", 2025) synchronises the
model fragment by fragment at staggered steps. torchft (PyTorch's fault tolerance: a
lighthouse that forms quorums, a commit vote, live recovery of a joiner from a peer) decides
who meets. Here the unit of commit is a *period*: the inner steps from one synchronisation to
the next, ending with it (``periods.sync_points``: every H steps for DiLoCo, F times per H
for streaming DiLoCo, every step of a synchronous warm-up). Per period, on each replica group:

1. ``start_quorum`` at the period's start. The replicas of the last quorum all ask at once
   (they have just voted), so it forms at once; a restarted replica asks whenever it is ready
   and waits for the others to finish their period, so its request may take a period and
   more (``Timeouts.period_quorum_timeout_s``, from the period's time as measured here). A
   replica that is behind receives a healthy one's state (``transport.py``, every tensor
   checksummed) and trains the period as a full member;
2. a snapshot of this replica's state, what a period that fails before its last inner step
   rolls back to (another is taken before the last optimizer step, see 4);
3. the period's inner steps, no quorum and no communication among them, each on the batch of
   its inner step (the data position is the inner step): its own slot of that step's global
   batch, or with ``global_batch="fixed"`` its share of it among the period's quorum, so that
   survivors train a missing replica's samples (``data.py``); through commfuse's own
   ``PeriodicSyncOptimizer``, whose communicator is the quorum (``QuorumComm``): at the period's
   end the pseudo-gradient (a fragment's, for streaming DiLoCo) is averaged across the quorum,
   compressed by the method's outer compressor if it has one (every replica's message decoded
   in rank order), so that every replica applies the same bits; then the outer step. After the last
   step ``finish()`` lands what is in flight and makes the final synchronisation, inside the
   last period;
4. ``should_commit``: the period counts only if none of its exchanges failed (a peer died or
   timed out: the failing replica reports the error to its Manager and raises the quorum's
   alarm, so the others abandon theirs at once). A failed exchange keeps the period's inner
   steps: the replica restores its state from just before the period's last optimizer step,
   with that step's gradients, and retries only that step and the exchange with the next
   quorum. That quorum is asked for ``shrink_only``: the lighthouse admits only members of
   the failed quorum, so a replica restarted before the survivors noticed its death waits
   for the next period instead of joining a retry of a period it did not train (it would
   take a donor's point in the period, the average would weigh that donor's
   pseudo-gradient twice, and every survivor would wait for its state to cross the
   network).

A replica group of several ranks trains torch DDP inside itself at every inner step (its
ranks hold one replica), and its outer exchanges go through ``GroupQuorumComm``: each rank
sends its shard of the pseudo-gradient (or of the outer compressor's messages) across groups
(``group_comm.py``). Only the group's first rank reports its periods; a kill takes the whole
group, and each of its ranks recovers from the same rank of a live group.

Why keep the inner steps: a replica killed in the middle of a period is noticed at the
period's exchange, when its sockets are found closed; by then the survivors have trained the
whole period, and DiLoCo's average of pseudo-gradients is as valid over three replicas as
over four. Rolling the period back would cost every fault a whole period (H inner steps) of
every survivor; the retry costs a quorum and an exchange. The price is the dead replica's
share of that period's batches, which nobody trains (counted lost).

What a failed exchange rolls back, on every replica, to that replica's own state before the
period's last optimizer step: parameters and buffers, the inner optimizer (AdamW's moments and
step), the anchors (the outer model), the outer momenta, exchanges averaged but not yet
applied (streaming DiLoCo's delay), the outer compressor's error feedback, the counters, and
torch's random state; the last step's gradients, the period's losses and its samples are kept.
A period that failed before its inner steps ended (its joiner's recovery failed; a warm-up
step's gradient allreduce, whose period is that one step) rolls back to its start.

A joiner begins its period late: the others began it when the quorum formed, the joiner once
the donor's state has crossed the network and is loaded. Were it to train every inner step,
every other replica would wait that long at the period's exchange. So it skips the period's
first k inner steps, k being how late it is over an inner step's time as the donor measured
it (at most all but one): it meets the others at the exchange on time, with a
pseudo-gradient over fewer steps, and its share of the skipped steps is lost (counted). Not
for streaming DiLoCo, whose fragments' exchanges land at fixed inner steps.

What a joiner receives: the donor's state at the start of the period, the same parts: for
DiLoCo the outer model (every replica holds it at a period's start), the donor's inner
optimizer and error-feedback residuals (each replica's own; the joiner continues from the
donor's), the outer momenta (the same on every replica), the counters (the data position)
and the random state. For streaming DiLoCo the fragments not synchronised at that point are
the donor's local values. One joiner can still meet a retry: one whose own recovery failed
is a member of the failed quorum, so the retry's quorum admits it; it then receives the
donor's state before the period's last optimizer step with that step's gradients, and the
average weighs that donor's pseudo-gradient twice.

Why commfuse's ``PeriodicSyncOptimizer`` and not torchft's ``LocalSGD``/``DiLoCo`` classes:
torchft's DiLoCo quantises its outer gradient only on accelerators (Triton), and has no place
for commfuse's outer compressors (SparseLoCo, DeMo, int4 ...) and their error feedback, which
run on any backend; one implementation of each method serves the run with and without
torchft, so a fault-free run equals the run without it; and a joiner here trains what is left
of its first period instead of adding a zero pseudo-gradient to the average.

Without faults the run equals the same run without torchft (``commfuse train`` without
``--fault-tolerant``) bit for bit with two replicas, whose sum does not depend on its order,
and with an all-gather outer compressor (SparseLoCo, DeMo, int4, top-k ...) for any number,
whose messages both runs decode in rank order. Three or more replicas without a compressor
sum in gloo's ring order here and in the allreduce algorithm's order there: the same up to
rounding.
Streaming DiLoCo's exchanges finish before the next inner step here (their result is still
applied ``overlap_steps`` later, as without torchft): the delay is kept, the overlap is not.
"""

from __future__ import annotations

import copy
import hashlib
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commfuse.ft.config import KillFault
from commfuse.ft.init_from import load_init_from
from commfuse.ft.periods import ft_periodic_config, sync_points
from commfuse.ft.progress import BehindTheRun, behind_the_run, read_floor
from commfuse.ft.replica import (
    ReplicaJob,
    init_group_process_group,
    kill_now,
    make_manager,
    no_report,
    send,
    start_quorum_retrying,
)
from commfuse.ft.replica import (
    _step_batch as step_batch,
)
from commfuse.ft.require import require_torchft
from commfuse.localsgd import PeriodicSyncConfig, PeriodicSyncOptimizer
from commfuse.train.loop import params_digest
from commfuse.train.lr_schedule import ScheduledRates
from commfuse.train.torch_ddp import bucket_caps
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


def part_digests(state: dict[str, Any]) -> dict[str, str]:
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


def run_periodic_replica(job: ReplicaJob, conn: Connection) -> dict[str, Any]:
    """Train this replica group period by period until ``job.train.steps`` inner steps are
    committed (see the module docstring); returns its final record.

    Args:
        job: the replica group, its life and the run (a ``PeriodicSyncConfig`` strategy).
        conn: the launcher's end: "ready" and the per-period records go up, "go" comes down.

    Returns:
        ``{"replica", "life", "digest", "step", "periods", "recovered_bytes",
        "served_bytes"}``; ``step`` counts inner steps.

    Raises:
        ValueError: a strategy that ``periods.ft_periodic_config`` refuses.
    """
    require_torchft()
    from commfuse.ft.group_comm import GroupQuorumComm
    from commfuse.ft.process_group import AlarmedProcessGroupGloo
    from commfuse.ft.quorum_comm import QuorumComm
    from commfuse.ft.transport import ChecksummedHTTPTransport

    strategy = job.train.strategy
    if not isinstance(strategy, PeriodicSyncConfig):
        raise ValueError(
            f"per-period mode runs a PeriodicSyncConfig, got {type(strategy).__name__}"
        )
    # A copy: this replica owns its compressor's state.
    config = copy.deepcopy(ft_periodic_config(strategy))
    timeouts = job.ft.timeouts
    op_timeout = timedelta(seconds=timeouts.op_timeout_s)
    workload = make_workload(job.train.workload, device=torch.device("cpu"))
    module = workload.build_model(job.train.seed)
    optimizer = workload.make_optimizer(module)
    # Each inner step's rate is a function of its step in the whole run (``rates.apply``).
    rates = ScheduledRates(job.train.lr_schedule, optimizer, job.train.steps)
    # With init_from, the run's inner steps are those after the checkpoint's step (``first``):
    # the periods count from there, each inner step trains the batch of its step in the
    # whole run (``init_from.py``).
    first = load_init_from(job.train, module, optimizer)
    process_group = AlarmedProcessGroupGloo(timeout=op_timeout)
    quorum = QuorumComm(process_group)
    comm: QuorumComm | GroupQuorumComm = quorum
    trainer: torch.nn.Module = module
    if job.group_size > 1:
        # A group of several ranks: torch DDP inside it at every inner step (over the host's
        # loopback), so its ranks hold the same replica; its outer exchanges are split among
        # its ranks, each sending its shard across groups (group_comm.py).
        init_group_process_group(job)
        group = dist.distributed_c10d._get_default_group()
        trainer = DistributedDataParallel(module, **bucket_caps(job.train.bucket_cap_mb, None))
        comm = GroupQuorumComm(quorum, group, job.group_rank, job.group_size)
    # The quorum's communicator speaks the Communicator interface the optimizer uses.
    periodic = PeriodicSyncOptimizer(optimizer, module, comm, config)  # type: ignore[arg-type]
    points = sync_points(config, job.train.steps - first)
    longest = max(b - a for a, b in zip([0, *points], points, strict=False))
    step_s = _time_inner_step(workload, module, job)
    timing: dict[str, float] = {"inner_step_s": step_s}
    # When each state transfer to this replica began, and the inner steps a joiner skips.
    recv_started: list[float] = []
    catch_up: dict[str, int] = {}

    # The work a period whose exchange failed keeps for its retry (see the module
    # docstring): the gradients of its last inner step (this replica is one optimizer step
    # and one exchange short of the period's end), and its losses and samples. Empty at a
    # period's start.
    kept: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        state = {
            "model": module.state_dict(),
            "periodic": periodic.state_dict(),
            "torch_rng": torch.get_rng_state(),
            # How long an inner step takes here: a joiner's measure of how late it is.
            "inner_step_s": timing["inner_step_s"],
        }
        if kept:
            # A joiner admitted to a retry (its recovery failed: module docstring) receives
            # the donor's point in the period.
            state["grads"] = kept["grads"]
        return state

    def load_state_dict(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        periodic.load_state_dict(state["periodic"])
        torch.set_rng_state(state["torch_rng"])

    served: list[dict[str, str]] = []
    recovered: list[dict[str, str]] = []

    def serve() -> dict[str, Any]:
        # The Manager asks only when a peer recovers from this replica: at a period's start.
        state = state_dict()
        served.append(part_digests(state))
        return state

    def recover(state: dict[str, Any]) -> None:
        load_state_dict(state)
        kept.clear()
        # The others began the period when the quorum formed; this replica begins it once
        # its state has arrived and is loaded, that many inner steps later.
        late_s = time.monotonic() - recv_started[-1] if recv_started else 0.0
        per_step = float(state.get("inner_step_s") or 0.0)
        catch_up["steps"] = int(late_s / per_step) if per_step > 0 else 0
        if state.get("grads") is not None:
            # The others retry the exchange of a period this replica did not train (its own
            # recovery into that period failed, which made it a member of the failed
            # quorum): it takes the donor's last step, so the quorum's average weighs the
            # donor's pseudo-gradient twice; it names no samples of its own.
            kept.update(grads=state["grads"], losses=[], samples=None, skipped=0)
        recovered.append(part_digests(state_dict()))  # what this replica holds now

    if job.life > 0:
        # A spare: everything is built; the launcher says when the restart happens.
        send(conn, ("built", {"replica": job.replica, "life": job.life}))
        if conn.recv_bytes() != b"start":
            raise RuntimeError("the launcher did not say start")

    class _Transport(ChecksummedHTTPTransport):
        """The state transport, noting when a transfer to this replica begins."""

        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> Any:
            recv_started.append(time.monotonic())
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    transport = _Transport(job.addr, timeout=op_timeout)
    manager = make_manager(job, process_group, transport, serve, recover)
    if isinstance(comm, GroupQuorumComm):
        comm.manager = manager
    kills = [f for f in job.ft.faults if isinstance(f, KillFault) and f.host == job.replica]
    # The group's first rank meets the fault; the launcher kills the group's other ranks.
    kill = kills[0] if kills and job.life == 0 and job.group_rank == 0 else None
    now = {"inner": -1, "period": -1}

    def on_issue() -> None:
        if kill is not None and kill.phase == "allreduce" and now["inner"] >= kill.at_step:
            kill_now(conn, kill, now["inner"], period=now["period"])

    quorum.on_issue = on_issue
    # The group's first rank reports its periods (the others train the same ones in step).
    report = send if job.group_rank == 0 else no_report
    send(conn, ("ready", {"replica": job.replica, "life": job.life}))
    if conn.recv_bytes() != b"go":
        raise RuntimeError("the launcher did not say go")
    # The progress floor (progress.py) follows the go; a death may lower it later.
    floor = read_floor(conn, wait=True)
    try:
        while manager.current_step() < len(points):
            t0 = time.monotonic()
            floor = read_floor(conn, floor)
            # A retry's quorum is the failed one's survivors (see the module docstring).
            start_quorum_retrying(
                manager, timeouts.period_quorum_timeout_s(step_s * longest), shrink_only=bool(kept)
            )
            t_quorum = time.monotonic()
            healed = recovered[-1] if recovered else None
            served_now = served[-1] if served else None
            recovered.clear()
            served.clear()
            period = manager.current_step()
            begin, end = (points[period - 1] if period else 0), points[period]
            now["period"] = period
            behind = behind_the_run(period, floor, job.group_size, periodic.params[0].device)
            if behind:  # it trains nothing, and its exchanges are abandoned below
                manager.report_error(BehindTheRun(period, floor))
            if manager.errored() is None:  # else the group may not be built
                comm.at_quorum(manager.participating_rank() or 0, process_group.members())
            participants, quorum_id = manager.num_participants(), process_group.quorum
            snapshot = copy.deepcopy(state_dict())
            resume = bool(kept)
            # What a failed exchange rolls back to: the state before the period's last
            # optimizer step, with that step's gradients (None: the period's start).
            pre_sync: dict[str, Any] | None = None
            # A joiner late by k inner steps skips the period's first k (at most all but
            # one), so that the others do not wait for it at the exchange: its
            # pseudo-gradient covers fewer steps, and its share of the skipped ones is lost.
            # Only where a period is one exchange of the whole model (not streaming
            # DiLoCo's fragments, whose exchanges land at fixed inner steps).
            late = catch_up.pop("steps", 0)
            skip = late if healed is not None and not resume else 0
            if config.num_fragments > 1 or config.overlap_steps > 0:
                skip = 0
            skip = min(skip, end - begin - 1)
            if job.group_size > 1:
                # Every rank of the group measured its own lateness: the group skips as one
                # (its ranks' DDP collectives must pair up), by the latest rank's count.
                agreed = torch.tensor([skip], device=periodic.params[0].device)
                dist.all_reduce(agreed, dist.ReduceOp.MAX)
                skip = int(agreed)
            syncs = len(periodic.syncs)
            sent_before = quorum.bytes_sent
            losses: list[float] = []
            samples: list[int] | None = None
            trained = 0  # forward and backward passes of this attempt
            if manager.errored() is not None:
                # Its recovery failed, or it is behind the run: this replica cannot train the
                # period; the others' exchanges with it are abandoned now rather than at
                # their timeout.
                process_group.raise_alarm()
            elif periodic.step_count != (end - 1 if resume else begin):
                raise RuntimeError(
                    f"replica {job.replica} is at inner step {periodic.step_count}, its "
                    f"period {period} covers [{begin}, {end})"
                    + (" and it retries the exchange" if resume else "")
                )
            else:
                try:
                    if resume:
                        pre_sync = {"state": snapshot, **kept}
                        losses, samples = list(kept["losses"]), kept["samples"]
                        skip = kept["skipped"]
                        _set_grads(periodic.params, kept["grads"])
                        now["inner"] = first + end - 1
                        rates.apply(optimizer.param_groups, first + end - 1)
                        periodic.step()  # the last step's update, then the exchange
                    if not resume:
                        periodic.step_count += skip  # the inner steps it skips
                    t_inner = time.monotonic()
                    inner_s = timing["inner_step_s"]
                    for inner in range(begin + skip, end) if not resume else ():
                        step = now["inner"] = first + inner  # the inner step in the whole run
                        if kill is not None and kill.phase == "compute" and kill.at_step == step:
                            kill_now(conn, kill, step, period=period)
                        # With global_batch="fixed" the quorum of this period splits every
                        # inner step's global batch (data.py): a missing replica's samples
                        # are trained by the others, as in per-step mode.
                        samples, batch, scale = step_batch(workload, manager, job, step)
                        periodic.zero_grad()
                        loss = workload.loss(trainer, batch)
                        (loss * scale if scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
                        losses.append(float(loss.detach()))
                        trained += 1
                        if inner == end - 1:
                            inner_s = (time.monotonic() - t_inner) / trained
                            pre_sync = {
                                "state": copy.deepcopy(state_dict()),
                                "grads": _grads(periodic.params),
                                "losses": list(losses),
                                "samples": samples,
                                "skipped": skip,
                            }
                        rates.apply(optimizer.param_groups, step)
                        periodic.step()  # the outer exchange after the period's last step
                    if first + end == job.train.steps:
                        periodic.finish()
                except Exception as failure:  # an exchange failed: a peer died or timed out
                    manager.report_error(failure)
                    process_group.raise_alarm()
            t_sync = time.monotonic()
            committed = manager.should_commit()
            if not committed:
                # The group of this quorum is broken (or was never built), and its alarm is
                # raised: the next quorum builds a fresh one even when its members are the
                # same, which torchft's Manager alone would not (it reconfigures when the
                # quorum's id changes).
                process_group.renew()
                manager._quorum_id = -1
            if committed:
                step_s = max(step_s, (t_sync - t_quorum) / (end - begin))
                if trained > 1 and not resume:
                    timing["inner_step_s"] = inner_s
                kept.clear()
            else:
                load_state_dict(snapshot if pre_sync is None else pre_sync["state"])
                del periodic.syncs[syncs:]
                keep = work_kept_for_retry(pre_sync, kept, retrying=resume)
                kept.clear()
                kept.update(keep)
            error = manager.errored()
            report(
                conn,
                (
                    "step",
                    {
                        "step": period,
                        "first_step": first + begin,
                        "inner_steps": end - begin,
                        "committed": bool(committed),
                        # A failed attempt whose inner steps the retry keeps; a retry.
                        "kept": bool(kept),
                        "retry": resume,
                        "trained_steps": trained,
                        "skipped_steps": skip,
                        "participants": participants,
                        "quorum": quorum_id,
                        "loss": sum(losses) / len(losses) if losses else None,
                        "losses": losses,
                        "samples": samples,
                        "t0": t0,
                        "t_quorum": t_quorum,
                        "t_backward": t_sync,
                        "t": time.monotonic(),
                        "digest": state_digest(periodic.anchors) if committed else None,
                        "outer_digest": state_digest(periodic.momenta) if committed else None,
                        "healed": healed is not None,
                        "healed_parts": healed,
                        "served_parts": served_now,
                        "bytes": quorum.bytes_sent - sent_before,
                        "error": None if error is None else str(error.original_exception),
                        "behind": floor if behind else None,
                    },
                ),
            )
            if behind:
                time.sleep(timeouts.heartbeat_interval_s)  # the next quorum, not a spin
        held_out = workload.evaluate(module) if job.train.evaluate else {}
        return {
            "replica": job.replica,
            "life": job.life,
            "eval_loss": held_out.get("loss"),
            "eval_accuracy": held_out.get("accuracy"),
            "digest": params_digest(module),
            "step": first + periodic.step_count,
            "periods": manager.current_step(),
            "recovered_bytes": transport.bytes_received,
            "served_bytes": transport.bytes_sent,
        }
    finally:
        manager.shutdown(wait=False)
        transport.shutdown(wait=False)
