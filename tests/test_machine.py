"""The machine's busy-CPU counter that ``bench strategies`` divides into a step's CPU floor."""

from __future__ import annotations

import time

from commfuse.cluster import machine


def test_busy_cpu_counts_work_done_on_this_machine() -> None:
    before = machine.busy_cpu_s()
    assert before is not None  # Linux: /proc/stat
    spin_until = time.process_time() + 0.3
    while time.process_time() < spin_until:  # 0.3 s of this process's CPU
        pass
    after = machine.busy_cpu_s()
    assert after is not None
    # Every tick this process ran is a busy tick of the machine (others may add more).
    assert after - before >= 0.25
    assert machine.cores() >= 1
