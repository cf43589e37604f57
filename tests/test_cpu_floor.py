"""The CPU floor's arithmetic (bench/cpu_floor.py): ranks of one machine share its cores."""

from __future__ import annotations

import pytest

from commfuse.bench.cpu_floor import (
    cpu_seconds,
    floor_of,
    machine_key,
    usable_cores,
)
from commfuse.cluster.machine import MIN_CORES


def test_ranks_of_one_machine_sum_their_cpu_over_its_cores() -> None:
    # 4 ranks on one 2-core machine: 4 x 100 us of CPU need 200 us of the 2 cores.
    assert floor_of([[7.0, 100.0, 2.0]] * 4) == pytest.approx(200.0)


def test_the_busiest_machine_sets_the_floor() -> None:
    rows = [[1.0, 300.0, 2.0], [1.0, 100.0, 2.0], [2.0, 50.0, 1.0], [2.0, 60.0, 1.0]]
    assert floor_of(rows) == pytest.approx(200.0)  # machine 1: 400 / 2; machine 2: 110 / 1
    assert floor_of([]) == 0.0


def test_the_machine_floor_adds_the_kernels_work_and_divides_by_the_cores_left() -> None:
    # 4 ranks x 100 us on 2 cores; the machine's reader adds 40 us of kernel network work and
    # saw 0.5 of a core taken by other programs: 440 us over 1.5 cores.
    rows = [[7.0, 100.0, 2.0, 40.0, 0.5]] + [[7.0, 100.0, 2.0, 0.0, 0.0]] * 3
    assert floor_of(rows) == pytest.approx(440.0 / 1.5)
    # Without them it is the CPU floor; a machine read as fully taken divides by MIN_CORES.
    assert floor_of([[7.0, 100.0, 2.0, 0.0, 0.0]] * 4) == floor_of([[7.0, 100.0, 2.0]] * 4)
    assert floor_of([[7.0, 100.0, 2.0, 0.0, 2.5]]) == pytest.approx(100.0 / MIN_CORES)


def test_this_process_is_measured() -> None:
    before = cpu_seconds()
    sum(i * i for i in range(200_000))  # burn some CPU
    assert cpu_seconds() > before
    assert usable_cores() >= 1
    assert machine_key() == machine_key()
