"""The CPU cost of communication (sim/cpu_share.py), the rate cap of the link fit, and the linear
pipeline priced at the block the code cuts (sim/lp.py).

Pure Python and fast: the real runs are in test_sim_validate.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from commfuse.collectives import cost as C
from commfuse.collectives.pipeline import block_ranges
from commfuse.sim import PRESETS, ClusterModel, CommPlan, Demand, simulate, simulate_step
from commfuse.sim.calibrate import COMM_STEP, fit_comm_cpu_of, mlp_workload
from commfuse.sim.cpu_share import fit_comm_cpu, simulate_shared_cpu
from commfuse.sim.fit import fit_link, native_model
from commfuse.sim.network import collective_time_s, pipeline_block_bytes
from commfuse.sim.program import Task

MB = 1 << 20


def _overlapped(compute_s: float, comm_s: float, nbytes: int, world: int = 2) -> list[Task]:
    """A collective of ``nbytes`` lasting ``comm_s`` and a compute task of ``compute_s`` that
    both start at 0, then a compute task after both (never overlapped)."""
    return [
        Task(
            name="bucket",
            stream="dp",
            category="dp",
            deps=[],
            demand=Demand(latency_s=0.0, busy_s={"nic": comm_s}),
            nbytes=nbytes,
        ),
        Task(
            name="backward",
            stream="compute",
            category="compute",
            deps=[],
            compute_s=np.full(world, compute_s),
        ),
        Task(
            name="optimizer",
            stream="compute",
            category="compute",
            deps=[0, 1],
            compute_s=np.full(world, 0.01),
        ),
    ]


def test_overlapped_compute_is_slowed_by_the_coefficient() -> None:
    compute, comm, nbytes, coefficient = 0.02, 0.05, 4 * 10**6, 2000.0
    tasks = _overlapped(compute, comm, nbytes)
    free = simulate(tasks, 2)
    assert math.isclose(float(np.max(free.ends_s[1])), compute)
    timeline = simulate_shared_cpu(tasks, 2, coefficient)
    # The collective's CPU cost c S spreads over its (longer) duration D + e; compute runs under
    # it all the way and is longer by e = c S (compute + e) / (D + e), and so is the collective:
    # e^2 + (D - c S) e - c S compute = 0.
    cpu = coefficient * 1e-6 * nbytes / 1e6
    e = (-(comm - cpu) + math.sqrt((comm - cpu) ** 2 + 4 * cpu * compute)) / 2
    assert math.isclose(float(np.max(timeline.ends_s[1])), compute + e, rel_tol=1e-6)
    assert math.isclose(float(timeline.ends_s[0]), comm + e, rel_tol=1e-6)
    # The optimizer after both runs at full speed.
    assert math.isclose(float(np.max(timeline.ends_s[2])), comm + e + 0.01, rel_tol=1e-6)
    # Zero: exactly the free-overlap engine.
    same = simulate_shared_cpu(tasks, 2, 0.0)
    assert [float(np.max(e)) for e in same.ends_s] == [float(np.max(e)) for e in free.ends_s]


def test_compute_longer_than_the_collective_pays_its_whole_cpu_cost() -> None:
    compute, comm, nbytes, coefficient = 0.08, 0.05, 10**6, 3000.0
    timeline = simulate_shared_cpu(_overlapped(compute, comm, nbytes), 2, coefficient)
    whole = coefficient * 1e-6 * nbytes / 1e6
    assert math.isclose(float(np.max(timeline.ends_s[1])), compute + whole, rel_tol=1e-6)


def _calibration_step(cluster: ClusterModel) -> float:
    workload = mlp_workload(COMM_STEP["model"], "calibration-mlp")
    strategy = CommPlan(bucket_cap_mb=COMM_STEP["bucket_cap_mb"], first_bucket_cap_mb=1.0)
    return simulate_step(cluster, workload, strategy).step_s


@pytest.mark.parametrize("truth", [500.0, 2500.0])
def test_fit_recovers_a_known_coefficient_from_a_synthetic_step(truth: float) -> None:
    base = dataclasses.replace(PRESETS["netlab-1gbit"], flops_per_s=1e10)
    measured = _calibration_step(dataclasses.replace(base, comm_cpu_us_per_mbyte=truth))
    assert measured > _calibration_step(base)  # the coefficient matters for this step
    fitted = fit_comm_cpu_of(base, COMM_STEP, measured)
    assert math.isclose(fitted, truth, rel_tol=1e-4)
    # A step no slower than free overlap: no CPU cost.
    assert fit_comm_cpu_of(base, COMM_STEP, _calibration_step(base) * 0.9) == 0.0


def test_fit_refuses_what_the_model_cannot_explain() -> None:
    with pytest.raises(ValueError, match="does not overlap its communication"):
        fit_comm_cpu(lambda c: 1.0 + 1e-9 * c, 2.0)
    with pytest.raises(ValueError, match="measured step must be > 0"):
        fit_comm_cpu(lambda c: 1.0, 0.0)


def test_presets_keep_zero_and_json_round_trips_it() -> None:
    for name, cluster in PRESETS.items():
        assert cluster.comm_cpu_us_per_mbyte == 0.0, name
    fitted = dataclasses.replace(PRESETS["netlab-1gbit"], comm_cpu_us_per_mbyte=1234.5)
    again = ClusterModel.from_json(fitted.to_json())
    assert again.comm_cpu_us_per_mbyte == 1234.5
    assert "comm_cpu_us_per_mbyte" in json.loads(fitted.to_json())
    with pytest.raises(ValueError, match="comm_cpu_us_per_mbyte must be >= 0"):
        ClusterModel(comm_cpu_us_per_mbyte=-1.0)


def test_link_fit_is_capped_at_the_shaped_rate() -> None:
    model = native_model("all_reduce", 4)
    sizes = [128 << 10, 512 << 10, 2 << 20, 8 << 20]
    fast = C.LinkCost(alpha_s=1e-3, beta_s_per_byte=8.0 / 1.2e9)  # 1.2 Gbit/s: above the cap
    times = [model(n, fast) for n in sizes]
    g = fast.gamma_s_per_byte
    capped = fit_link(model, sizes, times, gamma_s_per_byte=g, max_gbit_per_s=1.0)
    assert math.isclose(capped.gbit_per_s, 1.0)
    # The slower rate already explains more of each time: alpha shrinks to fit what is left.
    assert 0 <= capped.alpha_s < fast.alpha_s
    free = fit_link(
        model, sizes, times, gamma_s_per_byte=g, max_gbit_per_s=2.0
    )  # cap not binding: exact fit
    assert math.isclose(free.gbit_per_s, 1.2, rel_tol=1e-6)
    with pytest.raises(ValueError, match="max_gbit_per_s must be > 0"):
        fit_link(model, sizes, times, gamma_s_per_byte=g, max_gbit_per_s=0.0)


@pytest.mark.parametrize("collective", ["broadcast", "all_reduce"])
@pytest.mark.parametrize("nbytes", [4 * MB, 16 * MB])
def test_pipeline_is_priced_at_the_block_the_code_cuts(collective: str, nbytes: int) -> None:
    cluster = dataclasses.replace(PRESETS["netlab-1gbit"], inter_gbit_per_s=1.0)
    p = cluster.world_size
    depth = 2 * (p - 1) if collective == "all_reduce" else p - 1
    lo, hi = block_ranges(torch.empty(nbytes // 4), None, depth, 1000.0)[0]
    assert pipeline_block_bytes(collective, nbytes, cluster) == (hi - lo) * 4
    # Wire-bound here (0.5 ms per block under 2-4 ms of wire per block): the busiest link's
    # bytes (n, or 2n for the allreduce's two streams on one link, less the token bucket's
    # 256 KiB that pass at once) set the time, plus the fill.
    link = cluster.inter_cost()
    on_link = (2 if collective == "all_reduce" else 1) * nbytes - 256 * 1024
    wire = on_link * link.beta_s_per_byte
    t = collective_time_s(collective, "pipeline", nbytes, cluster)
    assert wire < t < wire * 1.15
    # The textbook synchronous schedule (alpha then the block, every step) is slower.
    block = (hi - lo) * 4
    textbook = (C.lp_all_reduce_one_link if collective == "all_reduce" else C.lp_broadcast)(
        nbytes, p, link, block
    )
    assert t < textbook
