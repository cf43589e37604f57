"""The one clock of every timer in commfuse: wall time after the device has finished its work.

A CUDA kernel (an NCCL collective included) returns to Python as soon as it is queued, so
``time.perf_counter()`` around GPU work measures the launch, not the work. ``now(device)`` first
waits for the device's queued work (``torch.cuda.synchronize``), as every GPU benchmark must
(nccl-tests does the same); on the CPU, where every op has finished when it returns, it is
``time.perf_counter()``. The tuner's calibration, the fused operators' chunk timers, the
training loop and the benchmarks read this clock, so a time means the same on every device.
"""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds on ``time.perf_counter``'s clock, read after ``device``'s queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def elapsed_us(start_s: float, device: torch.device) -> float:
    """Microseconds from ``start_s`` (a ``now(device)`` reading) until ``device`` is done."""
    return (now(device) - start_s) * 1e6
