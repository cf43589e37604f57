"""A rank that behaves as told, so tests can make one rank fail, exit or hang.

    misbehave.py MARKER [--default MODE] [--rank R=MODE ...] [--child]

MODE is one of: ok (exit 0), sleep (hang for 10 minutes), wait-group (join a gloo process group
and wait in a barrier, as a healthy rank waits for a peer), group-sleep (join the group, then
hang), raise (ValueError), group-raise (join the group, then raise ValueError), exit3
(``os._exit(3)``), mismatch (join the group and call a commfuse collective that the other
ranks do not call: all_reduce on rank 0, broadcast elsewhere, with a 2 s deadline),
mismatch-caught (the same, the CommError caught, then the script ends: a CommTimeoutError, or a
PeerFailureError when the other rank left before this one's deadline). --late R=S makes rank R wait
S seconds before its collective. Every rank first prints ``READY rank=R pid=P child=C lab=L`` (C is the pid of
a grandchild started with --child, or 0; L the emulated cluster's id, or -). MARKER is only there so tests can find every process of
the job by its command line; the grandchild carries it too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("marker")
parser.add_argument("--default", default="ok")
parser.add_argument("--rank", action="append", default=[], metavar="R=MODE")
parser.add_argument("--child", action="store_true")
parser.add_argument("--late", action="append", default=[], metavar="R=SECONDS")
args = parser.parse_args()

rank = int(os.environ["RANK"])
modes = {int(r): m for r, m in (item.split("=", 1) for item in args.rank)}
mode = modes.get(rank, args.default)
late_s = {int(r): float(s) for r, s in (item.split("=", 1) for item in args.late)}.get(rank, 0.0)

child = 0
if args.child:
    sleeper = "import time; time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", sleeper, args.marker]).pid
lab = os.environ.get("COMMFUSE_NETLAB", "-")
print(f"READY rank={rank} pid={os.getpid()} child={child} lab={lab}", flush=True)

if mode == "ok":
    sys.exit(0)
elif mode == "sleep":
    time.sleep(600)
elif mode == "wait-group":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
elif mode == "group-sleep":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    time.sleep(600)
elif mode == "raise":
    time.sleep(0.5)  # let the other ranks reach their wait first
    raise ValueError(f"boom from rank {rank}")
elif mode == "group-raise":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # Now torch's excepthook prefixes every traceback line with "[rankN]: ".
    raise ValueError(f"boom from rank {rank}")
elif mode in ("mismatch", "mismatch-caught"):
    import torch
    import torch.distributed as dist

    from commfuse import collectives as C
    from commfuse.comm import CommConfig, CommError, Communicator

    dist.init_process_group("gloo")
    comm = Communicator(config=CommConfig(deadline_s=2))
    tensor = torch.ones(1000)
    time.sleep(late_s)
    try:
        if rank == 0:
            C.all_reduce(comm, tensor, algo="native")
        else:
            C.broadcast(comm, tensor, 0, algo="native")
    except CommError as err:
        if mode == "mismatch":
            raise
        print(f"CAUGHT {err.op}", flush=True)
elif mode == "exit3":
    time.sleep(0.5)
    os._exit(3)
else:
    sys.exit(f"unknown mode {mode!r}")
