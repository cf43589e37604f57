"""``commfuse bench collectives``: an nccl-tests style sweep of collectives over sizes.

Each (op, size) is timed ``iters`` times after ``warmup`` untimed runs. Every timed run starts
after a barrier; its time is the slowest rank's (a collective is done when its last rank is
done), and the row reports the median over runs, with algbw, busbw and, on an emulated
cluster, busbw as a percent of the host link rate, the physical limit there.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch

from commfuse.bench.cases import OPS, bus_factor, make_case
from commfuse.cluster.topology import Topology
from commfuse.comm import Communicator


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveBenchConfig:
    """What to sweep."""

    ops: tuple[str, ...] = ("allreduce",)
    """Collectives to time, from OPS."""
    sizes_bytes: tuple[int, ...] = (1 << 20,)
    """Message sizes S (nccl-tests' convention per op)."""
    iters: int = 10
    """Timed repetitions per row; the median is reported."""
    warmup: int = 2
    """Untimed repetitions before timing (connection set-up, allocator)."""
    dtype: str = "float32"
    """Element type of the buffers."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(
                f"unknown --op {', '.join(unknown)}: use one or more of {', '.join(OPS)}"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        if any(size <= 0 for size in self.sizes_bytes):
            raise ValueError("--sizes must all be positive")


def bench_collectives_on_rank(config: CollectiveBenchConfig) -> list[dict[str, Any]]:
    """Runs on every rank (the process group is up); rank 0's return value is the report."""
    comm = Communicator()
    topology = Topology.from_env()
    dtype = getattr(torch, config.dtype)
    link_gbit = topology.link_gbit
    records: list[dict[str, Any]] = []
    for op in config.ops:
        for size in config.sizes_bytes:
            case = make_case(comm, op, size, dtype)
            for _ in range(config.warmup):
                case.reset()
                case.call()
            times = torch.zeros(config.iters, dtype=torch.float64)
            wrong = 0
            for i in range(config.iters):
                case.reset()
                comm.barrier()
                start = time.perf_counter()
                case.call()
                times[i] = time.perf_counter() - start
                wrong += case.count_wrong()
            # A collective takes as long as its slowest rank: max over ranks, then the median.
            comm.all_reduce(times, "max")
            wrong_t = torch.tensor([wrong], dtype=torch.int64)
            comm.all_reduce(wrong_t, "sum")
            seconds = statistics.median(times.tolist())
            algbw = case.size_bytes / seconds / 1e9
            busbw = algbw * bus_factor(op, comm.world_size)
            records.append(
                {
                    "op": op,
                    "algo": "native",
                    "bytes": case.size_bytes,
                    "dtype": config.dtype,
                    "world_size": comm.world_size,
                    "hosts": topology.num_hosts,
                    "ranks_per_host": topology.ranks_per_host,
                    "link_gbit": link_gbit,
                    "emulated": bool(os.environ.get("COMMFUSE_NETLAB")),
                    "time_us": seconds * 1e6,
                    "time_us_min": float(times.min()) * 1e6,
                    "iters": config.iters,
                    "algbw_GBps": algbw,
                    "busbw_GBps": busbw,
                    "link_pct": None if link_gbit is None else 100.0 * busbw / (link_gbit / 8.0),
                    # wrong elements per run, summed over ranks (a correct collective has 0)
                    "wrong": int(wrong_t.item()) // config.iters,
                }
            )
    return records
