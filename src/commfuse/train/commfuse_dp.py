"""Strategies on commfuse's own engine, ``commfuse.ddp.DataParallel``.

* ``commfuse``: DataParallel without compression (buckets as torch DDP lays them out, reduced
  with commfuse collectives, ``algo=auto`` by default, launched during backward).
* one strategy per compressor of ``commfuse.compress`` (``fp16``, ``bf16``, ``int8``, ``qsgd``,
  ``terngrad``, ``sign``, ``ef-sign``, ``topk``, ``randomk``, ``randblock``, ``dgc``,
  ``powersgd``): DataParallel with ``make_compressor(spec)`` reducing every bucket, so the spec's
  options are the compressor's own (``powersgd:rank=4,warmup=10``, ``topk:ratio=0.01``), the
  collectives its messages ride (``algo=native``, ``gather_algo=ring``; default ``auto``), plus
  the engine's ``staleness`` (``powersgd:rank=4,staleness=1``: each step applies the previous
  step's averaged gradient, its communication hidden behind this step's compute; Pipe-SGD).

Bytes per step are what DataParallel's communicator counted: exact point-to-point bytes for
commfuse's own algorithms plus the payload handed to native collectives. State for a checkpoint
is ``DataParallel.engine_state_dict()``: step counter, bucket layout, compressor state
(error-feedback residuals, PowerSGD's Q, DGC's momentum), so a resume is bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.train.strategy import (
    Strategy,
    StrategyContext,
    StrategyInfo,
    register_fallback,
    register_strategy,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommfuseOptions:
    """Options of ``commfuse`` (uncompressed DataParallel)."""

    algo: str = "auto"
    """Allreduce algorithm of every bucket (auto = the tuner's pick per size and topology)."""
    merge: bool = False
    """Re-bucket after the first step by MG-WFBP's cost model (merge_buckets_by_cost)."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket launched, MiB."""
    staleness: int = 0
    """1: apply each step's averaged gradient at the next step (DataParallelConfig.staleness)."""


class CommfuseDP(Strategy):
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


def _commfuse(opts: CommfuseOptions, ctx: StrategyContext) -> Strategy:
    return CommfuseDP(
        ctx,
        algo=opts.algo,
        merge_buckets_by_cost=opts.merge,
        first_bucket_cap_mb=opts.first_bucket_cap_mb,
        staleness=opts.staleness,
    )


#: Keys of a compressor strategy's spec that configure the engine, not the compressor.
ENGINE_KEYS = ("staleness",)


def split_engine_options(spec: str) -> tuple[str, dict[str, Any]]:
    """``"powersgd:rank=4,staleness=1"`` -> ``("powersgd:rank=4", {"staleness": 1})``."""
    from commfuse.compress.spec import parse_spec

    name, options = parse_spec(spec)
    engine: dict[str, Any] = {}
    for key in ENGINE_KEYS:
        if key in options:
            text = options.pop(key)
            try:
                engine[key] = int(text)
            except ValueError:
                raise ValueError(f"{name}: {key} must be an integer, got {text!r}") from None
    rest = ",".join(f"{k}={v}" for k, v in options.items())
    return (f"{name}:{rest}" if rest else name), engine


#: Keys of a compressor strategy's spec that pick the collectives its messages ride
#: (``make_compressor``'s keyword arguments; ``auto``, the tuner's pick, by default).
ALGO_KEYS = ("algo", "gather_algo")


def _build_compressor(spec: str) -> tuple[Any, dict[str, Any]]:
    """The compressor of ``spec`` and the engine options given in it."""
    from commfuse.collectives.registry import check_algorithm
    from commfuse.compress import make_compressor
    from commfuse.compress.spec import parse_spec

    compressor_spec, engine = split_engine_options(spec)
    name, options = parse_spec(compressor_spec)
    algos = {key: options.pop(key) for key in ALGO_KEYS if key in options}
    for key, algo in algos.items():
        try:
            check_algorithm("all_reduce" if key == "algo" else "all_gather", algo, key=key)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    rest = ",".join(f"{k}={v}" for k, v in options.items())
    return make_compressor(f"{name}:{rest}" if rest else name, **algos), engine


def _compressed(spec: str, ctx: StrategyContext) -> Strategy:
    compressor, engine = _build_compressor(spec)
    return CommfuseDP(ctx, compressor=compressor, **engine)


def _validate_compressor(spec: str) -> None:
    from commfuse.ddp import DataParallelConfig

    _, engine = _build_compressor(spec)  # ValueError naming the known keys
    DataParallelConfig(**engine)  # ValueError on a bad staleness


def _compressor_names() -> list[str]:
    try:
        from commfuse.compress import COMPRESSORS
    except ImportError:  # the compressors are an optional layer for this registry
        return []
    return [name for name in COMPRESSORS if name != "none"]


def _compressor_info(name: str) -> StrategyInfo:
    return StrategyInfo(
        name=name,
        options_cls=None,
        builder=_compressed,
        help=f"commfuse DataParallel + the {name} compressor",
        validate=_validate_compressor,
    )


register_strategy(
    "commfuse", CommfuseOptions, _commfuse, help="commfuse DataParallel, uncompressed (algo=auto)"
)
register_fallback(_compressor_names, _compressor_info)
