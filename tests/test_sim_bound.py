"""The step bound of sim/bound.py on small graphs whose best schedule is known by hand.

Each case names its optimal schedule in the comment: a bound above it would be no bound, one
below it would not count the wait. Pure arithmetic, no ranks.
"""

from __future__ import annotations

import pytest

from commfuse.sim.bound import GlobalWait, StepGraph, step_bound


def graph(
    waits: tuple[GlobalWait, ...],
    *,
    cores: float = 1.0,
    floor_us: float | None = None,
    chunk_choices: tuple[int, ...] = (1,),
    piece_cpu_us: float = 0.0,
) -> StepGraph:
    """Two ranks, on one core unless told, each 4 us before the wait and 4 after, plus its
    share of the fill (and of the exchanges' CPU, in the floor)."""
    fill = sum(w.fill_us for w in waits)
    traffic = sum(w.traffic_cores * w.wait_us for w in waits)
    return StepGraph(
        ranks=2,
        cores=cores,
        floor_us=(16.0 + fill + traffic) / cores if floor_us is None else floor_us,
        rank_compute_us=8.0 + fill / 2,
        waits=waits,
        chunk_choices=chunk_choices,
        piece_cpu_us=piece_cpu_us,
    )


def test_a_wait_nothing_can_fill_idles_the_cores() -> None:
    # Best schedule: both ranks' 4 us on the core (8), the wait (6, idle), both ranks' 4 (8).
    b = step_bound(graph((GlobalWait(name="all-reduce", wait_us=6.0),)))
    assert b.bound_us == pytest.approx(22.0)
    assert b.exposed_us == {"all-reduce": pytest.approx(6.0)}
    assert b.critical_path_us == pytest.approx(14.0)  # one rank: 4 + 6 + 4


def test_the_fill_runs_inside_the_wait() -> None:
    # A local block of 2 per rank needs nothing remote: 8, then the wait of 6 holds both
    # blocks (4) and idles 2, then 8: 22, against a floor of 20.
    wait = GlobalWait(name="dispatch", wait_us=6.0, fill_us=4.0)
    assert step_bound(graph((wait,))).bound_us == pytest.approx(22.0)
    # A fill longer than the wait hides it: the floor.
    wait = GlobalWait(name="dispatch", wait_us=6.0, fill_us=8.0)
    assert step_bound(graph((wait,))).bound_us == pytest.approx(24.0)


def test_the_exchanges_own_cpu_fills_the_wait_at_its_rate() -> None:
    # The exchange takes half a core while it moves its 6 us of bytes (3 us of CPU, in the
    # floor): the wait holds those 3 and 3 of the 4 of fill; best: 8 + 6 + 1 + 8 = 23.
    wait = GlobalWait(name="dispatch", wait_us=6.0, fill_us=4.0, traffic_cores=0.5)
    b = step_bound(graph((wait,)))
    assert b.bound_us == pytest.approx(23.0) and b.exposed_us["dispatch"] == 0.0


def test_the_critical_path_binds_where_every_rank_has_a_core() -> None:
    # Two cores for two ranks: each runs 4, waits 6 holding its block of 2, runs 4: 14,
    # where the cores' floor alone says 10.
    wait = GlobalWait(name="dispatch", wait_us=6.0, fill_us=4.0)
    b = step_bound(graph((wait,), cores=2.0))
    assert b.critical_path_us == pytest.approx(14.0)
    assert b.machine_us == pytest.approx(14.0)  # 10 + (6 - 4 / 2)
    assert b.bound_us == pytest.approx(14.0)


def test_the_best_chunk_count_shrinks_a_piece_major_wait() -> None:
    wait = GlobalWait(name="dispatch", wait_us=6.0, chunked=True)
    # One piece: the whole wait idles (22); two: its first round, 3 (19); three: 2 (18).
    assert step_bound(graph((wait,))).bound_us == pytest.approx(22.0)
    b = step_bound(graph((wait,), chunk_choices=(1, 2, 3)))
    assert b.chunks == 3 and b.bound_us == pytest.approx(18.0)
    # Each piece beyond the first costs 1.5 us of CPU: 22, 16 + 1.5 + 3, 16 + 3 + 2: two.
    b = step_bound(graph((wait,), chunk_choices=(1, 2, 3), piece_cpu_us=1.5))
    assert b.chunks == 2 and b.bound_us == pytest.approx(20.5)
    # A wait that is not piece-major does not shrink.
    fixed = GlobalWait(name="all-reduce", wait_us=6.0)
    assert step_bound(graph((fixed,), chunk_choices=(1, 2, 3))).bound_us == pytest.approx(22.0)


def test_disjoint_waits_add_up() -> None:
    waits = (
        GlobalWait(name="dispatch", wait_us=6.0, fill_us=4.0),
        GlobalWait(name="all-reduce", wait_us=3.0),
    )
    # 8, the dispatch's wait holding both blocks (6), 8, the all-reduce (3): 25.
    b = step_bound(graph(waits))
    assert b.bound_us == pytest.approx(25.0)
    assert b.exposed_us == {"dispatch": pytest.approx(2.0), "all-reduce": pytest.approx(3.0)}


def test_bad_graphs_are_refused() -> None:
    with pytest.raises(ValueError, match="wait_us"):
        GlobalWait(name="x", wait_us=-1.0)
    with pytest.raises(ValueError, match="cores"):
        StepGraph(ranks=2, cores=0.0, floor_us=1.0, rank_compute_us=1.0)
    with pytest.raises(ValueError, match="chunk_choices"):
        StepGraph(ranks=2, cores=1.0, floor_us=1.0, rank_compute_us=1.0, chunk_choices=(0,))
