"""The gradient allreduce of fault-tolerant DDP: a comm hook on plain torch DDP over torchft.

torch's ``DistributedDataParallel`` runs on a process group of this replica group alone (one
rank here); every bucket it hands the hook is averaged across the replica groups of the
current quorum, on the process group that torchft's Manager reconfigures at each quorum change
(``process_group.py``). torchft's own DDP wrapper returns the Manager's lazily chained future
to DDP, which fails an assertion in the survivor when a peer dies inside the allreduce; this
hook waits for the allreduce itself and hands DDP a completed future, so a peer's death only
marks the step as failed. For each bucket:

1. if the Manager already recorded an error this step, do nothing (the step will not commit);
2. divide the bucket by the quorum's number of participants, before the sum, as torch DDP
   does without a hook (so a run without faults sums the same numbers as torch DDP); a
   replica that is not participating (still recovering) contributes zeros;
3. allreduce (sum) across the quorum and wait, watching the quorum's alarm;
4. on an error (a peer died or timed out, or raised the alarm): report it to the Manager,
   which refuses the commit, and raise the alarm so the peers waiting on this replica give up
   now rather than at their timeout. The bucket then holds garbage that no optimizer sees;
5. return a completed future with the bucket.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at
registration and rejects string annotations.)
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, GradBucket, ReduceOp

from commfuse.ft.process_group import AlarmedProcessGroupGloo


@dataclasses.dataclass(kw_only=True)
class FTHookState:
    """What ``ft_allreduce_hook`` needs."""

    process_group: AlarmedProcessGroupGloo
    """The cross-replica process group the Manager drives."""
    manager: Any = None
    """torchft's ``Manager`` of this replica group (set before the first synchronised step)."""
    on_issue: Callable[[int], None] | None = None
    """Called with the bucket index once its allreduce is in flight (fault injection)."""
    local: bool = False
    """Leave every bucket as it is (no communication): a restarted replica's first backward,
    which only lets DDP lay out its buckets as its peers did (``replica.py``)."""
    bytes_sent: int = 0
    """Bytes of gradient handed to the cross-replica allreduce so far."""


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def ft_allreduce_hook(state: FTHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the quorum's replica groups (see the module docstring).

    Args:
        state: the Manager, its process group and the fault-injection callback.
        bucket: DDP's bucket of gradients.

    Returns:
        A completed future holding the averaged bucket.
    """
    buffer = bucket.buffer()
    manager = state.manager
    if state.local or manager.errored():
        return _done(buffer)
    participants = manager.num_participants()
    if not manager.is_participating():
        buffer.zero_()
    elif participants > 1:
        buffer.div_(participants)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
    try:
        work = state.process_group.allreduce([buffer], opts)
        state.bytes_sent += buffer.numel() * buffer.element_size()
        if state.on_issue is not None:
            state.on_issue(bucket.index())
        state.process_group.wait(work)
    except Exception as error:
        manager.report_error(error)
        state.process_group.raise_alarm()
    return _done(buffer)
