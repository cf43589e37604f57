"""The balanced scheduler: position and carry-over balance, seeding, paired ratios, the control."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from commfuse.bench.schedule import (
    Schedule,
    balanced_orders,
    control_line,
    control_name,
    median_interval,
    run_rounds,
    summarize,
    tie_mark,
    williams_square,
)


def position_counts(orders: list[tuple[int, ...]], n: int) -> list[list[int]]:
    """counts[v][p]: rounds in which variant v ran in position p."""
    counts = [[0] * n for _ in range(n)]
    for order in orders:
        for position, v in enumerate(order):
            counts[v][position] += 1
    return counts


@pytest.mark.parametrize("n", range(1, 9))
def test_williams_square_is_latin_in_every_block_and_balanced_for_carry_over(n: int) -> None:
    square = williams_square(n)
    assert len(square) == (2 * n if n % 2 and n > 1 else n)
    for start in range(0, len(square), n):
        block = square[start : start + n]
        assert all(sorted(row) == list(range(n)) for row in block)
        assert position_counts(block, n) == [[1] * n for _ in range(n)]
    follows = Counter(pair for row in square for pair in itertools.pairwise(row))
    if n > 1:
        # every ordered pair (a then b), a != b, equally often
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1


@pytest.mark.parametrize("seed", [None, 0, 1, 12345])
@pytest.mark.parametrize("n", range(1, 8))
def test_every_variant_holds_every_position_equally_often(n: int, seed: int | None) -> None:
    design = n if n % 2 == 0 or n == 1 else 2 * n
    for rounds in range(1, 2 * design + 2):
        orders = balanced_orders(n, rounds, seed=seed)
        assert len(orders) == rounds
        assert all(sorted(order) == list(range(n)) for order in orders)
        counts = position_counts(orders, n)
        if rounds % 2 == 0:
            # every two rounds, every variant's positions add up to the same total
            assert {sum(p * c for p, c in enumerate(row)) for row in counts} == {
                rounds * (n - 1) // 2
            }
        if rounds % design == 0:
            # a whole design: every variant in every position equally often, and right after
            # every other variant equally often
            assert {c for row in counts for c in row} == {rounds // n}
            follows = Counter(pair for order in orders for pair in itertools.pairwise(order))
            assert len(set(follows.values())) <= 1 and len(follows) == n * (n - 1)


def test_no_variant_always_runs_first_or_last() -> None:
    orders = balanced_orders(4, 4)
    assert {order[0] for order in orders} == {0, 1, 2, 3}
    assert {order[-1] for order in orders} == {0, 1, 2, 3}
    # unseeded: the caller's order, then its reverse (A B C D / D C B A)
    assert balanced_orders(4, 2, seed=None) == [(0, 1, 2, 3), (3, 2, 1, 0)]
    assert balanced_orders(2, 4, seed=None) == [(0, 1), (1, 0), (0, 1), (1, 0)]


def test_seeded_orders_are_reproducible_and_differ_between_seeds() -> None:
    assert balanced_orders(5, 20, seed=7) == balanced_orders(5, 20, seed=7)
    assert balanced_orders(5, 20, seed=7) != balanced_orders(5, 20, seed=8)
    with pytest.raises(ValueError, match="at least one round"):
        balanced_orders(3, 0)
    with pytest.raises(ValueError, match="at least one variant"):
        williams_square(0)


def test_schedule_with_control_times_the_baseline_twice() -> None:
    schedule = Schedule(("native", "ring", "lp"), rounds=8, control=True)
    assert schedule.baseline == "native"
    assert schedule.names == ("native", "ring", "lp", "native'")
    assert schedule.control_variant == control_name("native") == "native'"
    assert schedule.code_of("native'") == "native" and schedule.code_of("ring") == "ring"
    orders = schedule.orders()
    assert len(orders) == 8 and all(sorted(o) == sorted(schedule.names) for o in orders)
    assert {o[0] for o in orders} == set(schedule.names)  # the copy runs first as often
    ran: list[str] = []

    def run(name: str, round_: int) -> float:
        ran.append(name)
        assert orders[round_].count(name) == 1
        return float(len(ran))

    samples = run_rounds(schedule, run)
    assert ran == [name for order in orders for name in order]
    assert all(len(values) == 8 for values in samples.values())
    with pytest.raises(ValueError, match="named twice"):
        Schedule(("a", "a"), rounds=2)
    with pytest.raises(ValueError, match="not a variant"):
        Schedule(("a", "b"), rounds=2, baseline="c")
    with pytest.raises(ValueError, match="control's name"):
        Schedule(("a", "a'"), rounds=2, control=True)


def test_summary_pairs_ratios_by_round_and_calls_ties_within_the_control() -> None:
    # The machine slows down 2x in round 2: paired ratios do not see it, medians would.
    samples = {
        "a": [1.0, 2.0, 1.0],
        "b": [1.1, 2.2, 1.1],
        "c": [0.5, 1.0, 0.5],
        "a'": [1.02, 2.04, 1.02],
    }
    summary = summarize(samples, baseline="a", control="a'")
    assert summary.medians["a"] == 1.0 and summary.ratios["a"] == 1.0
    assert summary.ratios["b"] == pytest.approx(1.1)
    assert summary.ratio_ranges["b"] == pytest.approx((1.1, 1.1))
    assert summary.control_ratio == pytest.approx(1.02)
    assert summary.noise_floor == pytest.approx(0.02)
    assert summary.is_tie(1.01) and summary.is_tie(1 / 1.01)  # a time ratio or a speed-up
    assert not summary.is_tie(summary.ratios["b"]) and not summary.is_tie(0.5)
    assert tie_mark(summary, 1.015) == " (tie)" and tie_mark(summary, 1.5) == ""
    line = control_line(summary)
    assert line is not None and "a' / a" in line and "1.020" in line and "2.0%" in line
    assert summary.as_dict()["control_ratio"] == pytest.approx(1.02)
    plain = summarize(samples, baseline="a")
    assert plain.control_ratio is None and plain.is_tie(1.0) is None
    assert control_line(plain) is None
    assert not math.isnan(plain.ratios["c"])
    with pytest.raises(ValueError, match="one per round"):
        summarize({"a": [1.0, 2.0], "b": [1.0]}, baseline="a")
    with pytest.raises(ValueError, match="baseline"):
        summarize({"a": [1.0]}, baseline="z")


def test_unpaired_ratios_are_ratios_of_medians() -> None:
    samples = {"a": [1.0, 4.0, 2.0], "b": [3.0, 2.0, 1.0], "a'": [2.0, 2.0, 2.0]}
    summary = summarize(samples, baseline="a", control="a'", paired=False)
    assert summary.ratios["b"] == 1.0 and summary.control_ratio == 1.0
    assert summarize(samples, baseline="a").ratios["b"] == 0.5  # per round: 3, 0.5, 0.5


def _binomial_below(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) < k)."""
    return sum(math.comb(n, i) for i in range(k)) / 2.0**n


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 10, 16, 25, 40])
def test_median_interval_is_the_sign_tests_order_statistics(n: int) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # sorted: 1, 2, ..., n
    low, high = median_interval(values)
    # the largest k whose tail is at most 2.5% (k = 1, the whole range, when none is)
    qualifying = [k for k in range(1, (n + 1) // 2 + 1) if _binomial_below(n, k) <= 0.025]
    k = max(qualifying, default=1)
    assert (low, high) == (float(k), float(n + 1 - k))
    assert (n <= 8) == ((low, high) == (1.0, float(n)))  # the whole range up to 8 rounds
    if n >= 6:
        assert 1.0 - 2.0 * _binomial_below(n, k) >= 0.95
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_a_ratio_whose_rounds_straddle_one_is_a_tie_whatever_the_control() -> None:
    # b's median ratio is 0.5, far outside the control's 2% floor, but its rounds go both ways:
    # the median's interval holds 1, so this job cannot call b faster.
    base = [1.0] * 10
    b = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0]
    c = [0.5] * 9 + [2.0]  # faster in 9 rounds of 10: the interval excludes 1
    summary = summarize({"a": base, "b": b, "c": c, "a'": [1.02] * 10}, baseline="a", control="a'")
    assert summary.ratio_intervals["b"] == (0.5, 2.0)
    assert summary.ratio_intervals["c"] == (0.5, 0.5)
    assert summary.is_tie(0.5, variant="b") and summary.is_tie(2.0, variant="b")
    assert not summary.is_tie(0.5)  # the control's floor alone would call it
    assert not summary.is_tie(0.5, variant="c") and not summary.is_tie(2.0, variant="c")
    assert summary.is_tie(1.01, variant="c")  # inside the control's floor is a tie regardless
