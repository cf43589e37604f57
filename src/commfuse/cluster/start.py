"""How rank processes start: forked from a server that has already imported torch.

A rank that is spawned (a fresh interpreter) imports torch before it can do anything, about
two seconds of CPU each; four ranks on a few cores pay that several times over at every job
start and every restart of a replica. ``multiprocessing``'s *forkserver* start method forks
each rank from one server process instead, and ``set_forkserver_preload`` lets that server
import torch once, so a rank starts with torch already in memory.

The server forks before any torch operation has run, so no thread pool, CUDA context or
process group exists yet to be duplicated (the hazards of forking a process that used torch).
A forked rank inherits the server's environment, not its caller's at the time of the call:
every commfuse rank therefore receives the caller's full environment and adopts it in place
of its own (``enter_rank``), as a spawned rank would have it.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext

# Imported by the server before it forks any rank (see the module docstring).
_PRELOAD = ["torch", "torch.distributed"]


def rank_context() -> ForkServerContext:
    """The multiprocessing context every commfuse rank starts from (forkserver, torch loaded)."""
    ctx = mp.get_context("forkserver")
    # Effective only before the server starts (the first rank of the process); harmless after.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx
