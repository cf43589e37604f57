"""Step time of ``DataParallel`` against torch's ``DistributedDataParallel``, side by side.

Run on every rank (``commfuse.cluster.run(bench_ddp_on_rank, ..., net=Topology(...))``; the command is
``commfuse bench ddp``). Every engine wraps its own copy of the same model with the same bucket
caps (torch's defaults: 25 MiB, 1 MiB for the first bucket; torch DDP with
``gradient_as_bucket_view``, as commfuse's engine) and trains on the same batches:
torch DDP, commfuse uncompressed with each allreduce ``algo`` asked for, and the bare model
(no communication: the compute floor). They are timed in rounds, each round in the balanced
order of ``bench/schedule.py`` (every engine in every position equally often), each block of
steps after a barrier and as the slowest rank's time, and compared by the median of the
per-round ratios to torch DDP, so drifts of a shared, noisy machine hit all alike. With
``control`` torch DDP is built and timed twice (``torch_ddp'``): its ratio is the noise floor,
and a ratio within it is a tie. Exposed communication is an engine's step time minus the
compute floor's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commfuse.bench.schedule import Schedule, control_name, summarize
from commfuse.comm import Communicator
from commfuse.comm.clock import now
from commfuse.ddp.config import DataParallelConfig
from commfuse.ddp.wrapper import DataParallel
from commfuse.train.torch_ddp import bucket_caps

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
    """Timed blocks per engine (rounds in balanced orders)."""
    algos: tuple[str, ...] = ("native", "auto")
    """commfuse allreduce algorithms, one engine each."""
    control: bool = False
    """Time a second torch DDP (A/A): its ratio to the first is the noise floor."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        for key in ("num_layers", "width", "batch_size", "num_steps", "num_reps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if not self.algos:
            raise ValueError("algos must name at least one all_reduce algorithm")
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


def _batch(config: DdpBenchConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn on the CPU generator and moved: every device gets the same numbers.
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    shape = (config.batch_size, 32, config.width) if config.model == "transformer" else None
    x = torch.randn(shape or (config.batch_size, config.width), generator=gen, device="cpu")
    y = torch.randint(0, 10, (config.batch_size,), generator=gen, device="cpu")
    return x.to(device), y.to(device)


def _time_block(step: Callable[[], None], num_steps: int, device: torch.device) -> float:
    dist.barrier()
    start = now(device)
    for _ in range(num_steps):
        step()
    elapsed = torch.tensor([(now(device) - start) / num_steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


#: The baseline engine.
BASELINE = "torch_ddp"


def bench_ddp_on_rank(config: DdpBenchConfig | None = None) -> list[dict[str, Any]]:
    """One record per engine (the same on every rank): median step seconds, exposed
    communication, and the median ratio to torch DDP's step."""
    config = config or DdpBenchConfig()
    torch.manual_seed(0)
    device = Communicator().device  # the rank's: cuda:LOCAL_RANK under NCCL, else the CPU
    twin = control_name(BASELINE)
    torch_names = [BASELINE, *([twin] if config.control else [])]
    nets = {name: build_model(config).to(device) for name in [*torch_names, "compute"]}
    for algo in config.algos:
        nets[f"commfuse:{algo}"] = build_model(config).to(device)
    for net in nets.values():
        net.load_state_dict(nets[BASELINE].state_dict())
    # torch DDP as commfuse's engine runs: gradients as views into the buckets, and the same
    # caps (an explicit bucket_cap_mb alone would drop torch's 1 MiB first bucket).
    caps = bucket_caps(config.bucket_cap_mb, DataParallelConfig().first_bucket_cap_mb)
    models: dict[str, nn.Module] = {
        name: nn.parallel.DistributedDataParallel(nets[name], gradient_as_bucket_view=True, **caps)
        for name in torch_names
    }
    models["compute"] = nets["compute"]
    ours: dict[str, DataParallel] = {}
    for algo in config.algos:
        dp_config = DataParallelConfig(algo=algo, bucket_cap_mb=config.bucket_cap_mb)
        ours[algo] = DataParallel(nets[f"commfuse:{algo}"], Communicator(), config=dp_config)
        models[f"commfuse:{algo}"] = ours[algo]
    opts = {name: torch.optim.SGD(nets[name].parameters(), lr=1e-4) for name in models}
    x, y = _batch(config, device)

    def stepper(name: str) -> Callable[[], None]:
        def step() -> None:
            out = models[name](x)
            loss = nn.functional.cross_entropy(out.mean(1) if out.dim() == 3 else out, y)
            loss.backward()  # type: ignore[no-untyped-call]
            opts[name].step()
            opts[name].zero_grad()

        return step

    for name in models:  # warm-up (torch rebuilds its buckets after its first step)
        _time_block(stepper(name), 2, device)
    schedule = Schedule(
        tuple(name for name in models if name != twin),
        rounds=config.num_reps,
        control=config.control,
        seed=config.seed_order,
    )
    times: dict[str, list[float]] = {name: [] for name in schedule.names}
    for order in schedule.orders():  # the same seeded orders on every rank
        for name in order:
            times[name].append(_time_block(stepper(name), config.num_steps, device))
    summary = summarize(times, baseline=BASELINE, control=schedule.control_variant)
    records = []
    for name in schedule.names:
        exposed = [a - b for a, b in zip(times[name], times["compute"], strict=True)]
        ratio = summary.ratios[name]
        records.append(
            {
                "engine": name,
                "model": config.model,
                "params": sum(p.numel() for p in nets[name].parameters()),
                "num_buckets": len(ours[name.split(":", 1)[1]].bucket_layout)
                if name.startswith("commfuse:")
                else None,
                "step_s": summary.medians[name],
                "step_s_min": min(times[name]),
                "step_s_max": max(times[name]),
                "exposed_comm_s": statistics.median(exposed),
                "ratio_to_torch_ddp": ratio,
                "ratio_min": summary.ratio_ranges[name][0],
                "ratio_max": summary.ratio_ranges[name][1],
                **summary.as_dict(),
                "tie": summary.is_tie(ratio, variant=name) if name != BASELINE else None,
                "ratio_ci": list(summary.ratio_intervals[name]),
                "world_size": dist.get_world_size(),
                "bucket_cap_mb": config.bucket_cap_mb,
                "num_steps": config.num_steps,
                "num_reps": config.num_reps,
                "orders": [list(order) for order in schedule.orders()],
            }
        )
    for dp in ours.values():
        dp.close()
    return records
