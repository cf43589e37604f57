"""Strategies on commfuse's own engine, ``commfuse.ddp.DataParallel`` (``CommfuseDPConfig``).

* ``CommfuseDPConfig()`` (``commfuse``): DataParallel without compression (buckets as torch DDP
  lays them out, reduced with commfuse collectives, ``algo=auto`` by default, launched during
  backward).
* ``CommfuseDPConfig(compressor=...)``, one command-line strategy per compressor of
  ``commfuse.compress`` (``fp16``, ``bf16``, ``int8``, ``qsgd``, ``terngrad``, ``sign``,
  ``ef-sign``, ``topk``, ``randomk``, ``randblock``, ``dgc``, ``powersgd``, ``acpsgd``):
  DataParallel with that compressor reducing every bucket, so the spec's keys are the
  compressor's own fields (``powersgd:rank=4,warmup=10``, ``topk:ratio=0.01``, the collectives
  its messages ride: ``algo=native``, ``gather_algo=ring``; default ``auto``), plus the engine's
  ``staleness`` (``powersgd:rank=4,staleness=1``: each step applies the previous step's averaged
  gradient, its communication hidden behind this step's compute; Pipe-SGD).

Bytes per step are what DataParallel's communicator counted: exact point-to-point bytes for
commfuse's own algorithms plus the payload handed to native collectives. State for a checkpoint
is ``DataParallel.engine_state_dict()``: step counter, bucket layout, compressor state
(error-feedback residuals, PowerSGD's Q, DGC's momentum), so a resume is bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.train.strategy import CommfuseDPConfig, Strategy, StrategyContext, register_builder


class _CommfuseDP(Strategy):
    """DataParallel from ``commfuse.ddp``, optionally with a compressor."""

    def __init__(self, ctx: StrategyContext, *, compressor: Any = None, **config: Any) -> None:
        from commfuse.ddp import DataParallel, DataParallelConfig

        super().__init__(ctx)
        self.dp = DataParallel(
            ctx.module,
            ctx.comm,
            config=DataParallelConfig(
                bucket_cap_mb=ctx.bucket_cap_mb, compressor=compressor, **config
            ),
        )

    @property
    def model(self) -> nn.Module:
        return self.dp

    def optimizer_step(self) -> bool:
        return self.dp.step(self.optimizer)

    def choices(self) -> dict[str, Any]:
        return self.dp.choices()

    def bytes_sent(self) -> int:
        # Bytes handed to collectives: what torch DDP's hooks are counted by (the exact wire
        # bytes of commfuse's own algorithms are in stats' bytes_sent).
        return self.comm.stats.total().handed_bytes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dp.no_sync():
            yield

    def state_dict(self) -> dict[str, Any]:
        return {"engine": self.dp.engine_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "engine" not in state:
            raise ValueError("checkpoint has no commfuse engine state")
        self.dp.load_engine_state_dict(state["engine"])

    def close(self) -> None:
        self.dp.close()


def _commfuse(config: CommfuseDPConfig, ctx: StrategyContext) -> Strategy:
    return _CommfuseDP(
        ctx,
        compressor=config.compressor,
        algo=config.algo,
        merge_buckets_by_cost=config.merge_buckets_by_cost,
        first_bucket_cap_mb=config.first_bucket_cap_mb,
        staleness=config.staleness,
    )


register_builder(CommfuseDPConfig, _commfuse)
