"""The CPU floor's arithmetic (bench/cpu_floor.py): ranks of one machine share its cores."""

from __future__ import annotations

import pytest

from commfuse.bench.cpu_floor import cpu_seconds, floor_of, machine_key, usable_cores


def test_ranks_of_one_machine_sum_their_cpu_over_its_cores() -> None:
    # 4 ranks on one 2-core machine: 4 x 100 us of CPU need 200 us of the 2 cores.
    assert floor_of([[7.0, 100.0, 2.0]] * 4) == pytest.approx(200.0)


def test_the_busiest_machine_sets_the_floor() -> None:
    rows = [[1.0, 300.0, 2.0], [1.0, 100.0, 2.0], [2.0, 50.0, 1.0], [2.0, 60.0, 1.0]]
    assert floor_of(rows) == pytest.approx(200.0)  # machine 1: 400 / 2; machine 2: 110 / 1
    assert floor_of([]) == 0.0


def test_this_process_is_measured() -> None:
    before = cpu_seconds()
    sum(i * i for i in range(200_000))  # burn some CPU
    assert cpu_seconds() > before
    assert usable_cores() >= 1
    assert machine_key() == machine_key()
