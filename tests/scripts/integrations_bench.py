"""Step time and hook bytes of charlm trained through a trainer, one variant per launch.

A developer's tool for the trainers' benchmark (the tests never time it). Every rank trains
charlm (``CharLMConfig()``: 3.2M parameters, AdamW) for ``--steps`` steps under one variant:

    ddp                plain DDP (the trainer's own)
    torch-powersgd     torch's powerSGD_hook, rank 4 after 2 warm-up steps, one bucket (on gloo
                       several buckets can hang: docs/torch-hooks-on-gloo.md)
    commfuse-powersgd  commfuse's PowerSGD(rank=4, warmup=2) through commfuse.integrations
    loop-powersgd      the same hook in a plain torch DDP loop, no trainer (the reference)

and rank 0 writes (``--json``) the median step time over the steps after ``--skip``, the
slowest rank's, and the hook's handed bytes per step (their median). Balanced rounds with an
A/A pair, on 4 emulated hosts at 100 Mbit/s (root; run from the repository root):

    mkdir -p out/integrations; for round in 1 2 3 4 5; do i=0
      for v in $(shuf -e ddp torch-powersgd commfuse-powersgd commfuse-powersgd loop-powersgd); do
        i=$((i+1)); commfuse launch --hosts 4 --link 100mbit --timeout 1200 \\
          tests/scripts/integrations_bench.py --trainer lightning --variant $v --steps 40 \\
          --json out/integrations/lightning-$v-r$round-$i.json
      done; done   # then again with --trainer accelerate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from commfuse.compress import PowerSGD
from commfuse.hooks import CompressionState, compressed_allreduce_hook
from commfuse.workloads.charlm import CharLM, CharLMConfig

ONE_BUCKET_MB = 1000.0


def handed(state: CompressionState | None) -> int:
    """Bytes commfuse's hook handed to its collectives so far (0 for torch's hooks)."""
    return 0 if state is None else state.comm.stats.total().handed_bytes


def torch_state() -> Any:
    return torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
    )


def loop(workload: CharLM, variant: str, steps: int, times: list[tuple[float, int]]) -> None:
    """A plain torch DDP loop (``loop-powersgd``): per step, its time and the hook's handed
    bytes so far."""
    model = workload.build_model(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB)
    state = None
    if variant in ("loop-powersgd", "commfuse-powersgd"):
        state = CompressionState(PowerSGD(rank=4, warmup=2), module=model)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    elif variant == "torch-powersgd":
        ddp.register_comm_hook(torch_state(), torch_powersgd.powerSGD_hook)
    optimizer = workload.make_optimizer(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        start = time.perf_counter()
        workload.loss(ddp, workload.batch(step, rank, world, seed=0)).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        times.append((time.perf_counter() - start, handed(state)))


def accelerate_run(
    workload: CharLM, variant: str, steps: int, times: list[tuple[float, int]]
) -> None:
    from accelerate import Accelerator

    from commfuse.integrations.accelerate import compress_gradients

    accelerator = Accelerator(cpu=True)
    model = workload.build_model(0)
    optimizer = workload.make_optimizer(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = None
    if variant == "commfuse-powersgd":
        state = compress_gradients(accelerator, model, PowerSGD(rank=4, warmup=2))
    elif variant == "torch-powersgd":
        model.register_comm_hook(torch_state(), torch_powersgd.powerSGD_hook)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        start = time.perf_counter()
        accelerator.backward(workload.loss(model, workload.batch(step, rank, world, seed=0)))
        optimizer.step()
        optimizer.zero_grad()
        times.append((time.perf_counter() - start, handed(state)))


def lightning_run(
    workload: CharLM, variant: str, steps: int, times: list[tuple[float, int]]
) -> None:
    import lightning
    from lightning.pytorch.strategies import DDPStrategy

    from commfuse.integrations.lightning import CommfuseDDPStrategy

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.build_model(0)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return workload.loss(self.model, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return workload.make_optimizer(self.model)

        def on_train_batch_start(self, batch: Any, index: int) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            hook = getattr(self.trainer.strategy, "hook_state", None)
            times.append((time.perf_counter() - self.started, handed(hook)))

    class TorchHookStrategy(DDPStrategy):  # Lightning registers torch's hooks on CUDA only
        def configure_ddp(self) -> None:
            super().configure_ddp()
            assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
            self.model.register_comm_hook(torch_state(), torch_powersgd.powerSGD_hook)

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = torch.stack([workload.batch(step, rank, world, seed=0) for step in range(steps)])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(batches), batch_size=None)
    strategy: Any = {
        "ddp": DDPStrategy(bucket_cap_mb=ONE_BUCKET_MB),
        "torch-powersgd": TorchHookStrategy(bucket_cap_mb=ONE_BUCKET_MB),
        "commfuse-powersgd": CommfuseDDPStrategy(
            PowerSGD(rank=4, warmup=2), bucket_cap_mb=ONE_BUCKET_MB
        ),
    }[variant]
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank's own batches, as in the loop
    )
    trainer.fit(Module(), data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["lightning", "accelerate"], required=True)
    parser.add_argument(
        "--variant",
        choices=["ddp", "torch-powersgd", "commfuse-powersgd", "loop-powersgd"],
        required=True,
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--json", help="rank 0 writes the record here")
    args = parser.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    workload = CharLM(CharLMConfig(), device=torch.device("cpu"))
    times: list[tuple[float, int]] = []
    run = {"lightning": lightning_run, "accelerate": accelerate_run}[args.trainer]
    if args.variant == "loop-powersgd":
        run = loop
    run(workload, args.variant, args.steps, times)
    kept = range(args.skip, len(times))
    median = statistics.median(times[i][0] for i in kept)
    per_step = statistics.median(times[i][1] - times[i - 1][1] for i in kept)
    medians: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(medians, median)
    record = {
        "trainer": args.trainer,
        "variant": args.variant,
        "steps": args.steps,
        "world_size": dist.get_world_size(),
        "median_step_s": max(medians),
        "hook_handed_bytes_per_step": per_step,
    }
    if dist.get_rank() == 0:
        print(json.dumps(record))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(record, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
