"""``commfuse simulate --validate``: calibrate on some real runs, predict others, print the error.

Each run on the emulated cluster (``commfuse.cluster.run``, 1 rank per host) has two launches:

1. calibration (``calibrate.py``, never scored): native collectives at ``NATIVE_SIZES``,
   ping-pongs, local rates, the compute-only step of ``CALIBRATION_MLP`` and its torch DDP
   step (communication's CPU cost), fitted into a ``ClusterModel``;
2. validation (held out), predicted by that model and measured in a second launch:

   * native collectives at ``VALIDATION_SIZES`` (between and beyond the calibration sizes);
   * commfuse's own ring allreduce, linear-pipeline allreduce and broadcast (at the block the
     code cuts by default, ``lp.block_bytes``, passed to the real call) and binomial-tree broadcast, never fitted: priced
     from the point-to-point fit and their cost.py formulas;
   * training steps of ``VALIDATION_MLP`` (another model than calibration's): torch DDP at two
     bucket sizes, ``commfuse.ddp.DataParallel``, DataParallel with the fp16 compressor (the
     simulator's ``compression_ratio`` 0.5 at the measured cast rate), and local SGD with
     ``PeriodicSyncOptimizer`` (preset ``localsgd``, H = 4; the simulator's
     ``local_sgd_period``), the mean step over a period.

``runs`` repeats both launches (recalibrating each time); the summary gives each run's median
and max |error| and each configuration's median over runs.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commfuse.bench.records import to_text
from commfuse.sim.calibrate import (
    KB,
    MB,
    calibration_configs,
    compression_gbyte_per_s,
    describe_fits,
    fit_cluster,
    mlp_workload,
)
from commfuse.sim.cluster import ClusterModel

#: Held-out sizes: x4 apart, each between two calibration sizes or beyond them.
VALIDATION_SIZES = (256 * KB, 1 * MB, 4 * MB, 16 * MB)
#: The validation steps' model (calibration's is ``calibrate.CALIBRATION_MLP``): 11.6 MB of fp32
#: parameters, so its gradient allreduce at 1 Gbit/s is about as long as its compute here.
VALIDATION_MLP = {"in": 784, "width": 1024, "depth": 3, "out": 10, "batch": 32}
_LOCAL_SGD_H = 4


def _collective(collective: str, algo: str, nbytes: int) -> dict[str, Any]:
    return {"kind": "collective", "collective": collective, "algo": algo, "bytes": nbytes}


def validation_configs(cluster: ClusterModel, *, quick: bool = False) -> list[dict[str, Any]]:
    """The held-out configurations; pipelines carry the block the simulator prices them at."""
    from commfuse.sim.network import pipeline_block_bytes

    step = {"kind": "step", "model": VALIDATION_MLP, "algo": "native"}
    if quick:
        out = [_collective("all_reduce", "native", MB), _collective("all_reduce", "ring", MB)]
        out += [
            {**step, "engine": "torch-ddp", "bucket_cap_mb": 25.0},
            {**step, "engine": "localsgd", "H": _LOCAL_SGD_H},
        ]
        return out
    out = [_collective("all_reduce", "native", n) for n in VALIDATION_SIZES]
    out += [_collective(c, "native", n) for c in ("broadcast", "all_to_all") for n in (MB, 4 * MB)]
    out.append(_collective("all_gather", "native", 4 * MB))
    out += [_collective("all_reduce", "ring", n) for n in (MB, 16 * MB)]
    out += [
        _collective("all_reduce", "pipeline", 4 * MB),
        _collective("broadcast", "pipeline", 4 * MB),
        _collective("broadcast", "pipeline", 16 * MB),
        _collective("broadcast", "tree", 4 * MB),
    ]
    for cfg in out:
        if cfg["algo"] == "pipeline":
            cfg["block_bytes"] = pipeline_block_bytes(cfg["collective"], cfg["bytes"], cluster)
    out += [
        {**step, "engine": "torch-ddp", "bucket_cap_mb": 25.0},
        {**step, "engine": "torch-ddp", "bucket_cap_mb": 1.0},
        {**step, "engine": "dataparallel", "bucket_cap_mb": 25.0},
        {**step, "engine": "dataparallel", "bucket_cap_mb": 25.0, "compressor": "fp16"},
        {**step, "engine": "localsgd", "H": _LOCAL_SGD_H},
    ]
    return out


def predict(cluster: ClusterModel, cfg: dict[str, Any], *, compression_gbps: float) -> float:
    """The simulator's seconds for one validation configuration."""
    from commfuse.sim.network import collective_time_s
    from commfuse.sim.plan import CommPlan
    from commfuse.sim.step import simulate_step

    if cfg["kind"] == "collective":
        return collective_time_s(cfg["collective"], cfg["algo"], cfg["bytes"], cluster)
    from commfuse.compress import FP16

    workload = mlp_workload(cfg["model"], "mlp")
    # The compressors a step configuration may name (``configurations``: fp16).
    compressor = {"fp16": FP16}[cfg["compressor"]]() if cfg.get("compressor") else None
    # torch DDP and DataParallel both cap their first bucket at 1 MB.
    plan = CommPlan(
        algorithm=cfg["algo"],
        bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0),
        first_bucket_cap_mb=1.0,
        local_sgd_period=int(cfg.get("H", 1)),
        compression_ratio=0.5 if cfg.get("compressor") == "fp16" else 1.0,
        compression_gbyte_per_s=compression_gbps if cfg.get("compressor") else 0.0,
        # DataParallel agrees on NaN/Inf first only for compressors that can drop a NaN.
        finite_agreement=compressor is not None and not compressor.nonfinite_reaches_every_rank,
    )
    return simulate_step(cluster, workload, plan).step_s


def describe(cfg: dict[str, Any]) -> str:
    from commfuse.units import format_size

    if cfg["kind"] == "collective":
        return f"{cfg['collective']} {cfg['algo']} {format_size(cfg['bytes'])}"
    engine = cfg["engine"]
    if engine == "localsgd":
        return f"local SGD step H={cfg['H']} MLP"
    name = {"torch-ddp": "torch DDP", "dataparallel": "DataParallel"}[engine]
    extra = f" {cfg['compressor']}" if cfg.get("compressor") else ""
    return f"{name}{extra} step MLP bucket={cfg['bucket_cap_mb']:g}MB"


def _one_run(
    topology: Any, hosts: int, link: str, reps: int, quick: bool, profile: str | None
) -> tuple[ClusterModel, float, list[dict[str, Any]], list[float], list[dict[str, Any]]]:
    from commfuse.bench.sim_measure import measure_on_rank
    from commfuse.cluster import run
    from commfuse.sim.cluster import PRESETS
    from commfuse.units import format_size

    base = dataclasses.replace(
        PRESETS["netlab-1gbit"], num_hosts=hosts, inter_gbit_per_s=topology.link_gbit or 1.0
    )
    calibration = calibration_configs(quick=quick)
    # Idle before each sample until the token buckets are full again (twice the refill time).
    refill_s = 2 * base.inter_burst_kbyte * 1024 * 8 / (base.inter_gbit_per_s * 1e9)
    timed = run(measure_on_rank, calibration, reps, 1, refill_s, net=topology, timeout_s=600)[0]
    cluster, fits = fit_cluster(base, calibration, timed)
    if profile:
        cluster = dataclasses.replace(cluster, profile_path=profile)
    rate = compression_gbyte_per_s(calibration, timed, cluster)
    print(
        f"calibrated on {len(calibration)} configurations (not scored): compute "
        f"{cluster.flops_per_s / 1e9:.2f} GFLOP/s, memory {cluster.mem_gbyte_per_s:.2f} GB/s, "
        f"reduce {cluster.reduce_gbyte_per_s:.2f} GB/s, fp16 cast {rate:.2f} GB/s per rank, "
        f"communication's CPU cost {cluster.comm_cpu_us_per_mbyte:.0f} us per MB"
    )
    for line in describe_fits(fits):
        print(line)
    validation = validation_configs(cluster, quick=quick)
    measured = run(measure_on_rank, validation, reps, 1, refill_s, net=topology, timeout_s=600)[0]
    fitted = [
        {
            "role": "calibration",
            "config": f"fit {name} {format_size(n)}",
            "predicted_us": t * (1 + residual) * 1e6,
            "measured_us": t * 1e6,
            "error": residual,
        }
        for name, fit in fits.items()
        for n, t, residual in zip(
            fit.sizes_bytes, fit.measured_s, fit.relative_residuals, strict=True
        )
    ]
    return cluster, rate, validation, measured, fitted


def run_validation(
    *,
    hosts: int = 4,
    link: str = "1gbit",
    json_path: str | None = None,
    quick: bool = False,
    reps: int | None = None,
    runs: int = 1,
    profile: str | None = None,
    cluster_path: str | None = None,
    write: Callable[[str, str], str] | None = None,
) -> int:
    """Calibrate and validate ``runs`` times; print and (``json_path``) write the records;
    ``cluster_path`` receives the last calibrated cluster as JSON (``--cluster PATH`` reads it).
    ``write(path, text)`` writes each file and returns where it went (the command's
    ``write_output``, which falls back to another path); None: ``Path.write_text``.

    Raises:
        RankError, DeadlineExceeded, NetlabError: a real run failed (the command exits 1).
    """
    from commfuse.cluster import Topology

    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    write = write or _write_text
    topology = Topology.from_spec(hosts=hosts, ranks_per_host=1, link=link)
    reps = reps or (3 if quick else 7)
    records: list[dict[str, Any]] = []
    calibration_records: list[dict[str, Any]] = []
    for index in range(runs):
        print(f"run {index + 1}/{runs}: {hosts} emulated hosts at {link}, {reps} repetitions")
        cluster, rate, validation, measured, fitted = _one_run(
            topology, hosts, link, reps, quick, profile
        )
        print(f"{'configuration':<40} {'predicted_ms':>12} {'measured_ms':>12} {'error':>8}")
        for cfg, seconds in zip(validation, measured, strict=True):
            predicted = predict(cluster, cfg, compression_gbps=rate)
            error = predicted / seconds - 1.0
            config = {("config_kind" if k == "kind" else k): v for k, v in cfg.items()}
            records.append(
                {
                    "kind": "simulate --validate",  # commfuse report's table (cli/report.py)
                    "role": "validation",
                    "config": describe(cfg),
                    **config,
                    "run": index,
                    "hosts": hosts,
                    "link": link,
                    "predicted_us": predicted * 1e6,
                    "measured_us": seconds * 1e6,
                    "error": error,
                }
            )
            print(
                f"{describe(cfg):<40} {predicted * 1e3:>12.3f} {seconds * 1e3:>12.3f} "
                f"{error * 100:>+7.1f}%"
            )
        errors = [abs(r["error"]) for r in records if r["run"] == index]
        calibration_records += [
            {"kind": "simulate --validate", **r, "run": index, "hosts": hosts, "link": link}
            for r in fitted
        ]
        print(
            f"run {index + 1}: held-out configurations: {len(errors)}, median |error| "
            f"{statistics.median(errors) * 100:.1f}%, max {max(errors) * 100:.1f}%"
        )
        if cluster_path:
            where = write(cluster_path, cluster.to_json() + "\n")
            print(f"calibrated cluster written to {where}")
    _summary(records, runs)
    if json_path:
        # Held-out records first; the calibration fits' residuals follow (role "calibration").
        text = to_text("simulate --validate", records + calibration_records)
        where = write(json_path, text)
        print(f"records written to {where}")
    return 0


def _write_text(path: str, text: str) -> str:
    Path(path).write_text(text)
    return path


def _summary(records: list[dict[str, Any]], runs: int) -> None:
    by_config: dict[str, list[float]] = {}
    for r in records:
        by_config.setdefault(r["config"], []).append(r["error"])
    medians = {k: statistics.median(v) for k, v in by_config.items()}
    if runs > 1:
        print(f"median error of each configuration over {runs} runs:")
        for config, error in medians.items():
            print(f"  {config:<40} {error * 100:>+7.1f}%")
    absolute = [abs(e) for e in medians.values()]
    print(
        f"held-out configurations: {len(absolute)}, median |error| "
        f"{statistics.median(absolute) * 100:.1f}%, max {max(absolute) * 100:.1f}% "
        "(the machine is shared with other jobs: timings are noisy)"
    )
