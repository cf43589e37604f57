"""Step time of ``DataParallel`` against torch's ``DistributedDataParallel``, side by side.

Run on every rank (``commfuse.cluster.run(bench_rank, ..., net=Topology(...))``; the command is
``commfuse bench ddp``). Every engine wraps its own copy of the same model with the same bucket
caps (torch's defaults: 25 MiB, 1 MiB for the first bucket) and trains on the same batches:
torch DDP, commfuse uncompressed with each allreduce ``algo`` asked for, and the bare model
(no communication: the compute floor). They are timed interleaved (A B C A B C ...), each block
of steps after a barrier and as the slowest rank's time, and compared by the median of the
per-repetition ratios to torch DDP, so drifts of a shared, noisy machine hit all alike.
Exposed communication is an engine's step time minus the compute floor's.
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

MODELS = ("mlp", "transformer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DdpBenchConfig:
    """What to time."""

    model: str = "mlp"
    """``mlp`` (num_layers Linear+ReLU of width x width) or ``transformer`` (num_layers encoder
    layers of width d_model, 4 heads, feed-forward 4 x width, on sequences of 32 tokens)."""
    num_layers: int = 8
    """Hidden layers of the model."""
    width: int = 512
    """Width of each layer."""
    batch_size: int = 32
    """Samples per rank per step."""
    bucket_cap_mb: float = 25.0
    """Bucket cap of both engines, MiB (the first bucket: 1 MiB, as torch)."""
    num_steps: int = 5
    """Steps per timed block."""
    num_reps: int = 7
    """Timed blocks per engine (interleaved)."""
    algos: tuple[str, ...] = ("native", "auto")
    """commfuse allreduce algorithms, one engine each."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        for key in ("num_layers", "width", "batch_size", "num_steps", "num_reps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if not self.algos:
            raise ValueError("algos must name at least one allreduce algorithm")
        for algo in self.algos:
            DataParallelConfig(algo=algo)  # ValueError naming the known algorithms


def build_model(config: DdpBenchConfig) -> nn.Module:
    """The benchmark's model (deterministic given the torch seed)."""
    if config.model == "transformer":
        layer = nn.TransformerEncoderLayer(
            config.width, 4, 4 * config.width, dropout=0.0, batch_first=True
        )
        encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        return nn.Sequential(encoder, nn.Linear(config.width, 10))
    layers: list[nn.Module] = []
    for _ in range(config.num_layers):
        layers += [nn.Linear(config.width, config.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(config.width, 10))


def _batch(config: DdpBenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    shape = (config.batch_size, 32, config.width) if config.model == "transformer" else None
    x = torch.randn(shape or (config.batch_size, config.width), generator=gen)
    return x, torch.randint(0, 10, (config.batch_size,), generator=gen)


def _time_block(step: Callable[[], None], num_steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) / num_steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def bench_rank(config: DdpBenchConfig | None = None) -> list[dict[str, Any]]:
    """One record per engine (the same on every rank): median step seconds, exposed
    communication, and the median ratio to torch DDP's step."""
    config = config or DdpBenchConfig()
    torch.manual_seed(0)
    nets = {"torch_ddp": build_model(config), "compute": build_model(config)}
    for algo in config.algos:
        nets[f"commfuse:{algo}"] = build_model(config)
    for net in nets.values():
        net.load_state_dict(nets["torch_ddp"].state_dict())
    models: dict[str, nn.Module] = {
        "torch_ddp": nn.parallel.DistributedDataParallel(
            nets["torch_ddp"], bucket_cap_mb=config.bucket_cap_mb
        ),
        "compute": nets["compute"],
    }
    ours: dict[str, DataParallel] = {}
    for algo in config.algos:
        dp_config = DataParallelConfig(algo=algo, bucket_cap_mb=config.bucket_cap_mb)
        ours[algo] = DataParallel(nets[f"commfuse:{algo}"], Communicator(), config=dp_config)
        models[f"commfuse:{algo}"] = ours[algo]
    opts = {name: torch.optim.SGD(nets[name].parameters(), lr=1e-4) for name in models}
    x, y = _batch(config)

    def stepper(name: str) -> Callable[[], None]:
        def step() -> None:
            out = models[name](x)
            loss = nn.functional.cross_entropy(out.mean(1) if out.dim() == 3 else out, y)
            loss.backward()  # type: ignore[no-untyped-call]
            opts[name].step()
            opts[name].zero_grad()

        return step

    for name in models:  # warm-up (torch rebuilds its buckets after its first step)
        _time_block(stepper(name), 2)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(config.num_reps):
        for name in models:
            times[name].append(_time_block(stepper(name), config.num_steps))
    records = []
    for name in models:
        ratios = [a / b for a, b in zip(times[name], times["torch_ddp"], strict=True)]
        exposed = [a - b for a, b in zip(times[name], times["compute"], strict=True)]
        records.append(
            {
                "engine": name,
                "model": config.model,
                "params": sum(p.numel() for p in nets[name].parameters()),
                "num_buckets": len(ours[name.split(":", 1)[1]].bucket_layout)
                if name in nets and name.startswith("commfuse:")
                else None,
                "step_s": statistics.median(times[name]),
                "step_s_min": min(times[name]),
                "step_s_max": max(times[name]),
                "exposed_comm_s": statistics.median(exposed),
                "ratio_to_torch_ddp": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "world_size": dist.get_world_size(),
                "bucket_cap_mb": config.bucket_cap_mb,
                "num_steps": config.num_steps,
                "num_reps": config.num_reps,
            }
        )
    for dp in ours.values():
        dp.close()
    return records
