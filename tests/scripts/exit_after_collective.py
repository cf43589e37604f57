"""A rank that leaves the interpreter right after its last collective.

It drops its handle of the all-reduce at once, so gloo's work-loop thread holds the last
reference to the work, and releasing it (which releases the tensor's Python object) needs the
GIL. The script then never hands the GIL over (a switch interval longer than the run; it reads
the result through ``ctypes``, since a torch operation releases the GIL) and leaves while that
thread still waits for it. Without commfuse's exit guard the process then dies of SIGABRT
("terminate called without an active exception") after doing everything right.
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch
import torch.distributed as dist

from commfuse.comm import Communicator

N = 1000


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()  # installs the guard
    tensor = torch.full((N,), float(comm.rank + 1))
    expected = comm.world_size * (comm.world_size + 1) / 2
    values = (ctypes.c_float * N).from_address(tensor.data_ptr())
    print(f"rank {comm.rank} of {comm.world_size} sums", flush=True)
    sys.setswitchinterval(100.0)
    dist.all_reduce(tensor, async_op=True)  # the work is dropped here
    deadline = time.monotonic() + 30.0
    while values[N - 1] != expected and time.monotonic() < deadline:
        pass
    # Hold the GIL a while longer: the work loop has finished and waits for it.
    settle = time.monotonic() + 0.05
    while time.monotonic() < settle:
        pass
    # Nothing is printed from here on (writing releases the GIL): a wrong sum is an exit status.
    if set(values) != {expected}:
        sys.exit(3)


if __name__ == "__main__":
    main()
