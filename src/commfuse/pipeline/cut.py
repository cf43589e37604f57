"""Cutting a model into pipeline stages at layer boundaries, by hand or balanced from a profile.

A pipeline is as fast as its slowest stage: in the steady state every rank waits for it, so a
cut should make the stages' compute times as equal as layer boundaries allow.

1. ``cut(layers, boundaries)``: stage ``i`` holds layers ``boundaries[i-1]`` up to (not
   including) ``boundaries[i]``; the modules are the model's own (no copy).
2. ``profile_layers``: each layer's forward plus backward time on a sample batch (the median of
   a few runs) and the bytes of its output, which is what a cut after it sends.
3. ``balanced_boundaries``: the linear partition that minimises the largest stage's time
   (an exact dynamic program over cut points, ``O(n^2 k)`` for ``n`` layers and ``k`` stages);
   among the cuts that reach that time, the one that sends the fewest activation bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn


def _layers(model: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model.children()) if isinstance(model, nn.Sequential) else list(model)


def cut(
    model: nn.Sequential | Sequence[nn.Module], boundaries: Sequence[int]
) -> list[nn.Sequential]:
    """The stages of ``model`` cut before each layer index in ``boundaries``.

    Args:
        model: an ``nn.Sequential`` or a list of modules applied one after another.
        boundaries: strictly increasing layer indices in ``1 .. len(layers) - 1``, one per cut;
            ``[]`` gives one stage.

    Returns:
        ``len(boundaries) + 1`` ``nn.Sequential`` stages holding the model's own modules.

    Raises:
        ValueError: a boundary out of range or not strictly increasing.

    Example:
        ```python
        stages = cut(nn.Sequential(*blocks), [2, 5])  # layers 0-1, 2-4, 5-end
        ```
    """
    layers = _layers(model)
    edges = [0, *boundaries, len(layers)]
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError(
            f"boundaries {list(boundaries)} must increase strictly within 1..{len(layers) - 1} "
            f"({len(layers)} layers): each stage needs at least one layer"
        )
    return [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(edges)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """What ``profile_layers`` measured, one entry per layer."""

    times_s: tuple[float, ...]
    """Forward plus backward seconds of each layer on the sample (median of the runs)."""
    output_bytes: tuple[int, ...]
    """Bytes of each layer's output: what a cut after it sends per micro-batch."""


def profile_layers(
    model: nn.Sequential | Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 3
) -> LayerProfile:
    """Time each layer's forward and backward on ``sample`` (module docstring, step 2).

    Raises:
        ValueError: ``repeats`` below 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one run")
    layers = _layers(model)
    runs: list[list[float]] = [[] for _ in layers]
    sizes: list[int] = []
    for _ in range(repeats):
        x = sample
        sizes = []
        for i, layer in enumerate(layers):
            x = x.detach().requires_grad_(x.is_floating_point())
            begin = time.perf_counter()
            y = layer(x)
            y.backward(torch.ones_like(y)) if y.requires_grad else None
            runs[i].append(time.perf_counter() - begin)
            sizes.append(y.numel() * y.element_size())
            x = y
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return LayerProfile(
        times_s=tuple(statistics.median(r) for r in runs), output_bytes=tuple(sizes)
    )


def balanced_boundaries(
    times: Sequence[float], num_stages: int, *, output_bytes: Sequence[int] | None = None
) -> list[int]:
    """The cut into ``num_stages`` stages whose slowest stage is fastest (module docstring).

    Args:
        times: each layer's time (any unit), e.g. ``profile_layers(...).times_s``.
        num_stages: stages to cut into, at most one per layer.
        output_bytes: each layer's output bytes; among the best cuts, the fewest bytes sent.
            None: the first best cut found (earliest boundaries).

    Returns:
        The boundaries for ``cut``.

    Raises:
        ValueError: fewer layers than stages, no stage, a negative time, or ``output_bytes`` of
            another length.

    Example:
        ```python
        profile = profile_layers(model, batch)
        stages = cut(model, balanced_boundaries(profile.times_s, 4, output_bytes=profile.output_bytes))
        ```
    """
    n = len(times)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages (1 to {n} stages)")
    if any(t < 0 for t in times):
        raise ValueError("layer times must not be negative")
    if output_bytes is not None and len(output_bytes) != n:
        raise ValueError(f"output_bytes has {len(output_bytes)} entries for {n} layers")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = _least_largest_stage(prefix, num_stages)
    sent = list(output_bytes) if output_bytes is not None else [0] * n
    # Second pass: fewest bytes among cuts whose every stage stays within the best time.
    limit = best * (1 + 1e-9) + 1e-15
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if cost[k - 1][i] == inf or prefix[j] - prefix[i] > limit:
                    continue
                c = cost[k - 1][i] + (sent[i - 1] if i > 0 else 0)
                if c < cost[k][j]:
                    cost[k][j], choice[k][j] = c, i
    edges, j = [], n
    for k in range(num_stages, 0, -1):
        j = choice[k][j]
        edges.append(j)
    return sorted(edges)[1:]


def _least_largest_stage(prefix: list[float], num_stages: int) -> float:
    """The smallest possible largest stage time (the linear-partition dynamic program)."""
    n = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j))
    return best[num_stages][n]
