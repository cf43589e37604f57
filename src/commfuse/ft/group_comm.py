"""The quorum seen by a replica group of several ranks: every message split rank by rank.

A replica group of G ranks trains torch DDP inside itself, so after each step its ranks hold
the same parameters, and whatever they exchange with the other groups (DiLoCo's
pseudo-gradient, a compressor's messages) is the same on every rank of the group. Sending it
G times would waste the slow links between hosts; ``GroupQuorumComm`` sends it once, split
among the G ranks, as the hierarchical allreduce of ``group_hook.py`` does with a gradient
bucket. For each collective, on group rank i:

1. cut the message in G equal shards (padded with zeros to a multiple of G) and keep shard i;
2. exchange shard i across the quorum's replica groups, on group rank i's cross-group
   process group (``QuorumComm``: gloo's own collectives, every wait watching the quorum's
   alarm, every byte counted): a sum (``all_reduce``) or every group's shard i in quorum rank
   order (``all_gather``);
3. all-gather the G exchanged shards inside the group (over the host's loopback) and put the
   message back together.

Each rank sends ``1 / G`` of every message across groups; the sum of a shard over two groups
is the same in either order, so every rank ends with the bits a group of one rank would hold.
What runs on the message before it is exchanged (a compressor's error feedback, DiLoCo's outer
step after it) runs on every rank of the group alike: the same input, the same state, the
same bits.

A failure of step 2 (a peer group died, timed out, or raised the alarm) is reported to this
rank's Manager, which refuses the commit, and raises the alarm for the other groups' rank i;
once this rank's Manager recorded an error, step 2 is skipped. Steps 1 and 3 run on every rank
whatever happens: the ranks of a group stay matched in their collectives, and the message is
garbage that no committed step uses. Nothing here raises on a peer's failure: the caller
learns of it from the Manager at the commit vote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from commfuse.comm import CommConfig, Handle, ReduceOpName
from commfuse.ft.hook import report_failure
from commfuse.ft.quorum_comm import QuorumComm


def padded_to_shards(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``flat`` padded with zeros to ``group_size`` equal shards, and a shard's length (what
    one rank of the group sends across groups)."""
    size = -(-flat.numel() // group_size)
    padded = flat.new_zeros(size * group_size)
    padded[: flat.numel()].copy_(flat)
    return padded, size


class GroupQuorumComm:
    """The quorum's communicator for one rank of a replica group (see the module docstring).

    Args:
        cross: this group rank's communicator across the replica groups (its Manager's).
        group: the replica group's own process group.
        group_rank: this rank's place in the group.
        group_size: G, the ranks of the group.
    """

    name = "torchft-quorum-group"

    def __init__(
        self, cross: QuorumComm, group: dist.ProcessGroup, group_rank: int, group_size: int
    ) -> None:
        if not 0 <= group_rank < group_size:
            raise ValueError(f"group_rank {group_rank} is not a rank of a group of {group_size}")
        self.cross = cross
        self.group = group
        self.group_rank = group_rank
        self.group_size = group_size
        self.config = CommConfig()
        self.manager: Any = None
        """torchft's ``Manager`` of this rank (set before the first exchange)."""

    @property
    def rank(self) -> int:
        """This replica group's rank in the quorum."""
        return self.cross.rank

    @property
    def world_size(self) -> int:
        """Replica groups in the quorum."""
        return self.cross.world_size

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to the cross-group collectives so far (its shards)."""
        return self.cross.bytes_sent

    @property
    def process_group(self) -> Any:
        """The cross-group process group (its alarm)."""
        return self.cross.process_group

    def at_quorum(self, rank: int, world_size: int) -> None:
        """The quorum of the step about to run."""
        self.cross.at_quorum(rank, world_size)

    @contextlib.contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Steps are the Manager's to count; nothing to mark."""
        yield

    def drain(self) -> None:
        """Every operation here is synchronous: nothing in flight."""

    def submit(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
        """Run ``fn`` now (as ``QuorumComm.submit``: every exchange of a period has finished
        before its commit vote)."""
        return Handle.completed(fn(*args, **kwargs), op=op)

    def _shard(self, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Step 1: the message padded to G equal shards, and the shard's length."""
        return padded_to_shards(flat, self.group_size)

    def _across(self, exchange: Callable[[], None]) -> None:
        """Step 2, unless this rank's step already failed; a failure goes to the Manager."""
        if self.manager is not None and self.manager.errored() is not None:
            return
        try:
            exchange()
        except Exception as error:
            report_failure(self.manager, self.cross, error)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> None:
        """Sum (or average, ``op="avg"``) ``tensor`` over the quorum's replica groups, in
        place, each rank of the group exchanging its shard (see the module docstring).

        Raises:
            ValueError: an op other than sum or avg.
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"GroupQuorumComm.all_reduce supports sum and avg, got {op!r}")
        flat = tensor.reshape(-1)
        padded, size = self._shard(flat)
        mine = padded[self.group_rank * size : (self.group_rank + 1) * size].clone()
        self._across(lambda: self.cross.all_reduce(mine, op))
        dist.all_gather_single(padded, mine, group=self.group)
        tensor.copy_(padded[: flat.numel()].view_as(tensor))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every replica group's ``input`` into ``output``, in quorum rank order, each rank of
        the group gathering its shard of every group's ``input``."""
        flat = input.reshape(-1)
        numel, groups = flat.numel(), self.world_size
        padded, size = self._shard(flat)
        mine = padded[self.group_rank * size : (self.group_rank + 1) * size].contiguous()
        gathered = flat.new_zeros(groups * size)
        self._across(lambda: self.cross.all_gather(gathered, mine))
        every = flat.new_empty(self.group_size * groups * size)
        dist.all_gather_single(every, gathered, group=self.group)
        # [group rank][quorum rank][shard] -> [quorum rank][the whole message]
        whole = every.view(self.group_size, groups, size).transpose(0, 1)
        output.view(groups, numel).copy_(whole.reshape(groups, -1)[:, :numel])
