"""Step time of ``DataParallel`` against torch's ``DistributedDataParallel``, side by side.

Run on every rank (``commfuse.cluster.run(bench_rank, ..., net=Topology(...))``). Both wrap
copies of the same model with the same bucket caps (torch's defaults: 25 MiB, 1 MiB for the
first bucket) and train on the same batches; they are timed interleaved (A B A B ...), each
block of steps after a barrier and as the slowest rank's time, and compared by the median of
the per-repetition ratios, so drifts of a shared, noisy machine hit both alike.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commfuse.comm import Communicator
from commfuse.ddp.config import DataParallelConfig
from commfuse.ddp.wrapper import DataParallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class DdpBenchConfig:
    """What to time."""

    num_layers: int = 8
    """Hidden Linear layers of the MLP."""
    width: int = 512
    """Width of each layer (num_layers x width^2 parameters, about)."""
    batch_size: int = 32
    """Samples per rank per step."""
    num_steps: int = 5
    """Steps per timed block."""
    num_reps: int = 5
    """Timed blocks per engine (interleaved)."""
    algo: str = "auto"
    """commfuse's allreduce algorithm."""


def _mlp(config: DdpBenchConfig) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(config.num_layers):
        layers += [nn.Linear(config.width, config.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(config.width, 10))


def _time_block(step: Callable[[], None], num_steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) / num_steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def bench_rank(config: DdpBenchConfig | None = None) -> dict[str, Any]:
    """Per-step seconds of commfuse and torch DDP, their median ratio, and the exposed
    communication commfuse measured (the same on every rank, up to the last field)."""
    config = config or DdpBenchConfig()
    torch.manual_seed(0)
    ours_net, theirs_net = _mlp(config), _mlp(config)
    theirs_net.load_state_dict(ours_net.state_dict())
    ours = DataParallel(ours_net, Communicator(), config=DataParallelConfig(algo=config.algo))
    theirs = nn.parallel.DistributedDataParallel(theirs_net)
    opts = {
        "commfuse": torch.optim.SGD(ours_net.parameters(), lr=1e-3),
        "torch_ddp": torch.optim.SGD(theirs_net.parameters(), lr=1e-3),
    }
    models: dict[str, nn.Module] = {"commfuse": ours, "torch_ddp": theirs}
    x = torch.randn(config.batch_size, config.width)
    y = torch.randint(0, 10, (config.batch_size,))

    def stepper(name: str) -> Callable[[], None]:
        def step() -> None:
            loss = nn.functional.cross_entropy(models[name](x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opts[name].step()
            opts[name].zero_grad()

        return step

    for name in models:  # warm-up (torch rebuilds its buckets after its first step)
        _time_block(stepper(name), 2)
    times: dict[str, list[float]] = {name: [] for name in models}
    exposed = []
    for _ in range(config.num_reps):
        for name in models:
            times[name].append(_time_block(stepper(name), config.num_steps))
        assert ours.last_stats is not None
        exposed.append(ours.last_stats.exposed_comm_s)
    ratios = [a / b for a, b in zip(times["commfuse"], times["torch_ddp"], strict=True)]
    ours.close()
    return {
        "params": sum(p.numel() for p in ours_net.parameters()),
        "num_buckets": len(ours.bucket_layout),
        "commfuse_step_s": statistics.median(times["commfuse"]),
        "torch_ddp_step_s": statistics.median(times["torch_ddp"]),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "exposed_comm_s": statistics.median(exposed),
    }
