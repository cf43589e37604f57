"""Training runs: the loop on each rank, strategies, checkpoints, metrics, ``train``/``compare``."""

from commfuse.train.loop import TrainConfig, params_digest, train_rank
from commfuse.train.strategy import (
    ParsedStrategy,
    Strategy,
    StrategyContext,
    known_strategies,
    parse_strategy,
    register_strategy,
)

__all__ = [
    "ParsedStrategy",
    "Strategy",
    "StrategyContext",
    "TrainConfig",
    "known_strategies",
    "params_digest",
    "parse_strategy",
    "register_strategy",
    "train_rank",
]
