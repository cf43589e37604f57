"""Training runs: the loop on each rank, strategies, checkpoints, metrics (``commfuse train``)."""

from commfuse.train.loop import TrainConfig, params_digest, train_rank
from commfuse.train.lr_schedule import (
    ConstantSchedule,
    CosineSchedule,
    LRSchedule,
    StepSchedule,
)
from commfuse.train.strategy import (
    CommfuseDPConfig,
    Strategy,
    StrategyConfig,
    StrategyContext,
    TorchDDPConfig,
    TorchPowerSGDConfig,
    build_strategy,
    describe_strategy,
    register_builder,
)

__all__ = [
    "CommfuseDPConfig",
    "ConstantSchedule",
    "CosineSchedule",
    "LRSchedule",
    "StepSchedule",
    "Strategy",
    "StrategyConfig",
    "StrategyContext",
    "TorchDDPConfig",
    "TorchPowerSGDConfig",
    "TrainConfig",
    "build_strategy",
    "describe_strategy",
    "params_digest",
    "register_builder",
    "train_rank",
]
