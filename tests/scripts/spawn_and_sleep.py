"""Start two ranks with ``commfuse.cluster.run`` that print their pid and sleep: a driver for a
test that kills this process with SIGKILL and checks that its ranks die with it."""

from __future__ import annotations

import os
import time

from commfuse.cluster import run


def print_pid_and_sleep() -> None:
    print(f"RANK_PID {os.getpid()}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    run(print_pid_and_sleep, world_size=2, backend=None, timeout_s=600)
