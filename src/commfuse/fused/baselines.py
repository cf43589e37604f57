"""The collectives the unfused references call by default: the best unfused code commfuse has.

A fused operator is only as good as the baseline it is measured against, and gloo's own
collectives are not always the best unfused choice:

* its reduce-scatter is an all-reduce followed by a slice, so it costs as much as the
  all-reduce, twice the ring reduce-scatter's bytes; the sequence-parallel references use
  commfuse's ``algo="auto"``, which picks the ring there;
* its all-to-all posts every message at once, which floods the first receivers of a shaped
  link, where commfuse's pairwise exchange (one peer per step, Thakur et al. 2005) keeps every
  link busy with one stream. ``auto`` picks pairwise for large messages on shaped multi-host
  layouts (``tuner.UNCALIBRATED_NATIVE_ALL_TO_ALL``) but keeps gloo's on loopback and for small
  ones; the all-to-all references name ``"pairwise"`` so that every layout and size times the
  same exchange.

(Its all-reduce is already a ring, so GEMM + AllReduce's reference calls it as it is.)

A caller who wants another sequence-parallel reference (``"native"`` counts its bytes under the
backend's collective names) says so: the linears take ``ChunkConfig(reference_algo=...)``, the
operators a ``reference_algo`` argument.
"""

from __future__ import annotations

from typing import Final

#: AllGather and ReduceScatter of the sequence-parallel references.
SEQUENCE: Final = "auto"
#: All-to-All of the embedding, DLRM and MoE references.
ALL_TO_ALL: Final = "pairwise"
