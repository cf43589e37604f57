"""Layer 4: data-parallel training with bucketing, overlap and compression.

``DataParallel(module, comm, config=DataParallelConfig(...))`` averages gradients over ranks in
buckets launched during backward (``reducer.py``), laid out as torch DDP does (``buckets.py``)
or merged by the cost model (``merge.py``, MG-WFBP); ``bench.py`` times it against torch DDP.
"""

from commfuse.ddp.buckets import Bucket, assign_buckets
from commfuse.ddp.config import DataParallelConfig
from commfuse.ddp.merge import merge_by_cost
from commfuse.ddp.reducer import NonFiniteGradientError, StepStats
from commfuse.ddp.wrapper import DataParallel

__all__ = [
    "Bucket",
    "DataParallel",
    "DataParallelConfig",
    "NonFiniteGradientError",
    "StepStats",
    "assign_buckets",
    "merge_by_cost",
]
