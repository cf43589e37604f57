"""Cutting a model into stages: at given layer boundaries, and balanced from per-layer times
against brute force over every cut."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from commfuse.pipeline.cut import balanced_boundaries, cut, profile_layers


def test_cut_keeps_the_models_own_layers_in_order() -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    stages = cut(nn.Sequential(*layers), [2, 5])
    assert [len(s) for s in stages] == [2, 3, 1]
    assert [m for s in stages for m in s] == layers  # the same objects: no copy
    x = torch.randn(4, 2)
    whole = nn.Sequential(*layers)(x)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, whole)
    assert [len(s) for s in cut(layers, [])] == [6]


@pytest.mark.parametrize("bad", [[0], [6], [3, 3], [4, 2], [-1]])
def test_cut_refuses_empty_stages(bad: list[int]) -> None:
    with pytest.raises(ValueError, match=r"must increase strictly within 1\.\.5 \(6 layers\)"):
        cut([nn.Linear(1, 1) for _ in range(6)], bad)


def brute_force(times: list[float], k: int, sent: list[int]) -> tuple[float, int]:
    """The least (largest stage time, bytes sent) over every cut."""
    best: tuple[float, int] | None = None
    for edges in itertools.combinations(range(1, len(times)), k - 1):
        bounds = [0, *edges, len(times)]
        largest = max(sum(times[a:b]) for a, b in itertools.pairwise(bounds))
        cost = (largest, sum(sent[e - 1] for e in edges))
        best = cost if best is None or cost < best else best
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cut_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    times = [float(rng.randint(0, 9)) for _ in range(n)]  # integers: sums compare exactly
    sent = [rng.randint(1, 100) for _ in range(n)]
    edges = balanced_boundaries(times, k, output_bytes=sent)
    assert len(edges) == k - 1
    bounds = [0, *edges, n]
    largest = max(sum(times[a:b]) for a, b in itertools.pairwise(bounds))
    assert (largest, sum(sent[e - 1] for e in edges)) == brute_force(times, k, sent)
    plain = balanced_boundaries(times, k)
    assert max(sum(times[a:b]) for a, b in itertools.pairwise([0, *plain, n])) == largest


def test_balanced_cut_examples() -> None:
    assert balanced_boundaries([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [1]
    # both [1] and [2] give 2 + 2; the smaller activation is after layer 2
    assert balanced_boundaries([1, 1, 1, 1], 2, output_bytes=[1, 9, 1, 1]) == [2]
    assert balanced_boundaries([1, 1, 1, 1], 2, output_bytes=[9, 1, 1, 1]) == [2]
    assert balanced_boundaries([2, 1, 1, 2], 2, output_bytes=[1, 1, 9, 1]) == [2]


@pytest.mark.parametrize(
    ("times", "k", "message"),
    [([1.0], 2, r"cannot cut 1 layers into 2 stages"), ([1.0, -1.0], 1, "negative")],
)
def test_balanced_cut_refuses(times: list[float], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_boundaries(times, k)


def test_profile_counts_each_layers_output_bytes() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    profile = profile_layers(model, torch.randn(5, 4, dtype=torch.float64), repeats=2)
    assert profile.output_bytes == (5 * 8 * 8, 5 * 8 * 8, 5 * 2 * 8)
    assert len(profile.times_s) == 3 and all(t >= 0 for t in profile.times_s)
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradient
    edges = balanced_boundaries(profile.times_s, 2, output_bytes=profile.output_bytes)
    assert len(cut(model, edges)) == 2
