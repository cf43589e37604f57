"""The gradient allreduce of fault-tolerant DDP: a comm hook on plain torch DDP over torchft.

torch's ``DistributedDataParallel`` runs on a process group of this replica group alone (one
rank here); every bucket it hands the hook is averaged across the replica groups of the
current quorum, on the process group that torchft's Manager reconfigures at each quorum change
(``process_group.py``), through ``QuorumComm`` (gloo's own collectives, every wait watching the
quorum's alarm, every byte counted). torchft's own DDP wrapper returns the Manager's lazily
chained future to DDP, which fails an assertion in the survivor when a peer dies inside the
allreduce; this hook hands DDP futures that always complete with the bucket, never with an
error, so a peer's death only marks the step as failed. For each bucket:

1. if the Manager already recorded an error this step, do nothing (the step will not commit);
2. divide the bucket by the quorum's number of participants, before the sum, as torch DDP
   does without a hook (so a run without faults sums the same numbers as torch DDP); a
   replica that is not participating (still recovering) contributes zeros;
3. sum it across the quorum (``QuorumComm.all_reduce``), or, with a commfuse compressor,
   exchange the compressor's messages instead (``compressor.reduce_`` over ``QuorumComm``:
   its messages, averaged, on the same group and alarm), the bucket's parameters naming its
   state (``set_layout``) and its step, as in ``commfuse.hooks``;
4. on an error (a peer died or timed out, or raised the alarm): report it to the Manager,
   which refuses the commit, and raise the alarm so the peers waiting on this replica give up
   now rather than at their timeout. The bucket then holds garbage that no optimizer sees.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at
registration and rejects string annotations.)

Design notes: ``docs/reliability.md``, "The fault-tolerant DDP hook: its worker thread".
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket

from commfuse.comm.worker import Worker
from commfuse.compress.base import Compressor
from commfuse.compress.layout import BucketLayout
from commfuse.ft.quorum_comm import QuorumComm


@dataclasses.dataclass(kw_only=True)
class FTHookState:
    """What ``ft_allreduce_hook`` needs."""

    comm: QuorumComm
    """The quorum's communicator, over the cross-replica process group the Manager drives."""
    manager: Any = None
    """torchft's ``Manager`` of this replica group (set before the first synchronised step)."""
    on_issue: Callable[[int], None] | None = None
    """Called with the bucket index as its exchange's first collective is about to be handed
    to gloo (fault injection: ``QuorumComm.on_issue``)."""
    compressor: Compressor | None = None
    """Exchange compressed messages instead of the bucket (its ``algo`` must be native)."""
    names: dict[int, str] = dataclasses.field(default_factory=dict)
    """``id(parameter) -> name``: what a bucket's compressor state is filed under."""
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Steps each parameter was reduced in (the compressor's ``step`` of a bucket)."""
    local: bool = False
    """Leave every bucket as it is (no communication): a restarted replica's first backward,
    which only lets DDP lay out its buckets as its peers did (``replica.py``)."""
    bytes_sent: int = 0
    """Bytes of gradient handed to the cross-replica collectives so far."""
    worker: Worker = dataclasses.field(default_factory=lambda: Worker("ft-hook"))
    """The thread that runs the exchanges, in bucket order."""


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def ft_allreduce_hook(state: FTHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the quorum's replica groups (see the module docstring).

    Args:
        state: the Manager, the quorum's communicator and the fault-injection callback.
        bucket: DDP's bucket of gradients.

    Returns:
        A future holding the averaged bucket, which the worker completes once the exchange is
        over (or at once, when there is nothing to exchange). It never holds an error: a
        failure goes to the Manager.
    """
    buffer = bucket.buffer()
    manager = state.manager
    if state.local or manager.errored():
        return _done(buffer)
    if not manager.is_participating():
        buffer.zero_()
    if state.compressor is None:
        participants = manager.num_participants()
        if participants > 1 and manager.is_participating():
            buffer.div_(participants)  # a compressor returns the average itself
        return _exchange(state, bucket.index(), buffer, _summed(state.comm, buffer))
    return _exchange(state, bucket.index(), buffer, _compressed(state, bucket))


def _summed(comm: QuorumComm, buffer: torch.Tensor) -> Callable[[], None]:
    """Step 3 without a compressor: the sum of the (already divided) buckets."""
    return lambda: comm.all_reduce(buffer)


def _compressed(state: FTHookState, bucket: GradBucket) -> Callable[[], None]:
    """Step 3 with a compressor: the bucket through ``state.compressor`` over the quorum, in
    place. Its layout and step are settled here, on DDP's thread, before the exchange is
    queued: the worker never sees a layout change halfway through a bucket, and the step
    counts advance in bucket order."""
    compressor, comm = state.compressor, state.comm
    assert compressor is not None
    names = tuple(state.names[id(p)] for p in bucket.parameters())
    layout = BucketLayout(names=names, shapes=tuple(g.shape for g in bucket.gradients()))
    step = max((state.steps.get(name, 0) for name in names), default=0)
    for name in names:
        state.steps[name] = step + 1
    index, buffer = bucket.index(), bucket.buffer()
    compressor.set_layout(index, layout)
    return lambda: compressor.reduce_(comm, buffer, bucket=index, step=step)  # type: ignore[arg-type]


def _exchange(
    state: FTHookState, index: int, buffer: torch.Tensor, reduce: Callable[[], None]
) -> torch.futures.Future[torch.Tensor]:
    """Run ``reduce`` on the worker, behind the earlier buckets' exchanges, and return the
    future that it completes with ``buffer``, failed or not (steps 1, 3 and 4)."""
    comm = state.comm
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    on_issue = state.on_issue

    def exchange() -> None:
        try:
            if state.manager.errored():
                return  # an earlier bucket failed: the step is lost, spare the quorum
            before = comm.bytes_sent
            with bucket_issue(comm, on_issue, index):
                reduce()
            state.bytes_sent += comm.bytes_sent - before
        except Exception as error:
            report_failure(state.manager, comm, error)
        finally:
            future.set_result(buffer)

    state.worker.submit(exchange)
    return future


@contextlib.contextmanager
def bucket_issue(
    comm: QuorumComm, on_issue: Callable[[int], None] | None, index: int
) -> Iterator[None]:
    """Bucket ``index``'s exchange on ``comm``: ``on_issue(index)`` is called as its first
    collective is about to be issued (an exchange may be several collectives: a fault comes
    then, before any of it leaves), and
    ``comm`` calls nothing once the exchange has ended, failed or not."""
    comm.on_issue = None if on_issue is None else (lambda: on_issue(index))
    try:
        yield
    finally:
        comm.on_issue = None


def report_failure(manager: Any, comm: QuorumComm, error: Exception) -> None:
    """Step 4: the Manager refuses this step's commit, and the quorum's peers stop waiting."""
    manager.report_error(error)
    comm.process_group.raise_alarm()
