"""The gradient exchange of a replica group of several ranks: hierarchical, through torchft.

A replica group of G ranks is one failure unit (one emulated host, usually): its ranks train
torch DDP among themselves on an ordinary process group (the intra-group one, over the host's
loopback), and every rank has its own torchft ``Manager`` with ``rank=group_rank``,
``world_size=G``, as torchft's HSDP-style setup has it: group rank i of every replica group
meets group rank i of the others in the cross-group process group that its Manager
reconfigures at each quorum, and the lighthouse sees replica groups. Each bucket is averaged
over all ranks of the quorum's groups in three steps (the hierarchical allreduce of
Horovod's and NCCL's two-level schemes):

1. divide the bucket by ``G x participants`` (the ranks that train; as torch DDP divides by
   the world size before its sum) and reduce-scatter it inside the group: rank i holds the
   group's sum of shard i (the bucket padded to a multiple of G, cut in G equal shards);
2. allreduce shard i across the quorum's groups, on group rank i's cross-group process
   group, through ``QuorumComm`` (watching the quorum's alarm, counting the bytes); a replica
   group that is not participating (still recovering) contributes zeros;
3. all-gather the shards inside the group: every rank holds the whole average.

Each rank sends ``1 / G`` of the bucket across groups (``2 (n - 1) / n`` of its shard in
gloo's ring over n groups) instead of the whole bucket: the slow links between hosts carry G
times less per rank, the fast loopback inside a host carries the rest. The intra-group steps
run on every rank whatever happens, so that the ranks of a group stay matched; only the
cross-group allreduce is skipped once this rank's Manager recorded an error (the step will
not commit: ``should_commit`` is a vote of every rank of every group). A failure of step 2
is reported to this rank's Manager, which refuses the group's commit, and raises group rank
i's alarm, so that the other groups' rank i give up at once; their other ranks finish their
shards and are outvoted at the commit.

Design notes: ``docs/reliability.md``, "Replica groups of several ranks: the compressed exchange".
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from commfuse.compress.layout import BucketLayout
from commfuse.ft.group_comm import GroupQuorumComm, padded_to_shards
from commfuse.ft.hook import FTHookState, bucket_issue, report_failure
from commfuse.ft.quorum_comm import QuorumComm


@dataclasses.dataclass(kw_only=True)
class GroupHookState:
    """What ``group_allreduce_hook`` needs."""

    comm: QuorumComm
    """The quorum's communicator over this group rank's cross-group process group, which its
    Manager drives."""
    group: dist.ProcessGroup
    """The replica group's own process group (its G ranks)."""
    group_size: int
    """G: ranks in the replica group."""
    manager: Any = None
    """torchft's ``Manager`` of this rank (set before the first synchronised step)."""
    on_issue: Callable[[int], None] | None = None
    """Called with the bucket index as its cross-group allreduce is about to be handed to
    gloo (faults: ``QuorumComm.on_issue``)."""
    local: bool = False
    """Average inside the group only, nothing across groups: a restarted group's first
    backward, which only lets DDP lay out its buckets as its peers did."""
    bytes_sent: int = 0
    """Bytes handed to the cross-group allreduce so far (this rank's shards)."""
    group_rank: int = 0
    """This rank's place in the group."""
    compression: FTHookState | None = None
    """The compressor, its parameters' names and steps (the flat hook's state, which the
    replica loop saves and restores); None: the plain sum."""


def group_allreduce_hook(
    state: GroupHookState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over every rank of the quorum's replica groups (see the module
    docstring).

    Args:
        state: the Manager, both process groups and the fault-injection callback.
        bucket: DDP's bucket of gradients.

    Returns:
        A completed future holding the averaged bucket; never an error (a failure goes to
        the Manager).
    """
    if state.compression is not None and state.compression.compressor is not None:
        return _compressed(state, state.compression, bucket)
    buffer = bucket.buffer()
    manager = state.manager
    size = state.group_size
    participants = 1 if state.local else manager.num_participants()
    if not state.local and not manager.is_participating():
        buffer.zero_()
    buffer.div_(size * max(participants, 1))
    padded, shard = padded_to_shards(buffer, size)
    mine = buffer.new_empty(shard)
    # Step 1 (gloo's reduce-scatter sums the whole tensor, then keeps the slice).
    dist.reduce_scatter_tensor(mine, padded, group=state.group)
    if not state.local and not manager.errored():
        comm, before = state.comm, state.comm.bytes_sent
        try:
            with bucket_issue(comm, state.on_issue, bucket.index()):
                comm.all_reduce(mine)  # step 2
        except Exception as error:
            report_failure(manager, comm, error)
        finally:
            state.bytes_sent += comm.bytes_sent - before
    dist.all_gather_into_tensor(padded, mine, group=state.group)
    buffer.copy_(padded[: buffer.numel()])
    return _done(buffer)


def _compressed(
    state: GroupHookState, compression: FTHookState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The bucket averaged inside the group, then through the compressor across groups, its
    messages split among the group's ranks (see the module docstring)."""
    compressor = compression.compressor
    assert compressor is not None
    buffer, manager = bucket.buffer(), state.manager
    dist.all_reduce(buffer, group=state.group)
    buffer.div_(state.group_size)
    if state.local:
        return _done(buffer)
    if not manager.is_participating():
        buffer.zero_()
    # The bucket's layout and step, as the flat hook files them (hook._compressed).
    names = tuple(compression.names[id(p)] for p in bucket.parameters())
    layout = BucketLayout(names=names, shapes=tuple(g.shape for g in bucket.gradients()))
    step = max((compression.steps.get(name, 0) for name in names), default=0)
    for name in names:
        compression.steps[name] = step + 1
    index = bucket.index()
    compressor.set_layout(index, layout)
    comm = GroupQuorumComm(state.comm, state.group, state.group_rank, state.group_size)
    comm.manager = manager
    before = state.comm.bytes_sent
    try:
        # Every rank of the group runs it whatever happened: its in-group gathers pair up;
        # a cross-group failure went to the Manager, and the step will not commit.
        with bucket_issue(state.comm, state.on_issue, index):
            compressor.reduce_(comm, buffer, bucket=index, step=step)  # type: ignore[arg-type]
    finally:
        state.bytes_sent += state.comm.bytes_sent - before
    return _done(buffer)


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
