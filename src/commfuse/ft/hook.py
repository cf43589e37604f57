"""The gradient allreduce of fault-tolerant DDP: a comm hook on plain torch DDP over torchft.

torch's ``DistributedDataParallel`` runs on a process group of this replica group alone (one
rank here); every bucket it hands the hook is averaged across the replica groups of the
current quorum, on the process group that torchft's Manager reconfigures at each quorum change
(``process_group.py``). torchft's own DDP wrapper returns the Manager's lazily chained future
to DDP, which fails an assertion in the survivor when a peer dies inside the allreduce; this
hook hands DDP futures that always complete with the bucket, never with an error, so a peer's
death only marks the step as failed. For each bucket:

1. if the Manager already recorded an error this step, do nothing (the step will not commit);
2. divide the bucket by the quorum's number of participants, before the sum, as torch DDP
   does without a hook (so a run without faults sums the same numbers as torch DDP); a
   replica that is not participating (still recovering) contributes zeros;
3. allreduce (sum) across the quorum and wait, watching the quorum's alarm;
4. on an error (a peer died or timed out, or raised the alarm): report it to the Manager,
   which refuses the commit, and raise the alarm so the peers waiting on this replica give up
   now rather than at their timeout. The bucket then holds garbage that no optimizer sees;
5. return a completed future with the bucket.

With a commfuse compressor, step 3 is the compressor's exchange (``compressor.reduce_`` over
``QuorumComm``: its messages, averaged, on the same group and alarm), and the bucket's
parameters name its state (``set_layout``) and its step, as in ``commfuse.hooks``. The
exchange runs on the hook's worker thread, one bucket after the other in the order DDP hands
them over (the same on every replica, which keeps the collectives matched), while backward
computes the next buckets: the hook returns a future that the worker completes once the
bucket is averaged, or once its exchange failed (steps 1 and 4 run there, before and after
it). DDP waits for those futures at the end of backward, so every exchange has finished,
failed or not, before the commit vote; a waiting exchange still watches the alarm, so no
replica waits longer than one poll after a peer gave up. A failed step may have changed the
compressor's state on some replicas and not others: the replica loop restores it from the
step's start (``replica.py``).

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at
registration and rejects string annotations.)
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, GradBucket, ReduceOp

from commfuse.comm.worker import Worker
from commfuse.compress.base import Compressor
from commfuse.compress.layout import BucketLayout
from commfuse.ft.process_group import AlarmedProcessGroupGloo
from commfuse.ft.quorum_comm import QuorumComm


@dataclasses.dataclass(kw_only=True)
class FTHookState:
    """What ``ft_allreduce_hook`` needs."""

    process_group: AlarmedProcessGroupGloo
    """The cross-replica process group the Manager drives."""
    manager: Any = None
    """torchft's ``Manager`` of this replica group (set before the first synchronised step)."""
    on_issue: Callable[[int], None] | None = None
    """Called with the bucket index once its allreduce is in flight (fault injection)."""
    compressor: Compressor | None = None
    """Exchange compressed messages instead of the bucket (its ``algo`` must be native)."""
    comm: QuorumComm | None = None
    """The compressor's communicator over the quorum (with a compressor)."""
    names: dict[int, str] = dataclasses.field(default_factory=dict)
    """``id(parameter) -> name``: what a bucket's compressor state is filed under."""
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Steps each parameter was reduced in (the compressor's ``step`` of a bucket)."""
    local: bool = False
    """Leave every bucket as it is (no communication): a restarted replica's first backward,
    which only lets DDP lay out its buckets as its peers did (``replica.py``)."""
    bytes_sent: int = 0
    """Bytes of gradient handed to the cross-replica allreduce so far."""
    worker: Worker = dataclasses.field(default_factory=lambda: Worker("ft-hook"))
    """The thread that runs the compressor's exchanges, in bucket order."""


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
        A future holding the averaged bucket: completed, or (with a compressor) completed by
        the worker once the exchange is over. It never holds an error: a failure goes to the
        Manager.
    """
    buffer = bucket.buffer()
    manager = state.manager
    if state.local or manager.errored():
        return _done(buffer)
    participants = manager.num_participants()
    if not manager.is_participating():
        buffer.zero_()
    elif participants > 1 and state.compressor is None:
        buffer.div_(participants)  # a compressor returns the average itself
    if state.compressor is not None:
        return _compressed(state, bucket)
    try:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
        work = state.process_group.allreduce([buffer], opts)
        state.bytes_sent += buffer.numel() * buffer.element_size()
        if state.on_issue is not None:
            state.on_issue(bucket.index())
        state.process_group.wait(work)
    except Exception as error:
        _failed(state, error)
    return _done(buffer)


def _failed(state: FTHookState, error: Exception) -> None:
    """Step 4: the Manager refuses this step's commit, and the quorum's peers stop waiting."""
    state.manager.report_error(error)
    state.process_group.raise_alarm()


def _compressed(state: FTHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket through ``state.compressor`` over the quorum, in place, on the worker."""
    compressor, comm = state.compressor, state.comm
    assert compressor is not None and comm is not None
    # On DDP's thread, before the exchange is queued: the worker never sees a layout change
    # halfway through a bucket, and the step counts advance in bucket order.
    names = tuple(state.names[id(p)] for p in bucket.parameters())
    layout = BucketLayout(names=names, shapes=tuple(g.shape for g in bucket.gradients()))
    step = max((state.steps.get(name, 0) for name in names), default=0)
    for name in names:
        state.steps[name] = step + 1
    index, buffer = bucket.index(), bucket.buffer()
    compressor.set_layout(index, layout)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def exchange() -> None:
        try:
            if state.manager.errored():
                return  # an earlier bucket failed: the step is lost, spare the quorum
            before = comm.bytes_sent
            if state.on_issue is not None:
                # A compressor's exchange is several collectives: the fault comes as it begins.
                state.on_issue(index)
            compressor.reduce_(comm, buffer, bucket=index, step=step)  # type: ignore[arg-type]
            state.bytes_sent += comm.bytes_sent - before
        except Exception as error:
            _failed(state, error)
        finally:
            future.set_result(buffer)

    state.worker.submit(exchange)
    return future
