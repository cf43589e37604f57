"""``commfuse simulate --calibrate``: fit the cluster model to real runs on the emulated cluster.

1. **Host link, point to point**: ping-pongs of ``_P2P_SIZES`` between rank 0 and the next host;
   alpha + n beta fitted -> ``inter_latency_us``, ``inter_gbit_per_s``. This prices commfuse's
   own algorithms (ring, linear pipeline, binomial tree), which are built on point-to-point
   messages.
2. **Each native collective against its own model**: gloo's allreduce (ring), broadcast
   (binomial tree, concurrent sends), all-to-all (pairwise) and allgather (ring) at ``NATIVE_SIZES``; each fit
   becomes a ``CollectiveLink`` that prices that algorithm alone.
3. **Local rates**: ``a += b`` (gamma -> ``reduce_gbyte_per_s``), an SGD update
   (``mem_gbyte_per_s``, 3 bytes moved per parameter byte), the fp16 compressor's local work
   (finiteness test, scale, cast) and what gloo's fp16 allreduce costs beyond an fp32 one of the
   same bytes (``_HALF_ALL_REDUCE_SIZES``; together ``compression_gbyte_per_s``), all on every
   rank at once, since in a step they share the cores.
4. **Compute**: forward, backward and SGD step of ``CALIBRATION_MLP`` with no communication on
   every rank at once; its FLOPs (PyTorch's counter on the meta device) over the time left after
   the modelled optimizer give ``flops_per_s``.
5. **CPU cost of communication**: the same MLP's torch DDP step (25 MB buckets: its 1 MB first
   bucket runs under the rest of backward, the other after it), every rank at once. With small
   buckets the step is bound by its queue of allreduces, and a slower backward hides behind the
   queue: the step barely moves with the coefficient, which is then ill-determined; here it
   moves linearly; ``comm_cpu_us_per_mbyte`` is
   the coefficient at which the simulated step (``cpu_share.py``) matches it, by bisection.
   Fitted on the calibration MLP only, after every other quantity, so it absorbs only what the
   free-overlap model misses: the network's CPU time on the shared cores.

Design notes: ``docs/simulator.md``, "Calibration: what is measured, and why apart from
validation".
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

from commfuse.sim.cluster import ClusterModel, CollectiveLink
from commfuse.sim.cpu_share import fit_comm_cpu
from commfuse.sim.fit import (
    LinkFit,
    fit_link,
    native_with_burst,
    overlapped,
    point_to_point,
    with_burst,
)
from commfuse.sim.model import ModelProfile, from_module
from commfuse.sim.plan import CommPlan

if TYPE_CHECKING:
    import torch

KB, MB = 1 << 10, 1 << 20
#: Sizes of the native-collective fits: x4 apart, from latency-bound to bandwidth-bound.
NATIVE_SIZES = (128 * KB, 512 * KB, 2 * MB, 8 * MB)
_NATIVE_COLLECTIVES = ("all_reduce", "broadcast", "all_to_all", "all_gather")
#: Sizes of the fp16 allreduce whose excess over fp32 at the same bytes is fp16's summation
#: cost (gloo adds halves in software) charged to the fp16 compressor.
_HALF_ALL_REDUCE_SIZES = (2 * MB, 8 * MB)
#: Native collectives whose start-ups run under their transfers (``fit.overlapped``): gloo's
#: segmented ring allreduce.
_OVERLAPPED_NATIVE = {("all_reduce", "native")}
#: Ping-pong sizes of the point-to-point fit.
_P2P_SIZES = (128 * KB, 512 * KB, 2 * MB, 8 * MB)
#: Local element-wise work: big enough to leave the caches.
_LOCAL_BYTES = 16 * MB
#: The compute calibration's model: not the validation's (other widths and depth).
CALIBRATION_MLP = {"in": 512, "width": 768, "depth": 4, "out": 10, "batch": 32}
#: SGD without momentum reads the weight and the gradient and writes the weight.
SGD_BYTES_PER_PARAM_BYTE = 3.0
#: The communicating step of the calibration MLP that ``comm_cpu_us_per_mbyte`` is fitted to.
COMM_STEP: dict[str, Any] = {
    "kind": "step",
    "engine": "torch-ddp",
    "bucket_cap_mb": 25.0,
    "model": CALIBRATION_MLP,
    "algo": "native",
}


def mlp(spec: dict[str, int]) -> torch.nn.Module:
    """The MLP of ``spec``: Linear(in, width), ReLU, (depth - 1) x (Linear(width, width), ReLU),
    Linear(width, out)."""
    import torch  # here, not at the top: the model imports no torch until it reads a module

    layers: list[torch.nn.Module] = [torch.nn.Linear(spec["in"], spec["width"]), torch.nn.ReLU()]
    for _ in range(spec["depth"] - 1):
        layers += [torch.nn.Linear(spec["width"], spec["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(spec["width"], spec["out"]))
    return torch.nn.Sequential(*layers)


def mlp_workload(spec: dict[str, int], name: str) -> ModelProfile:
    """The MLP of ``spec`` as the simulator sees it (FLOPs read on the meta device)."""
    workload = from_module(mlp(spec), (spec["batch"], spec["in"]), name=name)
    return dataclasses.replace(workload, state_bytes_per_param_byte=SGD_BYTES_PER_PARAM_BYTE)


def calibration_configs(*, quick: bool = False) -> list[dict[str, Any]]:
    """What calibration measures (quick: allreduce only among the native collectives)."""
    natives = ("all_reduce",) if quick else _NATIVE_COLLECTIVES
    out: list[dict[str, Any]] = [
        {"kind": "collective", "collective": c, "algo": "native", "bytes": n}
        for c in natives
        for n in NATIVE_SIZES
    ]
    out += [
        {
            "kind": "collective",
            "collective": "all_reduce",
            "algo": "native",
            "bytes": n,
            "dtype": "float16",
        }
        for n in _HALF_ALL_REDUCE_SIZES
    ]
    out += [{"kind": "p2p", "bytes": n} for n in _P2P_SIZES]
    out += [{"kind": k, "bytes": _LOCAL_BYTES} for k in ("reduce", "memory", "cast")]
    out.append({"kind": "compute", "model": CALIBRATION_MLP})
    out.append(dict(COMM_STEP))
    return out


def fit_cluster(
    base: ClusterModel, configs: list[dict[str, Any]], measured_s: list[float]
) -> tuple[ClusterModel, dict[str, LinkFit]]:
    """``base`` with every fitted quantity replaced (module docstring), and the link fits by
    name (``p2p``, ``all_reduce/native``, ...). Pure: the tests feed it synthetic times."""
    if len(configs) != len(measured_s):
        raise ValueError(f"{len(configs)} calibration configs but {len(measured_s)} times")
    by_kind: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for cfg, t in zip(configs, measured_s, strict=True):
        if cfg["kind"] == "collective":
            key = f"{cfg['collective']}/{cfg['algo']}"
            if cfg.get("dtype", "float32") != "float32":
                key = f"{key}@{cfg['dtype']}"  # not a link fit: compression_gbyte_per_s's
        else:
            key = cfg["kind"]
        by_kind.setdefault(key, []).append((cfg, t))

    def one(kind: str) -> float:
        if kind not in by_kind:
            raise ValueError(f"calibration is missing its {kind!r} measurement")
        cfg, t = by_kind[kind][0]
        return float(cfg["bytes"]) / t

    gamma = 1.0 / one("reduce")
    p2p = by_kind.get("p2p", [])
    if not p2p:
        raise ValueError("calibration is missing its point-to-point ('p2p') measurements")
    burst = base.inter_burst_kbyte * 1024
    fits = {
        "p2p": fit_link(
            with_burst(point_to_point, burst),
            [c["bytes"] for c, _ in p2p],
            [t for _, t in p2p],
            max_gbit_per_s=base.inter_gbit_per_s,
        )
    }
    links = []
    for key, rows in by_kind.items():
        if "/" not in key or "@" in key:
            continue
        collective, algo = key.split("/")
        model = native_with_burst(collective, base.world_size, burst)
        fit = fit_link(
            model,
            [c["bytes"] for c, _ in rows],
            [t for _, t in rows],
            gamma_s_per_byte=gamma,
            max_gbit_per_s=base.inter_gbit_per_s,
        )
        overlaps = (collective, algo) in _OVERLAPPED_NATIVE
        if overlaps:
            fit = overlapped(
                fit, model, gamma_s_per_byte=gamma, max_gbit_per_s=base.inter_gbit_per_s
            )
        fits[key] = fit
        links.append(
            CollectiveLink(
                collective=collective,
                algorithm=algo,
                latency_us=fit.alpha_s * 1e6,
                gbit_per_s=fit.gbit_per_s,
                latency_overlaps_transfer=overlaps,
            )
        )
    mem_gbyte = SGD_BYTES_PER_PARAM_BYTE * one("memory") / 1e9
    cluster = dataclasses.replace(
        base,
        inter_latency_us=fits["p2p"].alpha_s * 1e6,
        inter_gbit_per_s=fits["p2p"].gbit_per_s,
        reduce_gbyte_per_s=1e-9 / gamma,
        mem_gbyte_per_s=mem_gbyte,
        collective_links=tuple(links),
    )
    if "compute" in by_kind:
        cfg, step_s = by_kind["compute"][0]
        workload = mlp_workload(cfg["model"], "calibration-mlp")
        optimizer_s = workload.param_bytes * SGD_BYTES_PER_PARAM_BYTE / (mem_gbyte * 1e9)
        # Whatever is not the optimizer's memory traffic is charged to FLOPs (activations,
        # ReLU and the loss are small beside the matrix products here).
        compute_s = max(step_s - optimizer_s, 0.1 * step_s)
        cluster = dataclasses.replace(cluster, flops_per_s=workload.flops / compute_s)
        if "step" in by_kind:
            cfg, step_s = by_kind["step"][0]
            cluster = dataclasses.replace(
                cluster, comm_cpu_us_per_mbyte=fit_comm_cpu_of(cluster, cfg, step_s)
            )
    return cluster, fits


def _comm_step_plan(cfg: dict[str, Any]) -> CommPlan:
    """The simulator's view of a torch DDP step config (DDP caps its first bucket at 1 MB)."""
    return CommPlan(
        algorithm=cfg.get("algo", "native"),
        bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0),
        first_bucket_cap_mb=1.0,
    )


def fit_comm_cpu_of(cluster: ClusterModel, cfg: dict[str, Any], step_s: float) -> float:
    """``comm_cpu_us_per_mbyte`` at which ``cluster`` predicts the measured step ``step_s`` of
    ``cfg`` (a torch DDP step of an MLP), all else fitted already."""
    from commfuse.sim.step import simulate_step

    workload = mlp_workload(cfg["model"], "calibration-mlp")
    plan = _comm_step_plan(cfg)

    def predict(coefficient: float) -> float:
        model = dataclasses.replace(cluster, comm_cpu_us_per_mbyte=coefficient)
        return simulate_step(model, workload, plan).step_s

    return fit_comm_cpu(predict, step_s)


def compression_gbyte_per_s(
    configs: list[dict[str, Any]], measured_s: list[float], cluster: ClusterModel | None = None
) -> float:
    """The fp16 compressor's cost as a rate, GB of fp32 input per second: its measured local
    work (``cast``: finiteness test, divide, cast, copy back) plus, with ``cluster`` (the fitted
    model), what an fp16 allreduce costs beyond an fp32 one of the same bytes (the median
    excess per byte of the ``_HALF_ALL_REDUCE_SIZES`` runs, clamped at 0; an fp16 message is half
    its input's bytes). The simulator charges it before the compressed allreduce."""
    from commfuse.sim.network import collective_time_s

    cast_s_per_byte = None
    excess: list[float] = []
    for cfg, t in zip(configs, measured_s, strict=True):
        if cfg["kind"] == "cast":
            cast_s_per_byte = t / float(cfg["bytes"])
        elif cfg["kind"] == "collective" and cfg.get("dtype") == "float16" and cluster:
            fp32_s = collective_time_s(cfg["collective"], cfg["algo"], cfg["bytes"], cluster)
            excess.append((t - fp32_s) / cfg["bytes"])
    if cast_s_per_byte is None:
        raise ValueError("calibration is missing its 'cast' measurement")
    half_s_per_input_byte = max(0.0, statistics.median(excess)) / 2 if excess else 0.0
    return 1e-9 / (cast_s_per_byte + half_s_per_input_byte)


def describe_fits(fits: dict[str, LinkFit]) -> list[str]:
    """One line per fit: alpha, rate, worst residual (how well the model explains the sizes)."""
    return [
        f"  {name:<22} alpha {fit.alpha_s * 1e6:>8.1f} us  {fit.gbit_per_s:>7.3f} Gbit/s  "
        f"worst residual {fit.max_residual * 100:>5.1f}% over {len(fit.sizes_bytes)} sizes"
        for name, fit in fits.items()
    ]
