"""The training loop every rank runs: ``train_rank(config, progress)``.

Step s (0-based) on rank r trains on ``workload.batch(s, r, world_size, seed=seed)``, so data
position is the step count and a resumed run replays nothing and skips nothing. Each step is
timed on each rank from batch creation to the end of the update; the launcher reports rank 0's
times (the ranks are kept in lock-step by the gradient collectives).

Everything a rank trains lives on its communicator's device (``comm.device``: ``cuda:LOCAL_RANK``
under NCCL, the CPU under gloo): the workload builds its model and batches there, so the
optimizer's state and the strategy's buffers (buckets, local-SGD anchors) follow the parameters,
and checkpoints load onto it. Step times are read on ``commfuse.comm.clock``, which waits for
the device's queued work first.

After the last step, rank 0 evaluates on the held-out split, and then every rank times
``compute_steps`` extra steps inside ``strategy.no_sync()``: forward, backward and the plain
optimizer step with no gradient communication (and no compression) at all. Their median is the
compute-only floor that a strategy's step time is compared with. Those steps run after the
final parameters were recorded and checkpointed, so they never touch the run's results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from commfuse.cluster import machine
from commfuse.comm import Communicator
from commfuse.comm.clock import now
from commfuse.train import checkpoint as ckpt
from commfuse.train.lr_schedule import LRSchedule, ScheduledRates, describe_schedule
from commfuse.train.strategy import (
    StrategyConfig,
    StrategyContext,
    TorchDDPConfig,
    build_strategy,
    check_strategy,
    describe_strategy,
    resume_caveat,
    strategy_name,
)
from commfuse.workloads import (
    CharLMConfig,
    WorkloadConfig,
    check_workload,
    describe_workload,
    make_workload,
)


class _ResumeNotExactWarning(UserWarning):
    """Resuming a strategy whose resume is not bit-exact (its config's ``resume_caveat`` says
    why)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run (the same on every rank)."""

    workload: WorkloadConfig = dataclasses.field(default_factory=CharLMConfig)
    """The workload's options (``CharLMConfig(dim=64)``, ``DigitsConfig()``)."""
    strategy: StrategyConfig = dataclasses.field(default_factory=TorchDDPConfig)
    """The strategy's config (``TorchDDPConfig()``, ``CommfuseDPConfig(compressor=...)``,
    ``diloco(H=50)``, ...: ``commfuse.train.strategy``)."""
    label: str = ""
    """The run's name in tables, plots and records ("": ``describe_strategy(strategy)``; the
    command line passes the spec as typed)."""
    steps: int = 100
    """Total optimizer steps (a resumed run stops at the same total)."""
    seed: int = 0
    """Seed of the model's initial parameters and of every batch."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket cap in MB for strategies that bucket."""
    compute_steps: int = 0
    """Extra steps timed without communication after training (0: skip)."""
    checkpoint_dir: str | None = None
    """Where to save checkpoints (None: never)."""
    checkpoint_every: int = 0
    """Save every this many steps, and after the last step (0: only after the last step)."""
    resume: bool = False
    """Continue from ``checkpoint_dir``'s latest checkpoint (start fresh if there is none)."""
    evaluate: bool = True
    """Evaluate on the held-out split after the last step (rank 0)."""
    extra_steps: int = 0
    """Steps trained after ``steps`` only to see when the loss gets somewhere (``compare
    --max-steps-factor``: time to the baseline's loss for a strategy that learns less per
    step). Nothing else is read there: no checkpoint, the evaluation and the digest are of the
    parameters after step ``steps``, and ``metrics.summarize`` reads every other figure over the
    first ``steps``."""
    init_from: str | None = None
    """A checkpoint directory (of any strategy) whose latest model and optimizer state this run
    starts from, at its step: another strategy continues a pre-trained run (DiLoCo starts from
    a pre-trained model). Strategy state, history and RNG are fresh; ``steps`` is the total."""
    lr_schedule: LRSchedule | None = None
    """The learning-rate schedule over the run's ``steps`` (``CosineSchedule(warmup_steps=20)``,
    ``commfuse.train.lr_schedule``); None: the workload's rate at every step."""
    param_fingerprints: bool = False
    """Record after every step a short hash of each parameter's bits (``param_fingerprints``,
    a pass over the parameters per step), so that two runs meant to be bit-identical name the
    first step and parameter where they part (``commfuse.testing.bits``)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.compute_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("compute_steps and checkpoint_every must be >= 0")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if self.extra_steps < 0:
            raise ValueError(f"extra_steps must be >= 0, got {self.extra_steps}")
        if self.init_from is not None and ckpt.latest_step(self.init_from) is None:
            raise ValueError(f"init_from {self.init_from}: no complete checkpoint there")
        check_strategy(self.strategy)  # ValueError before any rank starts
        check_workload(self.workload)
        caveat = resume_caveat(self.strategy)
        if self.resume and caveat and ckpt.latest_step(self.checkpoint_dir or ".") is not None:
            warnings.warn(
                f"resuming {strategy_name(self.strategy)} is not exact: {caveat}",
                _ResumeNotExactWarning,
                stacklevel=3,
            )

    @property
    def strategy_label(self) -> str:
        """``label``, or the strategy's description when none was given."""
        return self.label or describe_strategy(self.strategy)


def params_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer's bytes, in state_dict order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def param_fingerprints(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter's bits, hashed (BLAKE2b, 8 bytes, hex), by name: where two runs meant
    to be bit-identical part, ``params_digest`` says when and this says which parameter."""
    return {
        name: hashlib.blake2b(
            tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(), digest_size=8
        ).hexdigest()
        for name, tensor in module.named_parameters()
    }


def _identity(config: TrainConfig, world_size: int) -> dict[str, Any]:
    return {
        "workload": describe_workload(config.workload),
        "strategy": describe_strategy(config.strategy),
        "seed": config.seed,
        "world_size": world_size,
        "bucket_cap_mb": config.bucket_cap_mb,
        "lr_schedule": None
        if config.lr_schedule is None
        else describe_schedule(config.lr_schedule),
    }


class _RunStart(NamedTuple):
    """Where a run starts (``check_start``)."""

    step: int
    """The first step it trains."""
    said: str | None
    """Where that step comes from, in words; None for a new run from step 0."""


def check_start(config: TrainConfig, world_size: int) -> _RunStart:
    """Where the run starts, checked before any rank starts: with ``resume``,
    ``checkpoint_dir``'s latest step (0 when it holds none yet: a job requeued before its
    first checkpoint starts over); else ``init_from``'s step; else 0.

    Raises:
        ValueError: ``resume`` would continue another run's checkpoint (naming every field
            where that run differs from this one: workload, strategy, seed, world size, bucket
            cap or schedule) or one past this run's total of ``steps``; or ``init_from``'s
            checkpoint is at or past it.
    """
    no_checkpoint_yet = None  # said when resume finds none and nothing else sets the start
    if config.resume and config.checkpoint_dir:
        step = ckpt.latest_step(config.checkpoint_dir)
        if step is not None:
            saved = ckpt.load_identity(config.checkpoint_dir, step)
            ckpt.check_identity(saved, _identity(config, world_size), config.checkpoint_dir)
            if step > config.steps:
                raise ValueError(
                    f"resume: the checkpoint in {config.checkpoint_dir} is at step {step}, past "
                    f"this run's total of {config.steps} steps: resume with steps of at least "
                    f"{step}"
                )
            return _RunStart(step, f"resuming at step {step} from {config.checkpoint_dir}")
        no_checkpoint_yet = f"no checkpoint in {config.checkpoint_dir} yet: starting at step 0"
    if config.init_from is None:
        return _RunStart(0, no_checkpoint_yet)
    step = init_from_step(config)
    return _RunStart(
        step, f"starting at step {step} from the model and optimizer in {config.init_from}"
    )


def train_rank(config: TrainConfig, progress: Any = None) -> dict[str, Any]:
    """Train on this rank (process group already initialised); returns this rank's metrics.

    ``progress``, if given, is a multiprocessing queue: rank 0 puts one
    ``(step, loss, step_time_s, bytes)`` tuple per step on it, for the launcher's display.
    """
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    # The busy time of a step is this machine's ranks' CPU (and the kernel's softirqs), not
    # whatever else runs on the machine (machine.py). One rank per machine reads it (the others
    # record -1): reading every rank's /proc costs about a millisecond.
    local = machine.rank_pids()
    pids = local if local[0] == os.getpid() else None
    device = comm.device
    workload = make_workload(config.workload, device=device)
    module = workload.build_model(config.seed)
    optimizer = workload.make_optimizer(module)
    # The base rates are the workload's, read before a checkpoint puts its last rate there.
    rates = ScheduledRates(config.lr_schedule, optimizer, config.steps)
    start, history, resumed_state = _load_start(config, module, optimizer, rank, world, device)
    strategy = build_strategy(
        config.strategy,
        StrategyContext(
            module=module,
            optimizer=optimizer,
            comm=comm,
            bucket_cap_mb=config.bucket_cap_mb,
            seed=config.seed,
            run_steps=config.steps - init_from_step(config),
        ),
    )
    try:
        if resumed_state is not None:
            strategy.load_state_dict(resumed_state["strategy"])
            ckpt.set_rng_state(resumed_state["rng"])
        # Bytes are charged from one end of step to the next, not from the start of a step:
        # an exchange running on a worker thread (streaming DiLoCo) counts its bytes whenever
        # its sends happen, including between two steps.
        sent_before = strategy.bytes_sent()
        snapshot: dict[str, torch.Tensor] | None = None
        run_metrics: dict[str, Any] | None = None  # the strategy's, as of step ``steps``
        fingerprints: dict[int, dict[str, str]] = {}  # step -> parameter -> hash of its bits
        others = _MachineReading(pids, device)
        for step in range(start, config.steps + config.extra_steps):
            if step == config.steps and config.extra_steps:
                # The run's result is the model after ``steps``; what follows only times a loss.
                sent_before = _finish_into_last_step(strategy, history, sent_before, pids)
                run_metrics = strategy.metrics()
                snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
            busy_before = _busy_now(pids)
            core_before = _core_busy_now(pids)
            t0 = now(device)
            with comm.at_step(step):
                rates.apply(strategy.lr_groups(), step)
                batch = workload.batch(step, rank, world, seed=config.seed)
                strategy.zero_grad()
                loss = workload.loss(strategy.model, batch)
                strategy.backward(loss)
                strategy.sync()
                applied = strategy.optimizer_step()
            elapsed = now(device) - t0
            history["busy_cpu_s"].append(_busy_since(busy_before, pids))
            history["machine_busy_s"].append(_core_busy_since(core_before, pids))
            sent_now = strategy.bytes_sent()
            sent, sent_before = sent_now - sent_before, sent_now
            history["loss"].append(float(loss.detach()))
            history["step_time_s"].append(elapsed)
            history["bytes"].append(float(sent))
            history["skipped"].append(0.0 if applied else 1.0)
            if config.param_fingerprints and step < config.steps:
                fingerprints[step] = param_fingerprints(module)
            if progress is not None and rank == 0:
                progress.put((step + 1, history["loss"][-1], elapsed, sent))
            done = step + 1
            every = config.checkpoint_every
            in_run = done <= config.steps
            if (
                in_run
                and config.checkpoint_dir
                and (done == config.steps or (every and done % every == 0))
            ):
                _save(config, comm, strategy, optimizer, module, history, done, world)
        _finish_into_last_step(strategy, history, sent_before, pids)
        others_over_run = others.read()
        if snapshot is not None:
            module.load_state_dict(snapshot)
        _refingerprint(fingerprints, module, config.steps - 1)
        result: dict[str, Any] = {
            "rank": rank,
            "device": str(device),
            "start_step": start,
            "history": history,
            # History entries past ``steps`` (extra_steps: read only for time to a loss).
            "extra_steps": config.steps + config.extra_steps - max(start, config.steps),
            "digest": params_digest(module),
            "strategy_metrics": strategy.metrics() if run_metrics is None else run_metrics,
            # What the run chose that decides its bits (bucket layout, algorithms, warm-up).
            "choices": strategy.choices(),
            "param_fingerprints": fingerprints,
            "cores": machine.cores(),
            "others_over_run": others_over_run,
        }
        if config.evaluate and rank == 0:
            result["eval"] = workload.evaluate(module)
        # Every rank starts its compute-only steps together (rank 0 evaluated alone), and none
        # ends before rank 0 has read the machine: a rank that ends is reaped by the launcher,
        # and its whole CPU would move to other programs' inside the reading.
        _barrier(comm)
        compute = _MachineReading(pids, device)
        result["compute_step_time_s"] = _time_compute_only(config, strategy, workload, rank, world)
        _barrier(comm)
        result["compute_machine"] = compute.read()
        _barrier(comm)
        return result
    finally:
        strategy.close()
        if progress is not None and rank == 0:
            # Flush the queue's feeder thread now: the rank process ends with os._exit.
            progress.close()
            progress.join_thread()


def _load_start(
    config: TrainConfig,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[int, dict[str, list[float]], dict[str, Any] | None]:
    """Where this rank starts: ``(step, history, checkpoint state)``, the model and the
    optimizer loaded from the latest checkpoint (``resume``, whose state the strategy and the
    random generators then take) or from ``init_from``; step 0 and an empty history
    otherwise."""
    history: dict[str, list[float]] = {"loss": [], "step_time_s": [], "bytes": [], "skipped": []}
    start = 0
    resumed_state: dict[str, Any] | None = None
    if config.resume and config.checkpoint_dir:
        latest = ckpt.latest_step(config.checkpoint_dir)
        if latest is not None:
            resumed_state = ckpt.load_rank(config.checkpoint_dir, latest, rank, device=device)
            ckpt.check_identity(
                resumed_state["identity"], _identity(config, world), config.checkpoint_dir
            )
            module.load_state_dict(resumed_state["model"])
            optimizer.load_state_dict(resumed_state["optimizer"])
            history = resumed_state["history"]
            start = resumed_state["step"]
    if resumed_state is None and config.init_from:
        start = load_init_from(config, module, optimizer, rank=rank, device=device)
    # Busy CPU seconds of this machine's ranks and softirqs during each step (-1: unknown, or a
    # step of a checkpoint written before this was recorded): metrics.py's ``machine_busy``.
    history.setdefault("busy_cpu_s", [-1.0] * len(history["loss"]))
    # The machine's busy core time in each step (``/proc/stat``: every process's and the
    # kernel's, -1 where not read); with other programs' CPU over the run (``others``), the
    # ranks' and the kernel's without double counting: metrics.py's ``machine_bound_s``.
    history.setdefault("machine_busy_s", [-1.0] * len(history["loss"]))
    return start, history, resumed_state


def _refingerprint(
    fingerprints: dict[int, dict[str, str]], module: torch.nn.Module, step: int
) -> None:
    """At the run's end: the last step's fingerprints (if recorded) are of the model it ends
    the run with, after ``strategy.finish()`` (a local-SGD run's final synchronisation, which
    a fault-tolerant run's last period commits)."""
    if step in fingerprints:
        fingerprints[step] = param_fingerprints(module)


def _finish_into_last_step(
    strategy: Any, history: dict[str, list[float]], sent_before: int, pids: tuple[int, ...] | None
) -> int:
    """``strategy.finish()`` (land what is in flight; local SGD's final synchronisation), its
    time and the bytes sent since ``sent_before`` charged to the last step trained: the run is
    not over until it is done, and an exchange still in flight at the last step, or a final
    synchronisation, is real traffic of that step. Returns the bytes sent so far."""
    busy_before = _busy_now(pids)
    device = strategy.comm.device
    start = now(device)
    strategy.finish()
    sent_now: int = strategy.bytes_sent()
    if history["step_time_s"]:
        history["step_time_s"][-1] += now(device) - start
        history["bytes"][-1] += float(sent_now - sent_before)
        busy = _busy_since(busy_before, pids)
        if busy >= 0 and history["busy_cpu_s"][-1] >= 0:
            history["busy_cpu_s"][-1] += busy
    return sent_now


def _busy_now(pids: tuple[int, ...] | None) -> float | None:
    """``machine.busy_cpu_s(pids)``; None on a rank that does not read it (``pids`` None)."""
    return None if pids is None else machine.busy_cpu_s(pids)


def _busy_since(before: float | None, pids: tuple[int, ...] | None) -> float:
    """``machine.busy_since(before, pids)``, -1 if unknown or not read here (the history holds
    floats)."""
    busy = None if pids is None else machine.busy_since(before, pids)
    return -1.0 if busy is None else busy


def _barrier(comm: Communicator) -> None:
    if comm.world_size > 1:
        dist.barrier(group=comm.group)


def _core_busy_now(pids: tuple[int, ...] | None) -> float | None:
    """The machine's busy core seconds (``machine.core_times_s``) on a rank that reads them."""
    times = None if pids is None else machine.core_times_s()
    return None if times is None else times["busy"]


def _core_busy_since(before: float | None, pids: tuple[int, ...] | None) -> float:
    """The machine's busy core seconds since ``before``, -1 if unknown or not read here."""
    after = _core_busy_now(pids)
    return -1.0 if before is None or after is None else after - before


class _MachineReading:
    """What the machine's cores did from its creation to ``read()``, on the rank that reads
    this machine (``pids``): ``busy_s`` (``/proc/stat``: every process and the kernel),
    ``others_s`` (the CPU of every user-space process but the ranks,
    ``machine.cpu_by_owner_s``) and ``wall_s``. Read outside timed steps: listing every
    process costs milliseconds."""

    def __init__(self, pids: tuple[int, ...] | None, device: torch.device) -> None:
        self.pids, self.device = pids, device
        self.start = self._now()

    def _now(self) -> tuple[float, float, float] | None:
        if self.pids is None:
            return None
        times, owners = machine.core_times_s(), machine.cpu_by_owner_s(self.pids)
        if times is None or owners is None:
            return None
        return now(self.device), times["busy"], owners["others"]

    def read(self) -> dict[str, float] | None:
        """The reading since creation; None where this rank does not read or cannot."""
        end = self._now()
        if self.start is None or end is None:
            return None
        wall, busy, others = (b - a for a, b in zip(self.start, end, strict=True))
        return {"wall_s": wall, "busy_s": busy, "others_s": others}


def init_from_step(config: TrainConfig) -> int:
    """The step a run starts at: ``config.init_from``'s latest step, 0 without.

    Raises:
        ValueError: the checkpoint is at or past ``config.steps`` (the total).
    """
    if config.init_from is None:
        return 0
    step = ckpt.latest_step(config.init_from)
    assert step is not None  # TrainConfig checked it
    if step >= config.steps:
        raise ValueError(
            f"init_from {config.init_from} is at step {step}: steps (the total) must be "
            f"larger, got {config.steps}"
        )
    return step


def load_init_from(
    config: TrainConfig,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    device: torch.device,
) -> int:
    """Load rank ``rank``'s model and optimizer state of ``config.init_from``'s latest step onto
    ``device``; return that step (0 without ``init_from``, nothing loaded).

    Raises:
        ValueError: the checkpoint is at or past ``config.steps`` (the total).
    """
    if config.init_from is None:
        return 0
    step = init_from_step(config)
    state = ckpt.load_rank(config.init_from, step, rank, device=device)
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return step


def _save(
    config: TrainConfig,
    comm: Communicator,
    strategy: Any,
    optimizer: torch.optim.Optimizer,
    module: torch.nn.Module,
    history: dict[str, list[float]],
    step: int,
    world: int,
) -> None:
    assert config.checkpoint_dir is not None
    payload = {
        "identity": _identity(config, world),
        "step": step,
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "strategy": strategy.state_dict(),
        "rng": ckpt.rng_state(),
        "history": {k: list(v) for k, v in history.items()},
    }
    ckpt.save_rank(config.checkpoint_dir, step, comm.rank, payload)
    if world > 1:
        dist.barrier(group=comm.group)  # every rank's file is on disk before `latest` moves
    if comm.rank == 0:
        ckpt.mark_latest(config.checkpoint_dir, step)


def _time_compute_only(
    config: TrainConfig, strategy: Any, workload: Any, rank: int, world: int
) -> list[float]:
    times = []
    device = workload.device
    for i in range(config.compute_steps):
        batch = workload.batch(config.steps + config.extra_steps + i, rank, world, seed=config.seed)
        t0 = now(device)
        with strategy.no_sync():
            strategy.zero_grad()
            loss = workload.loss(strategy.model, batch)
            loss.backward()
            strategy.optimizer.step()
        times.append(now(device) - t0)
    return times
