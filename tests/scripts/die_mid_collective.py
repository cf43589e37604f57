"""A torchrun-style job in which one rank SIGKILLs itself in the middle of a collective.

    die_mid_collective.py ALGO VICTIM NUMEL [hold] [caller-waits]

ALGO is ``ring``, ``pipeline`` or ``native`` (an allreduce of NUMEL floats), ``tree`` (a
binomial-tree broadcast from VICTIM) or ``p2p`` (one message of NUMEL floats from VICTIM to the
next rank, which the victim dies in the middle of sending). The victim dies while the operation
is in flight: inside our algorithms right after its first send has completed (its peers have started and some data
has moved); in the native allreduce, once every other rank has entered the allreduce and its own
part has started. With ``hold``, a child forked just before the death keeps the victim's
sockets open (and silent) for ``HOLD_S``: its peers see no connection close, as when a host
loses its link, and only the launcher's notice can tell them. With ``caller-waits``, every
point-to-point wait blocks the calling thread (``CommConfig(wait_thread_min_bytes=None)``), as
messages under a megabyte always do. Every other rank prints one line

    RESULT {"rank": R, "type": "PeerFailureError" | "ok", "message": ..., "failed_rank": ...,
            "t": CLOCK_MONOTONIC}

and then lets the exception end the process, as a training script would; the victim prints
``KILLED t`` just before it dies. CLOCK_MONOTONIC is shared by the processes of one machine.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.comm.communicator import default_config

# A rank the launcher has to stop (SIGTERM), or one that crashes, prints where each of its
# threads was.
faulthandler.enable(all_threads=True)
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
algo, victim, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hold = "hold" in sys.argv[4:]
caller_waits = "caller-waits" in sys.argv[4:]
HOLD_S = 30.0
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
comm = Communicator(
    config=dataclasses.replace(default_config(), wait_thread_min_bytes=None)
    if caller_waits
    else None
)
store = dist.TCPStore(  # type: ignore[attr-defined]  # the job's store, for the native case's handshake
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
)


def die() -> None:
    if hold and os.fork() == 0:
        # The child inherits every socket of the rank; it never reads or writes them, and it
        # closes the launcher's pipes so that only the parent's death is seen.
        os.close(1)
        os.close(2)
        time.sleep(HOLD_S)
        os._exit(0)
    print(f"KILLED {time.monotonic():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if rank == victim and algo not in ("native", "p2p"):
    first_send = comm.isend

    def isend_then_die(*args: Any, **kwargs: Any) -> Any:
        handle = first_send(*args, **kwargs)
        handle.wait()
        die()
        return handle

    comm.isend = isend_then_die  # type: ignore[method-assign]  # the fault injected in the victim

buf = torch.full((numel,), float(rank + 1))
comm.barrier()
try:
    if algo == "p2p":
        receiver = (victim + 1) % world
        if rank == victim:
            store.wait([f"posted/{receiver}"])
            # gloo writes the message in isend's own call for as long as the socket takes it
            # (on loopback it may all go there), so the death comes from another thread, 5 ms
            # into a write of hundreds of MB.
            threading.Timer(0.005, die).start()
            comm.isend(buf, receiver)
            time.sleep(60)
        elif rank == receiver:
            receive = comm.irecv(buf, victim)
            store.set(f"posted/{rank}", "1")
            receive.wait()
    elif algo == "tree":
        store.set(f"started/{rank}", "1")
        C.broadcast(comm, buf, victim, algo="tree")
        assert bool((buf == victim + 1).all()), "broadcast delivered wrong data"
    else:
        if rank == victim and algo == "native":
            store.wait([f"started/{r}" for r in range(world) if r != victim])
            handle = C.all_reduce(comm, buf, "sum", algo="native", async_op=True)
            # Long enough for gloo's thread to start its part; short enough that 64 MB cannot
            # finish on an idle machine (a 50 ms pause once saw a 3-rank allreduce finish).
            time.sleep(0.005)
            assert handle is not None and not handle.is_completed(), "finished before the kill"
            die()
        store.set(f"started/{rank}", "1")
        C.all_reduce(comm, buf, "sum", algo=algo)
    print("RESULT " + json.dumps({"rank": rank, "type": "ok", "t": time.monotonic()}), flush=True)
except Exception as exc:
    record = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "failed_rank": getattr(exc, "failed_rank", None),
        "t": time.monotonic(),
    }
    print("RESULT " + json.dumps(record), flush=True)
    raise
