"""Binomial-tree (minimum spanning tree, MST) broadcast and reduce.

Wang et al., "Efficient Communications in Training Large Scale Neural Networks" (arXiv
1611.04255) and Thakur, Rabenseifner and Gropp ("Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005): the latency-optimal choice for small messages, and what gloo
runs for its own broadcast.

Ranks are renumbered relative to the root, ``v = (rank - root) mod P``, so any root and any P
work the same way. The parent of v != 0 is v with its lowest set bit cleared; the children of v
are v + m for every power of two m below v's lowest set bit (below 2^ceil(lg P) for the root)
with v + m < P. The root has ceil(lg P) children, and the tree is ceil(lg P) levels deep.

1. **Broadcast.** Every rank but the root receives the whole message from its parent, then sends
   it to its children, the one with the largest subtree first (it has the most forwarding left
   to do). Cost ``ceil(lg P)(alpha + n beta)``.
2. **Reduce.** The mirror image: every rank receives each child's partial result, the smallest
   subtree first (it is ready first), combines it into its own, and sends the total to its
   parent. The next child's receive is posted before the current one is combined, so the
   reduction overlaps the transfer. Non-root ranks combine into a copy, leaving their buffer
   unchanged. Cost ``ceil(lg P)(alpha + n (beta + gamma))``.

Every message carries the whole buffer, so the bandwidth term grows with lg P: for large
messages prefer the linear pipeline (``pipeline.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.collectives.reduce_ops import combine_
from commfuse.collectives.registry import label, register
from commfuse.comm import Communicator, ReduceOpName

_TAG = 21


def _tree_parent(vrank: int) -> int:
    """The parent of relative rank ``vrank`` (> 0): its lowest set bit cleared."""
    return vrank - (vrank & -vrank)


def _tree_children(vrank: int, size: int) -> list[int]:
    """Relative ranks of ``vrank``'s children in a binomial tree of ``size`` ranks, largest
    subtree first."""
    top = vrank & -vrank if vrank else 1 << (size - 1).bit_length()
    children = []
    step = top >> 1
    while step:
        if vrank + step < size:
            children.append(vrank + step)
        step >>= 1
    return children


@register("broadcast", "tree")
def _tree_broadcast(comm: Communicator, buf: torch.Tensor, root: int, **_: Any) -> None:
    """MST broadcast from ``root`` (see the module docstring)."""
    kind = label("broadcast", "tree")
    size = comm.world_size
    vrank = (comm.rank - root) % size
    if vrank:
        comm.recv(buf, (_tree_parent(vrank) + root) % size, tag=_TAG, label=kind)
    # One child at a time: sent together they would share the link, and the largest subtree,
    # which has the longest way still to go, would get its data later.
    for child in _tree_children(vrank, size):
        comm.send(buf, (child + root) % size, tag=_TAG, label=kind)


@register("reduce", "tree")
def _tree_reduce(
    comm: Communicator, buf: torch.Tensor, root: int, op: ReduceOpName, **_: Any
) -> None:
    """MST reduce into ``root``; non-root buffers are left unchanged (see the module docstring)."""
    kind = label("reduce", "tree")
    size = comm.world_size
    vrank = (comm.rank - root) % size
    children = [(c + root) % size for c in reversed(_tree_children(vrank, size))]
    acc = buf
    if children:
        acc = buf if vrank == 0 else buf.clone()
        # Two scratch buffers: one being combined while the next child's message arrives.
        scratch = [torch.empty_like(buf) for _ in range(min(2, len(children)))]
        pending = comm.irecv(scratch[0], children[0], tag=_TAG, label=kind)
        for j in range(len(children)):
            pending.wait()
            current = scratch[j % 2]
            if j + 1 < len(children):
                pending = comm.irecv(scratch[(j + 1) % 2], children[j + 1], tag=_TAG, label=kind)
            combine_(acc, current, op)
    if vrank:
        comm.send(acc, (_tree_parent(vrank) + root) % size, tag=_TAG, label=kind)
