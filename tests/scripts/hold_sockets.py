"""A torchrun-style rank that joins the process group, all-reduces once (so every gloo
connection is up) and then holds its sockets open until the file named by argv[1] exists.

It prints ``HOLDING pid=P`` once it is ready to be inspected.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

release = sys.argv[1]
dist.init_process_group("gloo")
total = torch.ones(4)
dist.all_reduce(total)
assert float(total[0]) == dist.get_world_size()
print(f"HOLDING pid={os.getpid()}", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
