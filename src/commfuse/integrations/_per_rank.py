"""Every rank's state in one checkpoint entry that only rank 0 writes, each rank's back on load.

Error feedback, PowerSGD's factors and a periodic replica differ from rank to rank, while the
trainers write one file from rank 0. ``gather_states`` (called on every rank, as the trainers'
checkpoint code runs) collects them by global rank; ``own_state`` picks this rank's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_states(state: Any) -> list[Any]:
    """``state`` of every rank, by global rank (a collective: every rank calls it; one process
    without a group is a world of one)."""
    if not dist.is_initialized():
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def own_state(states: list[Any], what: str) -> Any:
    """This rank's entry of ``gather_states``' list.

    Raises:
        ValueError: the list was saved by a different number of ranks."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(states) != world:
        raise ValueError(
            f"the checkpoint holds the {what} of {len(states)} ranks, this job has {world}: "
            "resume on as many ranks as saved it"
        )
    return states[rank]


class PerRankState:
    """A ``state_dict``/``load_state_dict`` object that saves every rank's state of ``inner``
    (for a trainer that checkpoints registered objects from rank 0's dictionary).

    Args:
        inner: the object whose state differs per rank (a ``CompressionState``).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_states(self.inner.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(own_state(state["ranks"], "hook states"))
