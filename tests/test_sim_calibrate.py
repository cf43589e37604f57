"""Calibration of the simulator: the robust alpha-beta fit, per-algorithm links, the token-bucket
burst, the first bucket cap, and ``fit_cluster`` recovering a known cluster from its own times.

Pure Python and fast: the real runs are in test_sim_validate.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from commfuse.collectives import cost as C
from commfuse.sim import ClusterModel, CommPlan, build_step, collective_time_s, simulate_step
from commfuse.sim.calibrate import (
    CALIBRATION_MLP,
    SGD_BYTES_PER_PARAM_BYTE,
    calibration_configs,
    fit_cluster,
    mlp_workload,
)
from commfuse.sim.cluster import CollectiveLink
from commfuse.sim.fit import (
    fit_link,
    native_model,
    native_with_burst,
    point_to_point,
    with_burst,
)
from commfuse.sim.model import Layer, ModelProfile

SIZES = [128 << 10, 512 << 10, 2 << 20, 8 << 20]
LINK = C.LinkCost(alpha_s=400e-6, beta_s_per_byte=8e-9, gamma_s_per_byte=0.5e-9)


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_to_all", "all_gather"])
@pytest.mark.parametrize("burst", [0.0, 256 * 1024.0])
def test_fit_recovers_alpha_and_beta_of_its_own_model(collective: str, burst: float) -> None:
    model = native_with_burst(collective, 4, burst)
    times = [model(n, LINK) for n in SIZES]
    fit = fit_link(model, SIZES, times, gamma_s_per_byte=LINK.gamma_s_per_byte)
    assert math.isclose(fit.alpha_s, LINK.alpha_s, rel_tol=1e-6)
    assert math.isclose(fit.beta_s_per_byte, LINK.beta_s_per_byte, rel_tol=1e-6)
    assert fit.max_residual < 1e-9


def test_one_spoiled_size_does_not_swing_the_fit() -> None:
    """A burst of load from another job triples one of six sizes' median: the Huber weights keep
    beta within 3% and alpha within a factor 2, where plain least squares moves far more."""
    sizes = [64 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 8 << 20]
    model = native_model("all_reduce", 4)
    times = [model(n, LINK) for n in sizes]
    times[2] *= 3.0
    fit = fit_link(model, sizes, times, gamma_s_per_byte=LINK.gamma_s_per_byte)
    assert abs(fit.beta_s_per_byte / LINK.beta_s_per_byte - 1) < 0.03
    assert 0.5 < fit.alpha_s / LINK.alpha_s < 2.0
    assert max(abs(r) for i, r in enumerate(fit.relative_residuals) if i != 2) < 0.1
    assert fit.relative_residuals[2] < -0.5  # the spoiled point stays visibly off the model


def test_fit_clamps_a_negative_intercept_to_zero_latency() -> None:
    # Times that fall below a line through the origin at small sizes (as a token bucket's burst
    # does when the model ignores it): alpha would be negative.
    times = [n * 8e-9 - 1e-3 for n in SIZES]
    fit = fit_link(point_to_point, SIZES, times)
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0


def test_burst_model_explains_what_a_plain_model_cannot() -> None:
    burst = 256 * 1024.0
    truth = with_burst(point_to_point, burst)
    times = [truth(n, LINK) for n in SIZES]
    plain = fit_link(point_to_point, SIZES, times)
    aware = fit_link(truth, SIZES, times)
    assert plain.gbit_per_s > 1.02 * aware.gbit_per_s  # the burst looks like a faster link
    assert math.isclose(aware.gbit_per_s, 1.0, rel_tol=1e-6)


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_link(point_to_point, [1024, 1024], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="> 0 seconds"):
        fit_link(point_to_point, [1024, 4096], [1e-3, -1.0])
    with pytest.raises(ValueError, match="2 sizes but 1"):
        fit_link(point_to_point, [1024, 4096], [1e-3])
    with pytest.raises(ValueError, match="no native model"):
        native_model("reduce_scatter", 4)


def test_a_fitted_collective_link_prices_that_algorithm_only() -> None:
    base = ClusterModel(num_hosts=4, inter_gbit_per_s=1.0, inter_latency_us=100.0)
    own = CollectiveLink(collective="broadcast", algorithm="native", latency_us=700, gbit_per_s=0.5)
    cluster = dataclasses.replace(base, collective_links=(own,))
    link = dataclasses.replace(base.inter_cost(), alpha_s=700e-6, beta_s_per_byte=8.0 / 0.5e9)
    n = 4 << 20
    assert math.isclose(
        collective_time_s("broadcast", "native", n, cluster), C.gloo_broadcast(n, 4, link)
    )
    for collective, algo in (("broadcast", "tree"), ("all_reduce", "native")):
        assert collective_time_s(collective, algo, n, cluster) == collective_time_s(
            collective, algo, n, base
        )
    again = ClusterModel.from_json(cluster.to_json())
    assert again == cluster and again.collective_link("broadcast", "native") == own
    with pytest.raises(ValueError, match="gbit_per_s must be positive"):
        CollectiveLink(collective="broadcast", algorithm="native", latency_us=1, gbit_per_s=0)


def test_burst_credit_is_the_closed_form_minus_the_bucket() -> None:
    plain = ClusterModel(num_hosts=4, inter_gbit_per_s=1.0, inter_latency_us=50.0)
    bursty = dataclasses.replace(plain, inter_burst_kbyte=256.0)
    link = plain.inter_cost()
    credit = 256 * 1024 * link.beta_s_per_byte
    for n in (1 << 20, 16 << 20):
        got = collective_time_s("all_reduce", "ring", n, bursty)
        assert math.isclose(got, C.ring_all_reduce(n, 4, link) - credit, rel_tol=1e-12)
    # Smaller than the bucket: only the latency and reduction terms remain.
    small = 64 << 10
    latency_only = dataclasses.replace(link, beta_s_per_byte=0.0)
    assert math.isclose(
        collective_time_s("all_reduce", "ring", small, bursty),
        C.ring_all_reduce(small, 4, latency_only),
        rel_tol=1e-12,
    )
    with pytest.raises(ValueError, match="inter_burst_kbyte must be >= 0"):
        dataclasses.replace(plain, inter_burst_kbyte=-1.0)


def test_first_bucket_cap_splits_the_last_layers_off() -> None:
    mb = 1 << 20
    layers = tuple(Layer(name=f"l{i}", param_bytes=4 * mb, fwd_flops=1e6) for i in range(3))
    workload = ModelProfile(name="three", layers=layers)
    cluster = ClusterModel(num_hosts=2)

    def buckets(strategy: CommPlan) -> list[int]:
        return [t.nbytes for t in build_step(cluster, workload, strategy) if t.category == "dp"]

    assert buckets(CommPlan(bucket_cap_mb=25)) == [12 * mb]
    assert buckets(CommPlan(bucket_cap_mb=25, first_bucket_cap_mb=1)) == [4 * mb, 8 * mb]
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be >= 0"):
        CommPlan(first_bucket_cap_mb=-1)


def test_fit_cluster_recovers_a_known_cluster_from_its_own_times() -> None:
    """Synthetic measurements made by the simulator from a known cluster: calibration gives the
    cluster back, so a held-out size is predicted exactly."""
    truth = ClusterModel(
        name="truth",
        num_hosts=4,
        inter_gbit_per_s=0.9,
        inter_latency_us=120.0,
        inter_burst_kbyte=256.0,
        reduce_gbyte_per_s=2.0,
        flops_per_s=1.5e10,
        mem_gbyte_per_s=6.0,
        collective_links=(
            CollectiveLink(
                collective="all_reduce",
                algorithm="native",
                latency_us=500,
                gbit_per_s=1.1,
                latency_overlaps_transfer=True,  # as calibration fits gloo's allreduce
            ),
            CollectiveLink(
                collective="broadcast", algorithm="native", latency_us=50, gbit_per_s=0.8
            ),
        ),
    )
    workload = mlp_workload(CALIBRATION_MLP, "calibration-mlp")
    configs = calibration_configs(quick=False)
    times = []
    for cfg in configs:
        kind = cfg["kind"]
        if kind == "collective":
            times.append(collective_time_s(cfg["collective"], "native", cfg["bytes"], truth))
        elif kind == "p2p":
            link = truth.inter_cost()
            times.append(with_burst(point_to_point, 256 * 1024)(cfg["bytes"], link))
        elif kind == "reduce":
            times.append(cfg["bytes"] / 2.0e9)
        elif kind == "memory":
            times.append(SGD_BYTES_PER_PARAM_BYTE * cfg["bytes"] / 6.0e9)
        elif kind == "cast":
            times.append(cfg["bytes"] / 1e9)
        elif kind == "step":  # the communicating step: a CPU cost of 800 us per MB to recover
            strategy = CommPlan(bucket_cap_mb=cfg["bucket_cap_mb"], first_bucket_cap_mb=1.0)
            slowed = dataclasses.replace(truth, comm_cpu_us_per_mbyte=800.0)
            times.append(simulate_step(slowed, workload, strategy).step_s)
        else:
            optimizer = workload.param_bytes * SGD_BYTES_PER_PARAM_BYTE / 6.0e9
            times.append(workload.flops / 1.5e10 + optimizer)
    base = dataclasses.replace(truth, collective_links=(), inter_gbit_per_s=5.0)
    fitted, fits = fit_cluster(base, configs, times)
    assert set(fits) == {"p2p"} | {
        f"{c}/native" for c in ("all_reduce", "broadcast", "all_to_all", "all_gather")
    }
    for name in (
        "inter_gbit_per_s",
        "inter_latency_us",
        "reduce_gbyte_per_s",
        "flops_per_s",
        "mem_gbyte_per_s",
    ):
        assert math.isclose(getattr(fitted, name), getattr(truth, name), rel_tol=1e-6), name
    assert math.isclose(fitted.comm_cpu_us_per_mbyte, 800.0, rel_tol=1e-4)
    for collective, algo in (
        ("all_reduce", "native"),
        ("broadcast", "native"),
        ("all_reduce", "ring"),
    ):
        held_out = 3 << 20
        assert math.isclose(
            collective_time_s(collective, algo, held_out, fitted),
            collective_time_s(collective, algo, held_out, truth),
            rel_tol=1e-6,
        )
    with pytest.raises(ValueError, match="missing its 'reduce'"):
        fit_cluster(base, [c for c in configs if c["kind"] != "reduce"], times[: len(configs) - 1])
