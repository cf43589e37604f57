"""Two-level (hierarchical) all-reduce and broadcast: fast links inside a host, slow ones across.

On H hosts of L ranks each (P = HL), a flat ring all-reduce sends ``2((P-1)/P) n`` bytes over
every ring link, host links included: on 2 hosts x 2 ranks each host link carries 1.5 n where
two levels need only n (Wang et al., arXiv 1611.04255).

**Allreduce, 2D** (``intra_algo="ring"``, the default): the 2D-torus all-reduce of Mikami et al.
("Massively Distributed SGD: ImageNet/ResNet-50 Training in a Flash", arXiv 1811.05233), as in
Horovod's hierarchical all-reduce over NCCL:

1. Reduce-scatter inside each host (in-place ring over loopback): local rank l ends with shard
   l, 1/L of the buffer, reduced over its host.
2. Allreduce of shard l across hosts among the H ranks of local rank l (``inter_algo``, a ring
   by default). The L all-reduces run at once and share each host link, which carries
   ``2((H-1)/H) n`` bytes in all: n for 2 hosts, under 2 n for any H.
3. Allgather inside each host (in-place ring): every rank ends with all L reduced shards.

**Cost** (``cost.hierarchical_all_reduce``): with m = n / C and beta_e multiplied by L (L flows
share a host link), ``rs + x + ag + (C - 1) max(x, rs + ag)``, where
``rs = (L-1) alpha_i + ((L-1)/L) m (beta_i + gamma)``, ``ag = (L-1) alpha_i + ((L-1)/L) m beta_i``,
``x = 2(H-1) alpha_e + 2((H-1)/H) m beta_e + ((H-1)/H)(m/L) gamma``. For large n it tends to
``2((H-1)/H) n beta_e``, against ``2((P-1)/P) n beta_e`` for the flat ring.

**Broadcast** from root r on host h with local rank l: among the ranks of local rank l from host
h (``inter_algo``, default ``"pipeline"``), then inside every host (``intra_algo``, ``"tree"``).

Design notes: ``docs/collectives.md``, "Hierarchical collectives: pipelining, tuning, the leader
variant, the layout".
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from commfuse.collectives.blocks import even_blocks
from commfuse.collectives.cost import hierarchical_num_chunks
from commfuse.collectives.registry import Collective, algorithms_for, label, register

# The ring's in-place phases work on any block layout of a buffer; the 2D all-reduce runs them on
# the shards of each chunk (the public ring functions would copy the whole input first).
from commfuse.collectives.ring import _gather_phase, _reduce_phase, _segments_for
from commfuse.comm import Communicator, Handle, ReduceOpName

_NAME = "hierarchical"
#: ``intra_algo`` of the 2D all-reduce; any reduce/broadcast name selects the leader scheme.
_TWO_D = "ring"

#: Host messages of the 2D all-reduce when ``num_segments`` is not given (see Tuning).
HOST_SEGMENT_BYTES = 1 << 20
#: Cross-host all-reduces in flight while the host phases run (see Tuning).
_LAG = 1


def ranks_per_host_of(comm: Communicator, ranks_per_host: int | None) -> int:
    """The host size to use: the option (ValueError if it does not divide the group), else
    ``CommConfig.ranks_per_host`` (ignored with a warning if it does not divide the group),
    else 1."""
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
    local = comm.config.ranks_per_host or 1
    if size % local:
        warnings.warn(
            f"CommConfig.ranks_per_host={local} does not divide the group size {size} of "
            f"{comm.name!r}; hierarchical collectives run flat. Pass ranks_per_host= to set "
            "the layout.",
            stacklevel=3,
        )
        return 1
    return local


class HostGroups:
    """The sub-communicators a communicator's hierarchical collectives run on, created once
    (``comm.owned(HostGroups)``): they live as long as the communicator they split."""

    def __init__(self, comm: Communicator) -> None:
        self.levels: dict[int, tuple[Communicator, Communicator]] = {}
        """Per host size: (my host's group, the group of my local rank on every host)."""
        self.flat: Communicator | None = None
        """The same group under a second communicator, for the flat path's accounting."""


def host_levels(comm: Communicator, ranks_per_host: int) -> tuple[Communicator, Communicator]:
    """(my host's group, the group of my local rank on every host), created once per
    (communicator, ``ranks_per_host``) and kept on ``comm``; a collective call the first time
    (every rank of ``comm`` must make it)."""
    cached = comm.owned(HostGroups).levels
    if ranks_per_host not in cached:
        intra, inter = comm.split_by_host(ranks_per_host)
        # The sub-groups are ours alone: share the parent's trace so one timeline shows all.
        intra.trace = inter.trace = comm.trace
        cached[ranks_per_host] = (intra, inter)
    return cached[ranks_per_host]


def _flat(comm: Communicator) -> Communicator:
    """A second communicator over the same group (no new group is created), so the flat path's
    traffic can be charged to the hierarchical label like the two-level path's."""
    groups = comm.owned(HostGroups)
    if groups.flat is None:
        groups.flat = Communicator(comm.group, config=comm.config, name=comm.name)
        groups.flat.trace = comm.trace
    return groups.flat


@contextlib.contextmanager
def _charged(comm: Communicator, kind: str, *subs: Communicator) -> Iterator[None]:
    """Count the sub-communicators' traffic inside the block as ``comm.stats[kind]``."""
    for sub in subs:
        sub.stats.reset()
    try:
        yield
    finally:
        for sub in subs:
            inner = sub.stats.total()
            inner.handed_bytes = 0  # the front door counted the caller's buffer once already
            comm.stats[kind].add(inner)


def _algorithm(collective: Collective, name: str, what: str) -> Any:
    table = algorithms_for(collective)
    if name == _NAME or name not in table:
        choices = ", ".join(sorted(n for n in table if n != _NAME))
        raise ValueError(
            f"{what}={name!r} is not a registered {collective} algorithm: use one of {choices}"
        )
    return table[name]


def _sum_for_avg(op: ReduceOpName) -> ReduceOpName:
    # The front door divides once at the end; a native step given "avg" would divide again.
    return "sum" if op == "avg" else op


Block = tuple[int, int]


def _two_d(
    intra: Communicator,
    inter: Communicator,
    buf: torch.Tensor,
    op: ReduceOpName,
    inter_algo: str,
    num_chunks: int | None,
    opts: dict[str, Any],
) -> None:
    """Reduce-scatter in the host, all-reduce across hosts, all-gather in the host; pipelined."""
    tag, mine, size = label("all_reduce", _NAME), intra.rank, buf.element_size()
    if num_chunks is None:
        num_chunks = hierarchical_num_chunks(
            buf.numel() * size, intra.world_size * inter.world_size
        )
    elif isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    inter_fn = algorithms_for("all_reduce")[inter_algo]
    segments_opt = opts.get("num_segments")
    queued: collections.deque[tuple[Block, Handle]] = collections.deque()

    def shards(chunk: Block) -> list[Block]:
        start, stop = chunk
        return [(start + a, start + b) for a, b in even_blocks(stop - start, intra.world_size)]

    def host_phase(chunk: Block, reduce: bool) -> None:
        blocks = shards(chunk)
        if segments_opt is None:  # loopback: large messages cost the least CPU (see Tuning)
            largest = (blocks[0][1] - blocks[0][0]) * size
            segments = max(1, math.ceil(largest / HOST_SEGMENT_BYTES))
        else:
            segments = _segments_for(segments_opt, blocks, size)
        if reduce:  # shift -1: local rank l ends with shard l reduced over the host
            _reduce_phase(intra, buf, blocks, op, segments, -1, tag)
        else:
            _gather_phase(intra, buf, blocks, segments, 0, tag)

    def across(chunk: Block, last: bool) -> Handle:
        # Every rank of the cross-host group has my local rank, hence my shard sizes.
        start, stop = shards(chunk)[mine]
        if stop == start:
            return Handle.completed()
        if inter_algo == "native":  # gloo's ring on its own threads: no Python in the way
            handle = inter.all_reduce(buf[start:stop], op, async_op=True)
            assert handle is not None
            return handle
        if last and not queued:  # nothing to overlap with: skip the thread hop
            inter_fn(inter, buf[start:stop], op, **opts)
            return Handle.completed()
        return inter.submit(f"{tag} (across hosts)", inter_fn, inter, buf[start:stop], op, **opts)

    # Host phases run here in the order RS(0), RS(1), AG(0), RS(2), AG(1), ...; cross-host
    # all-reduces in chunk order, on their own thread: the same order on every rank.
    for chunk in (c for c in even_blocks(buf.numel(), num_chunks) if c[1] > c[0]):
        last = chunk[1] == buf.numel()
        host_phase(chunk, True)
        queued.append((chunk, across(chunk, last)))
        while queued and (len(queued) > _LAG or last):
            done, handle = queued.popleft()
            handle.wait()
            host_phase(done, False)


@register("all_reduce", _NAME)
def hierarchical_all_reduce(
    comm: Communicator,
    buf: torch.Tensor,
    op: ReduceOpName,
    *,
    ranks_per_host: int | None = None,
    inter_algo: str | None = None,
    intra_algo: str = _TWO_D,
    num_chunks: int | None = None,
    **opts: Any,
) -> None:
    """2D all-reduce (``intra_algo="ring"``) or leader-based (a reduce/broadcast name)."""
    if inter_algo is None:
        inter_algo = "ring" if "ring" in algorithms_for("all_reduce") else "pipeline"
    inter_fn = _algorithm("all_reduce", inter_algo, "inter_algo")
    if intra_algo != _TWO_D and intra_algo not in algorithms_for("reduce"):
        choices = ", ".join(sorted({_TWO_D, *algorithms_for("reduce")} - {_NAME}))
        raise ValueError(
            f"intra_algo={intra_algo!r} is neither {_TWO_D!r} (2D) nor a registered reduce "
            f"algorithm (leader-based): use one of {choices}"
        )
    op = _sum_for_avg(op)
    kind = label("all_reduce", _NAME)
    local = ranks_per_host_of(comm, ranks_per_host)
    if local in (1, comm.world_size):
        flat = _flat(comm)
        with _charged(comm, kind, flat):
            inter_fn(flat, buf, op, **opts)
        return
    intra, inter = host_levels(comm, local)
    with _charged(comm, kind, intra, inter):
        if intra_algo == _TWO_D:
            _two_d(intra, inter, buf, op, inter_algo, num_chunks, opts)
            return
        _algorithm("reduce", intra_algo, "intra_algo")(intra, buf, 0, op, **opts)
        if intra.rank == 0:
            inter_fn(inter, buf, op, **opts)
        _algorithm("broadcast", intra_algo, "intra_algo")(intra, buf, 0, **opts)


@register("broadcast", _NAME)
def _hierarchical_broadcast(
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
    intra, inter = host_levels(comm, local)
    root_host, root_local = divmod(root, local)
    with _charged(comm, kind, intra, inter):
        if intra.rank == root_local:
            inter_fn(inter, buf, root_host, **opts)
        intra_fn(intra, buf, root_local, **opts)
