"""The collectives the unfused references call by default: the best unfused code commfuse has.

A fused operator is only as good as the baseline it is measured against, and gloo's own
collectives are not always the best unfused choice:

* its reduce-scatter is an all-reduce followed by a slice, so it costs as much as the
  all-reduce, twice the ring reduce-scatter's bytes; the sequence-parallel references use
  commfuse's ``algo="auto"``, which picks the ring there;
* its all-to-all posts every message at once, which floods the first receivers of a shaped
  link, where commfuse's pairwise exchange (one peer per step, Thakur et al. 2005) keeps every
  link busy with one stream. ``auto`` picks pairwise for large messages on shaped multi-host
  layouts (``profile.UNCALIBRATED_NATIVE_ALL_TO_ALL``) but keeps gloo's on loopback and for small
  ones; the all-to-all references name ``"pairwise"`` so that every layout and size times the
  same exchange.

Its all-reduce is already a ring, so GEMM + AllReduce's reference calls it as it is where the
ranks form one level. Where they fill several hosts of several ranks each, a flat ring crosses
each host link with ``2 (P - 1) / P`` of the message, where commfuse's hierarchical all-reduce
(reduce-scatter inside the host, all-reduce across hosts, all-gather inside the host,
``collectives/hierarchical.py``) crosses it with ``2 (H - 1) / H`` of ``1 / L`` of it; the
reference takes the hierarchical one there from ``HIERARCHICAL_MIN_BYTES`` up, below which its
two extra intra-host phases cost more than the link time they save
(``all_reduce_algo``; the measurements: ``benchmarks/allreduce-hierarchical_*`` and the
``unfused hierarchical`` rows of ``benchmarks/fused-gemm-all-reduce_netlab-2x2x1gbit-*``).

A caller who wants another sequence-parallel reference (``"native"`` counts its bytes under the
backend's collective names) says so: the linears take ``ChunkConfig(reference_algo=...)``, the
operators a ``reference_algo`` argument.
"""

from __future__ import annotations

from typing import Final, Literal

#: AllGather and ReduceScatter of the sequence-parallel references.
SEQUENCE: Final = "auto"
#: All-to-All of the embedding, DLRM and MoE references.
ALL_TO_ALL: Final = "pairwise"
#: Smallest GEMM + AllReduce output (bytes) whose reference all-reduces in two levels on a
#: two-level layout.
HIERARCHICAL_MIN_BYTES: Final = 2 << 20


def all_reduce_algo(
    nbytes: int, world_size: int, ranks_per_host: int
) -> Literal["native", "hierarchical"]:
    """The all-reduce of GEMM + AllReduce's unfused reference: ``"hierarchical"`` for messages
    of at least ``HIERARCHICAL_MIN_BYTES`` where the ranks fill several hosts of several ranks
    (``1 < ranks_per_host < world_size``), else the backend's own (``"native"``)."""
    two_level = 1 < ranks_per_host < world_size and world_size % ranks_per_host == 0
    return "hierarchical" if two_level and nbytes >= HIERARCHICAL_MIN_BYTES else "native"
