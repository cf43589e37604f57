"""The one rounds-and-ratios driver of every benchmark that times several variants: ``bench *``,
``compare`` and ``compare --fault-tolerant`` (``Schedule``, ``run_rounds``, ``summarize``).

On a shared machine the order in which variants run biases them (cold caches first, a machine
other jobs have filled last, a neighbour's allocator and thermal state). Timing in rounds, each
in a different order, spreads those effects over every variant alike:

1. **Position balance.** Rounds come in pairs, an order and its reverse (A B C D, D C B A), so
   after every two rounds each variant's mean position is the middle one.
2. **Carry-over balance.** The design is Williams's (E. J. Williams, "Experimental designs
   balanced for the estimation of residual effects of treatments", 1949): over a whole design
   each variant runs right after every other one equally often.
3. **Seeded shuffle.** ``seed`` relabels the variants and shuffles the pairs with a private
   ``random.Random(seed)``, so every rank computes the same orders; both balances survive it.
4. **Paired ratios.** A variant's ratio to the baseline is the median over rounds of
   ``sample / baseline sample`` of the same round.
5. **The A/A control.** With ``control=True`` the baseline is timed twice (A and A'); a ratio
   within the control's floor of 1 (``|ln r| <= |ln A'/A|``) is a tie.
6. **The ratio's confidence interval.** The sign test's distribution-free interval of the
   median of the per-round ratios (W. J. Conover, "Practical Nonparametric Statistics", section
   3.2); a variant differs only where it excludes 1 *and* the ratio lies outside the floor.

Usage::

    schedule = Schedule(("native", "ring"), rounds=10, control=True)
    # run(name, round) -> sample; A' runs the baseline's code: schedule.code_of(name)
    samples = run_rounds(schedule, run)
    summary = summarize(samples, baseline=schedule.baseline, control=schedule.control_variant)

Design notes: ``docs/benchmarking.md``, "The scheduler's balances, ratios and intervals".
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = [
    "Schedule",
    "Summary",
    "balanced_orders",
    "control_line",
    "control_name",
    "median_interval",
    "run_rounds",
    "summarize",
    "tie_mark",
    "williams_square",
]


def control_name(baseline: str) -> str:
    """The name of the baseline's second copy in an A/A control (``A`` -> ``A'``)."""
    return f"{baseline}'"


def williams_square(n: int) -> list[tuple[int, ...]]:
    """Williams's design for ``n`` variants: ``n`` orders for even ``n`` (and ``n = 1``), ``2n``
    for odd ``n`` (the square and its mirror image). Each block of ``n`` rows is a Latin square
    (every variant once in every position) and over all rows every variant immediately follows
    every other equally often.

    Row 0 is ``0, 1, n-1, 2, n-2, ...``; row ``r`` adds ``r`` to each entry, modulo ``n``.
    """
    if n < 1:
        raise ValueError(f"a schedule needs at least one variant, got {n}")
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    square = [tuple((v + r) % n for v in first) for r in range(n)]
    if n % 2 == 1 and n > 1:
        square += [row[::-1] for row in square]
    return square


def _paired_rows(n: int) -> list[tuple[int, ...]]:
    """Williams's design with every row followed by its reverse.

    For even ``n`` row ``r + n/2`` of the square is the reverse of row ``r``, so pairing them
    keeps all ``n`` rows (a Latin square); for odd ``n`` the design is the square and its
    mirror, paired row by row."""
    square = williams_square(n)
    if n == 1:
        return square
    half = len(square) // 2
    pairs: list[tuple[int, ...]] = []
    for r in range(half):
        pairs += [square[r], square[r][::-1]]
    return pairs


def balanced_orders(
    num_variants: int, num_rounds: int, *, seed: int | None = 0
) -> list[tuple[int, ...]]:
    """The order of each round: ``num_rounds`` permutations of ``range(num_variants)``.

    Rounds come in pairs, an order and its reverse, so after every even number of rounds each
    variant's mean position is the middle one (A B C D, D C B A, ...). A whole design (``n``
    rounds for an even number ``n`` of variants, ``2n`` for odd ``n``) puts every variant in
    every position equally often and after every other variant equally often. ``seed=None``
    keeps the given order in round 0 (and its reverse in round 1); a seed relabels the variants
    and shuffles the pairs of each design.
    """
    if num_rounds < 1:
        raise ValueError(f"a schedule needs at least one round, got {num_rounds}")
    design = _paired_rows(num_variants)
    label = [0] * num_variants
    for position, v in enumerate(design[0]):
        label[v] = position  # round 0 becomes 0, 1, ..., n-1
    rng = None if seed is None else random.Random(seed)
    if rng is not None:
        rng.shuffle(label)
    pairs = [design[i : i + 2] for i in range(0, len(design), 2)]
    orders: list[tuple[int, ...]] = []
    while len(orders) < num_rounds:
        # Shuffle whole pairs, never split one: the reverse keeps following its order.
        for pair in pairs if rng is None else rng.sample(pairs, len(pairs)):
            orders += [tuple(label[v] for v in row) for row in pair]
    return orders[:num_rounds]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Variants timed side by side for ``rounds`` rounds, in balanced orders.

    ``variants`` are names; the baseline of every ratio is ``baseline`` (default: the first).
    With ``control`` the baseline's copy ``control_name(baseline)`` joins the variants; it runs
    the baseline's code (``code_of``)."""

    variants: tuple[str, ...]
    rounds: int
    baseline: str = ""
    control: bool = False
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not self.variants:
            raise ValueError("a schedule needs at least one variant")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"a variant is named twice: {', '.join(self.variants)}")
        if not self.baseline:
            object.__setattr__(self, "baseline", self.variants[0])
        if self.baseline not in self.variants:
            raise ValueError(
                f"baseline {self.baseline!r} is not a variant: {', '.join(self.variants)}"
            )
        if self.control and control_name(self.baseline) in self.variants:
            raise ValueError(f"{control_name(self.baseline)!r} is the control's name")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every timed variant: ``variants``, then the control's copy if there is one."""
        extra = (control_name(self.baseline),) if self.control else ()
        return (*self.variants, *extra)

    @property
    def control_variant(self) -> str | None:
        """The name of the baseline's copy, or None without a control."""
        return control_name(self.baseline) if self.control else None

    def code_of(self, name: str) -> str:
        """The variant whose code ``name`` runs: itself, or the baseline for its copy."""
        return self.baseline if name == self.control_variant else name

    def orders(self) -> list[tuple[str, ...]]:
        """The names in the order of each round."""
        names = self.names
        return [
            tuple(names[i] for i in order)
            for order in balanced_orders(len(names), self.rounds, seed=self.seed)
        ]


Sample = TypeVar("Sample")


def run_rounds(schedule: Schedule, run: Callable[[str, int], Sample]) -> dict[str, list[Sample]]:
    """``run(name, round)`` for every name of every round in the schedule's orders; returns
    each name's samples (a time, or a whole run's record), indexed by round
    (``samples[name][r]`` is round ``r``'s)."""
    samples: dict[str, list[Sample]] = {name: [] for name in schedule.names}
    for round_, order in enumerate(schedule.orders()):
        for name in order:
            samples[name].append(run(name, round_))
    return samples


@dataclasses.dataclass(frozen=True)
class Summary:
    """Medians and paired ratios of one schedule's samples."""

    baseline: str
    medians: dict[str, float]
    """Median sample of each variant."""
    ratios: dict[str, float]
    """Median over rounds of ``sample / baseline's sample`` of the same round, or the ratio of
    the medians (``summarize(paired=False)``); 1 for the baseline itself."""
    ratio_ranges: dict[str, tuple[float, float]]
    """The smallest and largest of those per-round ratios."""
    ratio_intervals: dict[str, tuple[float, float]]
    """The distribution-free interval (at least 95%) of the median per-round ratio
    (``median_interval``); the whole range up to eight rounds."""
    control: str | None
    """The control's name (the baseline's copy), or None."""

    @property
    def control_ratio(self) -> float | None:
        """A'/A: the control's ratio to the baseline (None without a control)."""
        return None if self.control is None else self.ratios[self.control]

    @property
    def noise_floor(self) -> float | None:
        """``|A'/A - 1|``: how far from 1 identical code landed (None without a control)."""
        ratio = self.control_ratio
        return None if ratio is None else abs(ratio - 1.0)

    def is_tie(self, ratio: float, *, variant: str | None = None) -> bool | None:
        """Whether ``ratio`` lies as close to 1 as the control's, ``|ln ratio| <= |ln A'/A|``,
        or, given the ``variant`` whose ratio to the baseline it is (or the inverse of it),
        whether that variant's interval (``ratio_intervals``) holds 1: either way this job
        cannot tell the two apart. Symmetric, so a ratio of times and its inverse (a speed-up)
        get the same answer. None without a control."""
        control = self.control_ratio
        if control is None:
            return None
        if variant is not None and variant != self.baseline:
            low, high = self.ratio_intervals[variant]
            if low <= 1.0 <= high:
                return True
        if ratio <= 0 or control <= 0 or math.isinf(ratio):
            return False
        # The slack absorbs rounding: the control's own ratio, inverted, is a tie.
        return abs(math.log(ratio)) <= abs(math.log(control)) + 1e-12

    def as_dict(self) -> dict[str, object]:
        """The control's figures for a record: ``control_ratio``, ``noise_floor`` (None without
        a control)."""
        return {"control_ratio": self.control_ratio, "noise_floor": self.noise_floor}


def summarize(
    samples: Mapping[str, Sequence[float]],
    *,
    baseline: str,
    control: str | None = None,
    paired: bool = True,
) -> Summary:
    """Medians, ratios to ``baseline`` and the control of per-round ``samples`` (every variant
    has one sample per round, in round order). ``paired``: a ratio is the median of the
    per-round ratios (robust to drift between rounds); else the ratio of the medians (what
    nccl-tests style tables print beside their median times). The ranges are per round in both."""
    if baseline not in samples:
        raise ValueError(f"no samples of the baseline {baseline!r}")
    if control is not None and control not in samples:
        raise ValueError(f"no samples of the control {control!r}")
    base = samples[baseline]
    base_median = statistics.median(base) if base else 0.0
    medians: dict[str, float] = {}
    ratios: dict[str, float] = {}
    ranges: dict[str, tuple[float, float]] = {}
    intervals: dict[str, tuple[float, float]] = {}
    for name, values in samples.items():
        if len(values) != len(base) or not values:
            raise ValueError(
                f"{name!r} has {len(values)} samples and {baseline!r} {len(base)}: "
                "every variant needs one per round"
            )
        medians[name] = statistics.median(values)
        per_round = [v / b if b else float("inf") for v, b in zip(values, base, strict=True)]
        if paired:
            ratios[name] = statistics.median(per_round)
        else:
            ratios[name] = medians[name] / base_median if base_median else float("inf")
        ranges[name] = (min(per_round), max(per_round))
        intervals[name] = median_interval(per_round)
    return Summary(
        baseline=baseline,
        medians=medians,
        ratios=ratios,
        ratio_ranges=ranges,
        ratio_intervals=intervals,
        control=control,
    )


def median_interval(values: Sequence[float], coverage: float = 0.95) -> tuple[float, float]:
    """The distribution-free confidence interval of the median of ``values`` (at least
    ``coverage``): order statistics ``k`` and ``n + 1 - k`` (1-based) of the sorted values, ``k``
    the largest with ``P(Binomial(n, 1/2) < k) <= (1 - coverage) / 2``; the whole range where
    no ``k`` qualifies (fewer than six values at 95%); up to eight values ``k`` is 1."""
    if not values:
        raise ValueError("the median of no values has no interval")
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1.0 - coverage) / 2.0, 1, 0.0
    # below = P(Binomial(n, 1/2) <= k - 1), grown one term at a time.
    while k < (n + 1) // 2:
        below += math.comb(n, k - 1) / 2.0**n
        if below + math.comb(n, k) / 2.0**n > tail:
            break
        k += 1
    return ordered[k - 1], ordered[n - k]


def tie_mark(summary: Summary, ratio: float | None) -> str:
    """``" (tie)"`` where ``ratio`` is within the control's noise floor, else ``""``: what a
    table appends to a ratio."""
    return " (tie)" if ratio is not None and summary.is_tie(ratio) else ""


def control_line(summary: Summary, unit: str = "time") -> str | None:
    """One line for under a table: the control's ratio and what it means; None without one."""
    if summary.control is None or summary.control_ratio is None:
        return None
    low, high = summary.ratio_ranges[summary.control]
    floor = summary.noise_floor or 0.0
    return (
        f"A/A control: {summary.control} / {summary.baseline} {unit} = "
        f"{summary.control_ratio:.3f} (rounds {low:.3f}-{high:.3f}): noise floor "
        f"{100 * floor:.1f}%; ratios within it of 1, or whose 95% interval over rounds holds 1, "
        "are ties"
    )
