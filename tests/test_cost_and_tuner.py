"""Cost models (pure functions) and the tuner's choice: deterministic, sane, the same on all ranks."""

from __future__ import annotations

import math

import pytest

from commfuse.collectives import cost as C
from commfuse.collectives.tuner import (
    Profile,
    calibrate,
    choose,
    predict,
    rank_algorithms,
    set_profile,
)
from commfuse.comm import Communicator

GIG = C.LinkCost.from_link_gbit(1.0, alpha_s=100e-6)


def test_lp_broadcast_is_invariant_to_world_size_and_tree_is_not() -> None:
    n = 16 << 20
    lp = [C.lp_broadcast(n, p, GIG) for p in (2, 4, 8)]
    tree = [C.mst_broadcast(n, p, GIG) for p in (2, 4, 8)]
    assert max(lp) / min(lp) < 1.15  # bandwidth term independent of P (Wang et al.)
    assert tree[-1] / tree[0] == pytest.approx(3.0)  # lg 8 / lg 2
    assert lp[1] < tree[1] / 1.8


def test_best_block_minimises_the_lp_formula() -> None:
    n, p = 16 << 20, 4
    best = C.lp_best_block_bytes(n, p, GIG)
    assert best == pytest.approx(
        math.sqrt(n * GIG.alpha_s / ((p - 1) * GIG.beta_s_per_byte)), abs=1
    )
    t_best = C.lp_broadcast(n, p, GIG, best)
    assert all(
        C.lp_broadcast(n, p, GIG, b) >= t_best * 0.99
        for b in (best // 4, best // 2, best * 2, best * 4)
    )


def test_ring_allreduce_approaches_the_lower_bound_for_large_messages() -> None:
    n, p = 256 << 20, 8
    bound = C.allreduce_lower_bound(n, p, 1 / GIG.beta_s_per_byte)
    ring = C.ring_allreduce(n, p, GIG)
    assert bound < ring < 1.01 * bound + n * GIG.gamma_s_per_byte


def test_world_of_one_costs_nothing() -> None:
    for fn in (
        C.ring_allreduce,
        C.rabenseifner_allreduce,
        C.ring_allgather,
        C.pairwise_all_to_all,
        C.lp_broadcast,
    ):
        assert fn(1 << 20, 1, GIG) == 0.0


def test_tuner_prefers_latency_algorithms_for_small_and_bandwidth_ones_for_large() -> None:
    profile = Profile(intra=GIG, inter=GIG, num_hosts=8, ranks_per_host=1)
    small = [name for _, name in rank_algorithms("allreduce", 4096, 8, profile)]
    large = [name for _, name in rank_algorithms("allreduce", 64 << 20, 8, profile)]
    assert small.index("doubling") < small.index("ring")
    assert large.index("ring") < large.index("doubling")
    assert predict("broadcast", "pipeline", 16 << 20, 8, profile) < predict(
        "broadcast", "tree", 16 << 20, 8, profile
    )
    assert predict("allreduce", "no-such-algo", 1, 8, profile) == math.inf


def test_profile_round_trips_through_json() -> None:
    profile = Profile(intra=GIG, inter=C.LinkCost(alpha_s=1e-3), num_hosts=2, ranks_per_host=4)
    assert Profile.from_json(profile.to_json()) == profile


def calibrate_and_choose() -> tuple[str, list[str]]:
    comm = Communicator()
    profile = calibrate(comm)
    set_profile(comm, profile)
    return profile.to_json(), [
        choose(comm, "allreduce", size) for size in (4096, 1 << 20, 64 << 20)
    ]


def test_calibration_gives_every_rank_the_same_profile_and_choices(pool) -> None:
    results = pool(3).run(calibrate_and_choose, timeout_s=120)
    assert len({r[0] for r in results}) == 1 and len({tuple(r[1]) for r in results}) == 1
    profile = Profile.from_json(results[0][0])
    assert (
        profile.intra.alpha_s > 0
        and profile.intra.beta_s_per_byte > 0
        and profile.intra.gamma_s_per_byte > 0
    )
