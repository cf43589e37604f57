"""The progress floor: no replica trains from behind the step a live replica holds.

torchft's lighthouse forms a quorum of the replicas that ask for one, and the quorum's step is
the highest its members hold (``max_step``). A replica restarted from nothing holds step 0; one
whose link was down holds the step it was cut off at. If such replicas meet while every
replica holding the run's progress is held out of the quorum (its own link down, or stuck in a
collective with a peer that died), their quorum's step is behind and they would train steps
the run already has. When the held-out replica comes back, the next quorum takes the step of
whichever side is ahead: the other side's steps are thrown away, either the held-out replica's
progress or the others' repeated work, and the run's samples are trained twice.

The launcher knows what no quorum does: every replica's committed step (each reports its
steps) and which replicas are alive. The **progress floor** is the highest step that a live
replica has committed. The launcher tells it to each restarted life with its go, and to any
live replica that falls ``FLOOR_LAG`` committed steps behind it (``launch._Supervisor.
_update_floors``; replicas of one quorum report each step within one of each other). A
replica whose quorum's step is below its floor does not train the step: it reports the
attempt as a wait (``behind``), votes against committing, sends nothing (so the quorum's
other members fail the step too), and asks for a quorum again, until a replica holding the
progress is in its quorum and it has recovered that replica's state. If every replica at the
floor dies while others wait, the launcher lowers their floor to the highest step still
alive, so the wait always ends: progress that no live replica holds is gone, and the
survivors go on from theirs.

Messages go down the launcher's pipe as ``("floor", step)``: one right after every ``go`` (0
for the run's first lives), then when a replica falls behind or a death lowers its floor; the
replica reads them between steps without waiting (``read_floor``). The ranks of a replica
group decide as one (``behind_the_run``).
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist


def read_floor(conn: Connection, floor: int = 0, *, wait: bool = False) -> int:
    """The latest progress floor the launcher sent on ``conn`` (``floor`` if none is waiting).
    With ``wait``, the one that follows the go first (the launcher sends one with every go)."""
    if wait:
        conn.poll(None)
    while conn.poll(0):
        kind, step = pickle.loads(conn.recv_bytes())
        if kind != "floor":
            raise RuntimeError(f"unexpected message from the launcher: {kind!r}")
        floor = int(step)
    return floor


def floor_message(step: int) -> bytes:
    """What the launcher sends to tell a life its progress floor."""
    return pickle.dumps(("floor", step), protocol=pickle.HIGHEST_PROTOCOL)


class BehindTheRun(RuntimeError):
    """This replica's quorum is at an older step than a live replica holds (module
    docstring): the step is not trained."""

    def __init__(self, quorum_step: int, floor: int) -> None:
        super().__init__(
            f"the quorum's step {quorum_step} is behind step {floor}, which a live replica "
            "holds: waiting for it to join the quorum"
        )


def behind_the_run(step: int, floor: int, group_size: int, device: torch.device) -> bool:
    """Whether a quorum at ``step`` is behind the progress floor ``floor``, the same answer on
    every rank of a replica group of ``group_size``: its first rank's, broadcast on the group's
    own process group (from a flag on ``device``) at every step, since the group's ranks may
    hear a floor at slightly different times and must not split (one training, one waiting).
    """
    behind = step < floor
    if group_size > 1:
        flag = torch.tensor([int(behind)], device=device)
        dist.broadcast(flag, src=0)
        behind = bool(flag.item())
    return behind
