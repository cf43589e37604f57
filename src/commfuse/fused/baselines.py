"""The collectives the unfused references call: the best unfused code commfuse has.

A fused operator is only as good as the baseline it is measured against. gloo's own collectives
are not always the best unfused choice (measured on the emulated cluster, 4 hosts at 1 Gbit/s):

* its reduce-scatter costs as much as its all-reduce (8 MB: 112 ms, where commfuse's ring takes
  64 ms), so the sequence-parallel references use commfuse's ``algo="auto"``, which picks the
  ring there;
* its all-to-all posts every message at once and reached 63-69% of the link, where commfuse's
  pairwise exchange (one peer per step) reached 85-89%: 1.26x faster at 4 MB, 1.40x at 32 MB.
  ``auto`` picks pairwise from 2 MB on shaped multi-host layouts (``tuner.
  UNCALIBRATED_NATIVE_ALL_TO_ALL``) but keeps gloo's on loopback and below; the all-to-all
  references name ``"pairwise"`` so that every layout and size times the same exchange.

These are read at call time, so a test can pin ``"native"`` to count bytes under gloo's names.
"""

from __future__ import annotations

#: AllGather and ReduceScatter of the sequence-parallel references.
SEQUENCE = "auto"
#: All-to-All of the embedding, DLRM and MoE references.
ALL_TO_ALL = "pairwise"
