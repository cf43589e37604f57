"""Layer 3: computation fused with the collective that depends on it (Punniyamurthy, Hamidouche
and Beckmann, SC24, arXiv 2305.06942).

Each operator computes its result in chunks and starts the collective of chunk ``i`` while chunk
``i + 1`` is computed. One file per operator, each with its exact unfused reference and its
backward; ``chunking.py`` holds the cost model that picks the number of chunks, ``ops.py`` the
``torch.ops.commfuse.*`` registrations, ``linear.py`` Megatron's linear pair, ``modules.py``
the embedding module and ``moe.py`` the expert-parallel one. ``linear_attention.py``,
``lasp.py`` and ``lasp2.py`` hold causal linear attention and its two sequence-parallel
forms, which pass a key-value state between ranks instead of chunks of a product. The functions
live in their operator's module (``commfuse.fused.gemm_all_reduce.gemm_all_reduce``), which
keeps those names for the modules.
"""

from commfuse.fused.chunking import ChunkConfig, choose_chunks, predict_us
from commfuse.fused.linear import ColumnParallelLinear, RowParallelLinear
from commfuse.fused.modules import ShardedEmbeddingBag
from commfuse.fused.moe import ExpertParallelMoE

__all__ = [
    "ChunkConfig",
    "ColumnParallelLinear",
    "ExpertParallelMoE",
    "RowParallelLinear",
    "ShardedEmbeddingBag",
    "choose_chunks",
    "predict_us",
]
