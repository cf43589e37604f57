"""``commfuse simulate --validate``: calibrate the model on some real runs, predict others.

On the emulated cluster (``commfuse.cluster.run``, 1 rank per host), every configuration runs
for real, timed as the slowest rank, median of several runs:

1. calibration (never scored): gloo's native allreduce at two sizes, from which the link's
   alpha and beta are solved (ring model, ``cost.ring_allreduce``); and the forward+backward of a
   small MLP on every rank at once with no communication, from which each rank's achieved FLOP/s
   follows (FLOPs read from the module on the meta device, ``workload.from_module``);
2. validation (held out): collectives of other sizes and algorithms through
   ``commfuse.collectives``, and full training steps of the same MLP under torch DDP (gradient
   buckets overlapped with backward), each predicted by the calibrated simulator.

The training steps of ``ddp/``, ``fused/`` and ``localsgd/`` are to be added here as those engines
land; their strategies are simulated from the models meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ALLREDUCE_FIT = ("allreduce", "native", [256 << 10, 4 << 20])
MLP_WIDTH, MLP_DEPTH, MLP_BATCH, MLP_IN = 1024, 3, 32, 784


def _configs(quick: bool) -> list[dict[str, Any]]:
    sizes = [1 << 20] if quick else [1 << 20, 16 << 20]
    out = [
        {"kind": "collective", "collective": "allreduce", "algo": a, "bytes": n}
        for a in (["native"] if quick else ["native", "ring", "pipeline"])
        for n in sizes
    ]
    if not quick:
        out += [
            {"kind": "collective", "collective": c, "algo": a, "bytes": 4 << 20}
            for c, a in (
                ("broadcast", "native"),
                ("broadcast", "pipeline"),
                ("allgather", "native"),
                ("all_to_all", "native"),
            )
        ]
    out += [{"kind": "ddp", "bucket_cap_mb": mb} for mb in ([25.0] if quick else [25.0, 1.0])]
    return out


def _mlp() -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(MLP_IN, MLP_WIDTH), torch.nn.ReLU()]
    for _ in range(MLP_DEPTH - 1):
        layers += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(MLP_WIDTH, 10))
    return torch.nn.Sequential(*layers)


def _slowest(comm: Any, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(t, "max")
    return float(t.item())


def _time_collective(comm: Any, cfg: dict[str, Any], reps: int) -> float:
    from commfuse import collectives as C

    n = cfg["bytes"] // 4
    world = comm.world_size
    x = torch.ones(n)
    runs = []
    for _ in range(reps + 1):  # the first run warms up connections and is dropped
        torch.distributed.barrier()
        began = time.perf_counter()
        if cfg["collective"] == "allreduce":
            C.allreduce(comm, x, algo=cfg["algo"])
        elif cfg["collective"] == "broadcast":
            C.broadcast(comm, x, 0, algo=cfg["algo"])
        elif cfg["collective"] == "allgather":
            C.allgather(comm, torch.empty(n), x[: n // world], algo=cfg["algo"])
        else:
            C.all_to_all(comm, torch.empty(n), x, algo=cfg["algo"])
        runs.append(_slowest(comm, time.perf_counter() - began))
    return statistics.median(runs[1:])


def _time_steps(comm: Any, bucket_cap_mb: float | None, reps: int) -> float:
    """A training step (forward, backward, SGD step) of the MLP; without DDP when the bucket is
    None (the compute calibration: every rank computes at once, nothing is communicated)."""
    torch.manual_seed(0)
    model = _mlp()
    if bucket_cap_mb is not None:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(MLP_BATCH, MLP_IN), torch.randint(0, 10, (MLP_BATCH,))
    runs = []
    for _ in range(reps + 1):
        torch.distributed.barrier()
        began = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        runs.append(_slowest(comm, time.perf_counter() - began))
    return statistics.median(runs[1:])


def measure_on_rank(configs: list[dict[str, Any]], reps: int) -> list[float]:
    """Run on every rank: the measured seconds of each configuration."""
    from commfuse.comm import Communicator

    torch.set_num_threads(1)
    comm = Communicator()
    out = []
    for cfg in configs:
        if cfg["kind"] == "collective":
            out.append(_time_collective(comm, cfg, reps))
        else:
            out.append(_time_steps(comm, cfg.get("bucket_cap_mb"), reps))
    return out


def calibrate(base: Any, fit_times: list[float], compute_s: float, workload: Any) -> Any:
    """The cluster with alpha and beta solved from native allreduce times at two sizes
    (t = 2(P-1) alpha + 2((P-1)/P) n (beta + gamma / 2), gamma kept), and the FLOP rate and memory
    bandwidth from the compute-only step."""
    (n1, n2), (t1, t2) = ALLREDUCE_FIT[2], fit_times
    p = base.world_size
    f = (p - 1) / p
    gamma = base.gamma_s_per_byte
    slope = (t2 - t1) / (n2 - n1)  # 2 f beta + f gamma
    beta = max((slope - f * gamma) / (2 * f), 1e-12)
    alpha = max((t1 - n1 * slope) / (2 * (p - 1)), 0.0)
    # The step's compute: FLOPs at the achieved rate; the optimizer's memory traffic is small
    # beside it here, so the whole step is charged to FLOPs.
    flops = workload.flops / compute_s
    return dataclasses.replace(
        base,
        inter_latency_us=alpha * 1e6,
        inter_gbit_per_s=8.0 / beta / 1e9,
        flops_per_s=flops,
        mem_gbyte_per_s=1e6,
    )


def predict(cluster: Any, workload: Any, cfg: dict[str, Any]) -> float:
    from commfuse.sim.network import collective_time_s
    from commfuse.sim.step import simulate_step
    from commfuse.sim.strategy import Strategy

    if cfg["kind"] == "collective":
        return collective_time_s(cfg["collective"], cfg["algo"], cfg["bytes"], cluster)
    strategy = Strategy(algorithm="native", bucket_cap_mb=cfg["bucket_cap_mb"])
    return simulate_step(cluster, workload, strategy).step_s


def describe(cfg: dict[str, Any]) -> str:
    if cfg["kind"] == "collective":
        from commfuse.units import format_size

        return f"{cfg['collective']} {cfg['algo']} {format_size(cfg['bytes'])}"
    return f"DDP step MLP bucket={cfg['bucket_cap_mb']:g}MB"


def run_validation(
    *,
    hosts: int = 4,
    link: str = "1gbit",
    json_path: str | None = None,
    quick: bool = False,
    reps: int | None = None,
) -> int:
    from commfuse.cluster import DeadlineExceeded, RankError, Topology, run
    from commfuse.cluster.netlab import NetlabError
    from commfuse.sim.cluster import PRESETS
    from commfuse.sim.workload import from_module

    topology = Topology.from_spec(hosts=hosts, ranks_per_host=1, link=link)
    reps = reps or (3 if quick else 7)
    calibration = [
        {"kind": "collective", "collective": "allreduce", "algo": "native", "bytes": n}
        for n in ALLREDUCE_FIT[2]
    ] + [{"kind": "ddp_compute"}]
    validation = _configs(quick)
    try:
        measured = run(
            measure_on_rank, calibration + validation, reps, net=topology, timeout_s=600
        )[0]
    except (RankError, DeadlineExceeded, NetlabError) as err:
        print(f"commfuse simulate --validate: {err}", file=sys.stderr)
        return 1
    workload = from_module(_mlp(), (MLP_BATCH, MLP_IN), name="mlp")
    base = dataclasses.replace(
        PRESETS["netlab-1gbit"], num_hosts=hosts, inter_gbit_per_s=topology.link_gbit or 1.0
    )
    cluster = calibrate(base, measured[:2], measured[2], workload)
    print(
        f"calibrated on {len(calibration)} configurations (not scored): alpha "
        f"{cluster.inter_latency_us:.1f} us, link {cluster.inter_gbit_per_s:.3f} Gbit/s, "
        f"compute {cluster.flops_per_s / 1e9:.2f} GFLOP/s per rank"
    )
    records = []
    print(f"{'configuration':<34} {'predicted_ms':>12} {'measured_ms':>12} {'error':>8}")
    for cfg, seconds in zip(validation, measured[len(calibration) :], strict=True):
        predicted = predict(cluster, workload, cfg)
        error = predicted / seconds - 1.0
        records.append(
            {
                "config": describe(cfg),
                **cfg,
                "hosts": hosts,
                "link": link,
                "predicted_us": predicted * 1e6,
                "measured_us": seconds * 1e6,
                "error": error,
            }
        )
        print(
            f"{describe(cfg):<34} {predicted * 1e3:>12.3f} {seconds * 1e3:>12.3f} "
            f"{error * 100:>+7.1f}%"
        )
    errors = [abs(r["error"]) for r in records]
    print(
        f"held-out configurations: {len(errors)}, median |error| "
        f"{statistics.median(errors) * 100:.1f}%, max {max(errors) * 100:.1f}% "
        "(the machine may be shared: timings are noisy)"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1) + "\n")
        print(f"records written to {json_path}")
    return 0
