"""Timed trials at first use (``collectives/trial.py``): the decision rule, and on real ranks
that every call of a trial is correct, each candidate runs its share of calls, and every rank
settles on the same algorithm."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.collectives import all_reduce, reduce_scatter
from commfuse.collectives.profile import Profile
from commfuse.collectives.registry import label
from commfuse.collectives.trial import (
    TRIAL_MIN_GAIN,
    decide,
    exploring,
    outcomes,
    pick_candidates,
)
from commfuse.collectives.tuner import choose
from commfuse.comm import CommConfig, Communicator
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

KB = 1 << 10


def test_native_stays_unless_another_is_clearly_faster() -> None:
    candidates = ("native", "doubling", "pipeline")
    assert decide(candidates, (1.0, 0.5, 0.9)) == "doubling"
    # just inside the margin: native
    assert decide(candidates, (1.0, 1.0 / (1.0 + TRIAL_MIN_GAIN) + 1e-9, 2.0)) == "native"
    assert decide(candidates, (1.0, 2.0, 0.7)) == "pipeline"
    assert decide(("native",), (1.0,)) == "native"
    # equal others: the model's favourite (listed first)
    assert decide(candidates, (1.0, 0.4, 0.4)) == "doubling"


def test_candidates_are_native_and_the_models_two_fastest_that_fit() -> None:
    ranked = [(1.0, "doubling"), (2.0, "native"), (math.inf, "hierarchical"), (3.0, "ring")]
    assert pick_candidates(ranked) == ("native", "doubling", "ring")
    assert pick_candidates([(1.0, "native"), (math.inf, "hierarchical")]) == ("native",)


def test_trial_calls_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="tuner_trial_calls"):
        CommConfig(tuner_trial_calls=-1)
    with pytest.raises(ValueError, match="tuner_trial_calls"):
        CommConfig(tuner_trial_calls=True)


ROUNDS = 2
AFTER = 3


def _trial_on_rank(async_op: bool) -> dict[str, Any]:
    config = CommConfig(tuner_trial_calls=ROUNDS, link_mbit=1000.0, ranks_per_host=1)
    comm = Communicator(config=config)
    world, rank = comm.world_size, comm.rank
    n = 1024  # 4 KB of float32
    wrong = 0
    calls = 0
    while exploring(comm, "all_reduce", 4 * n) and calls < 100:
        x = torch.full((n,), float(rank + 1))
        handle = all_reduce(comm, x, "sum", algo="auto", async_op=async_op)
        if handle is not None:
            handle.wait()
        wrong += int((x != world * (world + 1) / 2).sum())
        calls += 1
    trial_handed = {k: v.handed_bytes for k, v in comm.stats.by_kind.items()}
    for _ in range(AFTER):
        x = torch.full((n,), float(rank + 1))
        all_reduce(comm, x, "sum", algo="auto")
        wrong += int((x != world * (world + 1) / 2).sum())
    # a second collective and size has a trial of its own
    out = torch.empty(n // world)
    for _ in range(10):
        reduce_scatter(comm, out, torch.full((n,), float(rank)))
        if not exploring(comm, "reduce_scatter", 4 * n):
            break
    decided = [dataclasses.astuple(o) for o in outcomes(comm)]
    return {
        "calls": calls,
        "wrong": wrong,
        "trial_handed": trial_handed,
        "after_handed": {k: v.handed_bytes for k, v in comm.stats.by_kind.items()},
        "outcomes": decided,
        "choice": choose(comm, "all_reduce", 4 * n),
        "rs_sum_ok": bool((out == sum(range(world))).all()),
    }


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_trial_runs_each_candidate_its_share_then_every_rank_keeps_the_same(
    pool: PoolFn, async_op: bool
) -> None:
    results = pool(4).run(_trial_on_rank, async_op, timeout_s=120)
    first: dict[str, Any] = results[0]
    # the same decisions, from the same reduced medians, on every rank
    assert all(r["outcomes"] == first["outcomes"] for r in results)
    assert all(r["wrong"] == 0 and r["rs_sum_ok"] for r in results)
    collective, nbytes, candidates, medians, chosen = first["outcomes"][0]
    assert (collective, nbytes) == ("all_reduce", 4 * KB)
    assert candidates[0] == "native" and len(candidates) == 3
    assert chosen == decide(candidates, medians) == first["choice"]
    assert all(m > 0 for m in medians)
    # one untimed and ROUNDS timed calls per candidate, then the decision stands
    assert first["calls"] == len(candidates) * (1 + ROUNDS)
    for name in candidates[1:]:
        handed = first["trial_handed"].get(label("all_reduce", name), 0)
        assert handed == (1 + ROUNDS) * 4 * KB
        after = first["after_handed"].get(label("all_reduce", name), 0)
        assert after == handed + (AFTER * 4 * KB if name == chosen else 0)
    assert [o[0] for o in first["outcomes"]] == ["all_reduce", "reduce_scatter"]


def _trial_with_profile(path: str) -> dict[str, Any]:
    """Two jobs in a row on the same layout and profile file: the second one runs no trial."""
    config = CommConfig(
        tuner_trial_calls=ROUNDS, tuner_profile_path=path, link_mbit=1000.0, ranks_per_host=2
    )
    n = 1024
    world = 0
    seen: list[dict[str, Any]] = []
    for _job in range(2):
        comm = Communicator(config=config)
        world, rank = comm.world_size, comm.rank
        calls = 0
        while exploring(comm, "all_reduce", 4 * n) and calls < 100:
            x = torch.full((n,), float(rank + 1))
            all_reduce(comm, x, "sum", algo="auto")
            assert bool((x == world * (world + 1) / 2).all())
            calls += 1
        x = torch.full((n,), float(rank + 1))
        all_reduce(comm, x, "sum", algo="auto")
        assert bool((x == world * (world + 1) / 2).all())
        seen.append(
            {
                "calls": calls,
                "outcomes": [o.chosen for o in outcomes(comm)],
                "choice": choose(comm, "all_reduce", 4 * n),
                "handed": {k: v.handed_bytes for k, v in comm.stats.by_kind.items()},
            }
        )
        comm.barrier()  # the first job's writers are done before the second job reads
    return {"jobs": seen}


def test_a_trials_decision_is_kept_in_the_profile_and_the_next_job_runs_none(
    pool: PoolFn, tmp_path: Path
) -> None:
    path = tmp_path / "profile.json"  # missing: with trials on, the first job creates it
    results = pool(4).run(_trial_with_profile, str(path), timeout_s=120)
    first_job, second_job = (results[0]["jobs"][i] for i in (0, 1))
    chosen = first_job["outcomes"][0]
    assert first_job["calls"] > 0 and first_job["choice"] == chosen
    # the file holds the decision, for this layout
    profile = Profile.from_json(path.read_text())
    assert (profile.num_hosts, profile.ranks_per_host) == (2, 2)
    assert profile.trial_choices == {"all_reduce": {4 * KB: chosen}}
    # the second job: no trial, no call of any other candidate, the same algorithm
    for result in results:
        job = result["jobs"][1]
        assert job["calls"] == 0 and job["outcomes"] == [] and job["choice"] == chosen
        # gloo's own collective is counted under the collective's name, ours per algorithm
        kind = "all_reduce" if chosen == "native" else label("all_reduce", chosen)
        assert job["handed"] == {kind: 4 * KB}
    assert second_job["choice"] == chosen


def test_a_profile_without_trial_choices_still_loads() -> None:
    profile = Profile.default(4, link_mbit=1000.0, ranks_per_host=2)
    data = json.loads(profile.to_json())
    del data["trial_choices"]
    assert Profile.from_json(json.dumps(data)) == profile
    with pytest.raises(ValueError, match="allreduce"):
        Profile.from_json(json.dumps({**data, "trial_choices": {"allreduce": {"4": "ring"}}}))
