"""The benchmarks' one clock: the wall time after the device has finished its queued work.

A CUDA kernel returns to Python as soon as it is queued, so ``time.perf_counter()`` around a GPU
collective measures the launch, not the work. ``now(device)`` first waits for the device
(``torch.cuda.synchronize``), as every GPU benchmark must (NCCL's own tests do the same); on the
CPU, where every op has finished when it returns, it is ``time.perf_counter()``.
"""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds on ``time.perf_counter``'s clock, read after ``device``'s queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def default_group_device() -> torch.device:
    """The device of this rank's default process group (NCCL: the current CUDA device, as
    ``Communicator.device``; any other backend: the CPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
