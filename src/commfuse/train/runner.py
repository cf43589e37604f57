"""The launching side of a run: start the ranks, show progress, summarise.

Ranks run through ``commfuse.cluster.run`` (real processes, on an emulated cluster when the
topology asks for one and the machine allows it, else plain loopback). Rank 0 reports every
step on a multiprocessing queue; a thread here drains it into a progress bar (rich) on stderr,
so stdout stays clean for tables and JSON.
"""

from __future__ import annotations

import contextlib
import queue as queue_mod
import sys
import threading
from typing import Any

from commfuse.cluster import Topology, run
from commfuse.cluster.start import rank_context
from commfuse.train.loop import TrainConfig, check_start, train_rank
from commfuse.train.lr_schedule import describe_schedule
from commfuse.train.metrics import summarize
from commfuse.train.strategy import describe_strategy, strategy_name
from commfuse.workloads import describe_workload

#: Steps excluded from the step-time median (one-off costs of the first steps).
_DEFAULT_WARMUP_STEPS = 2


class _Progress:
    """Drains rank 0's (step, loss, step_time_s, bytes) reports into a rich progress bar."""

    def __init__(self, q: Any, total: int, label: str, enabled: bool) -> None:
        self.q, self.total, self.label, self.enabled = q, total, label, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        if not self.enabled:
            while not self._stop.is_set():
                with contextlib.suppress(queue_mod.Empty):
                    self.q.get(timeout=0.2)
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task(self.label, total=self.total, info="starting ranks...")
            while not self._stop.is_set():
                try:
                    step, loss, step_s, sent = self.q.get(timeout=0.2)
                except queue_mod.Empty:
                    continue
                info = f"loss {loss:.3f}  {step_s * 1e3:.0f} ms/step  {sent / 1e6:.2f} MB/step"
                bar.update(task, completed=step, info=info)


def run_training(
    config: TrainConfig,
    topology: Topology,
    *,
    emulate: bool | None = None,
    progress: bool | None = None,
    timeout_s: float | None = 3600.0,
    warmup: int = _DEFAULT_WARMUP_STEPS,
    backend: str = "gloo",
) -> dict[str, Any]:
    """Train ``config`` on ``topology``'s ranks and return the run's summary record.

    Args:
        config: the run (workload, strategy, steps, seed, schedule, checkpoints).
        topology: hosts, ranks per host and link rate; on the emulated cluster when
            ``emulate`` allows (None: where this machine can build it, else plain loopback).
        emulate: True to require the emulated cluster, False for loopback, None to choose.
        progress: a progress bar on stderr (None: when stderr is a terminal).
        timeout_s: the deadline of the whole run; every rank is stopped after it.
        warmup: steps left out of the step-time median.
        backend: the process group's, which decides every rank's device (``nccl``:
            ``cuda:LOCAL_RANK``, one GPU per rank; ``gloo``: the CPU; the training loop
            follows ``Communicator.device``).

    Returns:
        The record ``commfuse train --json`` writes: step times, bytes per step, losses, the
        held-out evaluation, the strategy's metrics (``metrics.summarize``), and the run's
        settings (``spec``, ``seed``, ``lr_schedule``, ``topology``, ...).

    Raises:
        ValueError: a start ``check_start`` refuses (another run's checkpoint, or one past
            ``steps``), before any rank starts.
        RankError: a rank failed (the record names it); DeadlineExceeded: the run passed
            ``timeout_s``.

    Example:
        ```python
        record = run_training(
            TrainConfig(strategy=diloco(H=50), steps=400, lr_schedule=CosineSchedule()),
            Topology(num_hosts=4, link_mbit=100),
        )
        print(record["eval_loss"], record["bytes_per_step"])
        ```
    """
    check_start(config, topology.world_size)  # a ValueError here, not on every rank
    label = config.strategy_label
    ctx = rank_context()  # the context commfuse.cluster.run starts ranks with
    q = ctx.Queue()
    show = sys.stderr.isatty() if progress is None else progress
    try:
        with _Progress(q, config.steps, label, show):
            results = run(
                train_rank,
                config,
                q,
                net=topology,
                emulate=emulate,
                timeout_s=timeout_s,
                backend=backend,
            )
    finally:
        q.close()
        q.cancel_join_thread()
    workload = describe_workload(config.workload)
    record = summarize(results, strategy=label, workload=workload, warmup=warmup)
    record.update(
        spec=describe_strategy(config.strategy),
        strategy_name=strategy_name(config.strategy),
        seed=config.seed,
        lr_schedule=None if config.lr_schedule is None else describe_schedule(config.lr_schedule),
        bucket_cap_mb=config.bucket_cap_mb,
        topology=topology.describe(),
        link_mbit=topology.link_mbit,
        start_step=results[0]["start_step"],
        backend=backend,
        device=results[0]["device"],
        # Per rank: what each chose that decides the bits, its loss at every step, and (with
        # ``param_fingerprints``) each parameter's bits after every step.
        choices=[r["choices"] for r in results],
        rank_losses=[r["history"]["loss"][: config.steps] for r in results],
        param_fingerprints=[r["param_fingerprints"] for r in results],
    )
    return record
