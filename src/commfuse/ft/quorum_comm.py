"""A communicator over the quorum, for commfuse's compressors under torchft.

A compressor (``commfuse.compress``) exchanges its messages through a ``Communicator``:
``all_reduce`` when the messages can be summed as they are (fp16, int8 with a shared scale,
PowerSGD's factors), ``all_gather`` when they cannot (top-k's values and indices). Under
torchft the replica groups meet in the process group that the Manager reconfigures at each
quorum, which torch.distributed does not know of; ``QuorumComm`` offers those two operations
(and what a compressor reads: rank, world size, the config) on that group with gloo's own
collectives, every wait watching the quorum's alarm (``process_group.py``), and every byte
counted. An all-reduce is gloo's ring all-reduce: each element of the sum is reduced once, on
the rank that owns its chunk, and that one result is copied to every other rank, so every
replica holds the same bits (which keeps replicas from drifting apart in the last bit), and each
replica sends ``2 (n - 1) / n`` times the message rather than an all-gather's ``n - 1`` times.
Its rank and size are the quorum's, read afresh at every step. The local-SGD family
(``commfuse.localsgd.PeriodicSyncOptimizer``) takes it as its communicator too: its background
exchanges (``submit``) run at once here, so that every exchange of a period has finished, and
failed or not, before the period's commit vote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from commfuse.comm import CommConfig, Handle, ReduceOpName
from commfuse.ft.process_group import AlarmedProcessGroupGloo


class QuorumComm:
    """The compressors' view of the quorum (see the module docstring).

    Args:
        process_group: the cross-replica group the Manager drives.
    """

    name = "torchft-quorum"

    def __init__(self, process_group: AlarmedProcessGroupGloo) -> None:
        self.process_group = process_group
        self.config = CommConfig()
        self.rank = 0
        """This replica group's rank in the quorum."""
        self.world_size = 1
        """Replica groups in the quorum."""
        self.bytes_sent = 0
        """Bytes handed to collectives so far."""
        self.on_issue: Callable[[], None] | None = None
        """Called as each collective is about to be handed to gloo (fault injection): a
        replica killed there sent nothing of it, so no peer can finish it. (Killed once it
        was handed over, gloo's threads may already have delivered a small message, and the
        peers go on as if nothing had happened.)"""

    def at_quorum(self, rank: int, world_size: int) -> None:
        """The quorum of the step about to run."""
        self.rank, self.world_size = rank, world_size

    @contextlib.contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Steps are the Manager's to count; nothing to mark."""
        yield

    def drain(self) -> None:
        """Every operation here is synchronous: nothing in flight."""

    def submit(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
        """Run ``fn(*args, **kwargs)`` now and return its completed handle: an exchange that
        ``Communicator.submit`` would overlap with the next steps finishes before them here
        (its result is still applied when it would have been), so a failed exchange fails
        the period it belongs to."""
        return Handle.completed(fn(*args, **kwargs), op=op)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> None:
        """Sum (or average, ``op="avg"``) ``tensor`` over the quorum, in place, with gloo's
        ring all-reduce: the same bits on every replica (see the module docstring).

        Raises:
            ValueError: an op other than sum or avg.
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"QuorumComm.all_reduce supports sum and avg, got {op!r}")
        if self.world_size == 1:
            return
        in_place = tensor.is_contiguous()
        flat = tensor.view(-1) if in_place else tensor.reshape(-1).clone()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
        self.bytes_sent += flat.numel() * flat.element_size()
        if self.on_issue is not None:
            self.on_issue()
        work = self.process_group.allreduce([flat], opts)
        self.process_group.wait(work)
        if not in_place:
            tensor.copy_(flat.view_as(tensor))
        if op == "avg":
            tensor.div_(self.world_size)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every replica's ``input`` into ``output``, in quorum rank order."""
        parts = list(output.chunk(self.world_size))
        self.bytes_sent += input.numel() * input.element_size()
        if self.on_issue is not None:
            self.on_issue()
        work = self.process_group.allgather([parts], [input], AllgatherOptions())
        self.process_group.wait(work)
