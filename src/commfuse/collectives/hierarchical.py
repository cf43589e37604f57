"""Two-level (hierarchical) allreduce and broadcast: fast links inside a host, slow ones across.

Wang et al., "Efficient Communications in Training Large Scale Neural Networks" (arXiv
1611.04255): on a cluster of H hosts with L ranks each, a flat algorithm sends L times as much
data over each host's network link as it has to. Doing the work in two levels sends every byte
across hosts once per host:

1. **Allreduce.** (a) Reduce inside each host to its leader (local rank 0) over loopback.
   (b) Allreduce among the H leaders over the network (``inter_algo``: ``"ring"`` when that
   family is installed, else ``"pipeline"``; any registered allreduce name works).
   (c) Broadcast inside each host from the leader. Cost
   ``reduce_intra(n, L) + allreduce_inter(n, H) + broadcast_intra(n, L)``.
2. **Broadcast** from root r on host h with local rank l: (a) broadcast among the ranks with
   local rank l, one per host, from host h (``inter_algo``, default ``"pipeline"``); (b) broadcast
   inside each host from its local rank l. The root's own host needs no extra intra-host step.

Intra-host steps use ``intra_algo`` (default ``"tree"``, the binomial tree; any registered
reduce/broadcast name works). Options given to the call (``block_bytes``) reach every step.

Layout: ``ranks_per_host`` (L) from the option, else ``LOCAL_WORLD_SIZE`` (the launcher's
torchrun contract), else 1; ranks are host-major (host h holds ranks hL .. hL + L - 1). With L = 1
or L = P there is only one level: the flat ``inter_algo`` runs on the whole group.

The sub-groups are created once per (communicator, L) and cached: creating a process group is
itself a collective, and costly. Their traffic is charged to the calling communicator's
``stats[label(collective, "hierarchical")]``, so one label holds everything the call sent.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from commfuse.collectives.registry import algorithms_for, label, register
from commfuse.comm import Communicator

_LEVELS: weakref.WeakKeyDictionary[Communicator, dict[int, tuple[Communicator, Communicator]]] = (
    weakref.WeakKeyDictionary()
)
_FLAT: weakref.WeakKeyDictionary[Communicator, Communicator] = weakref.WeakKeyDictionary()
_NAME = "hierarchical"


def ranks_per_host_of(comm: Communicator, ranks_per_host: int | None) -> int:
    """The host size to use: the option (ValueError if it does not divide the group), else
    ``LOCAL_WORLD_SIZE`` (ignored with a warning if it does not divide the group), else 1."""
    size = comm.world_size
    if ranks_per_host is not None:
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int):
            raise ValueError(f"ranks_per_host must be an int, got {ranks_per_host!r}")
        if ranks_per_host < 1 or size % ranks_per_host:
            raise ValueError(
                f"ranks_per_host={ranks_per_host} must divide the group size {size} "
                "(ranks are host-major: every host holds the same number of ranks)"
            )
        return ranks_per_host
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local < 1 or size % local:
        warnings.warn(
            f"LOCAL_WORLD_SIZE={local} does not divide the group size {size}; hierarchical "
            "collectives run flat. Pass ranks_per_host= to set the layout.",
            stacklevel=3,
        )
        return 1
    return local


def _levels(comm: Communicator, ranks_per_host: int) -> tuple[Communicator, Communicator]:
    """(my host's group, the group of my local rank on every host), created once and cached."""
    cached = _LEVELS.setdefault(comm, {})
    if ranks_per_host not in cached:
        intra, inter = comm.split_by_host(ranks_per_host)
        # The sub-groups are ours alone: share the parent's trace so one timeline shows all.
        intra.trace = inter.trace = comm.trace
        cached[ranks_per_host] = (intra, inter)
    return cached[ranks_per_host]


def _flat(comm: Communicator) -> Communicator:
    """A second communicator over the same group (no new group is created), so the flat path's
    traffic can be charged to the hierarchical label like the two-level path's."""
    view = _FLAT.get(comm)
    if view is None:
        view = Communicator(comm.group, config=comm.config, name=comm.name)
        view.trace = comm.trace
        _FLAT[comm] = view
    return view


@contextlib.contextmanager
def _charged(comm: Communicator, kind: str, *subs: Communicator) -> Iterator[None]:
    """Count the sub-communicators' traffic inside the block as ``comm.stats[kind]``."""
    for sub in subs:
        sub.stats.reset()
    try:
        yield
    finally:
        for sub in subs:
            comm.stats[kind].add(sub.stats.total())


def _algorithm(collective: str, name: str, what: str) -> Any:
    table = algorithms_for(collective)
    if name == _NAME or name not in table:
        choices = ", ".join(sorted(n for n in table if n != _NAME))
        raise ValueError(
            f"{what}={name!r} is not a registered {collective} algorithm: use one of {choices}"
        )
    return table[name]


def _sum_for_avg(op: str) -> str:
    # The front door divides once at the end; a native step given "avg" would divide again.
    return "sum" if op == "avg" else op


@register("allreduce", _NAME)
def hierarchical_allreduce(
    comm: Communicator,
    buf: torch.Tensor,
    op: str,
    *,
    ranks_per_host: int | None = None,
    inter_algo: str | None = None,
    intra_algo: str = "tree",
    **opts: Any,
) -> None:
    """Reduce in each host, allreduce among host leaders, broadcast in each host."""
    if inter_algo is None:
        inter_algo = "ring" if "ring" in algorithms_for("allreduce") else "pipeline"
    inter_fn = _algorithm("allreduce", inter_algo, "inter_algo")
    reduce_fn = _algorithm("reduce", intra_algo, "intra_algo")
    bcast_fn = _algorithm("broadcast", intra_algo, "intra_algo")
    op = _sum_for_avg(op)
    kind = label("allreduce", _NAME)
    local = ranks_per_host_of(comm, ranks_per_host)
    if local in (1, comm.world_size):
        flat = _flat(comm)
        with _charged(comm, kind, flat):
            inter_fn(flat, buf, op, **opts)
        return
    intra, inter = _levels(comm, local)
    with _charged(comm, kind, intra, inter):
        reduce_fn(intra, buf, 0, op, **opts)
        if intra.rank == 0:
            inter_fn(inter, buf, op, **opts)
        bcast_fn(intra, buf, 0, **opts)


@register("broadcast", _NAME)
def hierarchical_broadcast(
    comm: Communicator,
    buf: torch.Tensor,
    root: int,
    *,
    ranks_per_host: int | None = None,
    inter_algo: str = "pipeline",
    intra_algo: str = "tree",
    **opts: Any,
) -> None:
    """Broadcast across hosts among the root's local rank, then inside every host."""
    inter_fn = _algorithm("broadcast", inter_algo, "inter_algo")
    intra_fn = _algorithm("broadcast", intra_algo, "intra_algo")
    kind = label("broadcast", _NAME)
    local = ranks_per_host_of(comm, ranks_per_host)
    if local in (1, comm.world_size):
        flat = _flat(comm)
        with _charged(comm, kind, flat):
            inter_fn(flat, buf, root, **opts)
        return
    intra, inter = _levels(comm, local)
    root_host, root_local = divmod(root, local)
    with _charged(comm, kind, intra, inter):
        if intra.rank == root_local:
            inter_fn(inter, buf, root_host, **opts)
        intra_fn(intra, buf, root_local, **opts)
