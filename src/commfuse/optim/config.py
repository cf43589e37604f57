"""The configs of the compressed Adam optimizers: 1-bit Adam and 0/1 Adam.

Both are strategies of their own on the command line (``onebit-adam:freeze_step=100``,
``zeroone-adam:var_freeze_step=50``): the model is not wrapped in data parallel, the optimizer
does the communication (``commfuse.train.onebit``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

Exchange = Literal["onebit", "none"]
"""How the momentum (or the accumulated update) is averaged: the two-phase 1-bit allreduce with
error feedback, or an uncompressed fp32 allreduce (the exact reference)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """The settings of the exchanges both configs carry (what ``CompressedAdam`` reads): the
    1-bit allreduce's two phases and the full-precision allreduce."""

    exchange: Exchange = "onebit"
    """The exchange of the momentum (0/1 Adam: and of the accumulated update): ``onebit`` or
    ``none`` (fp32)."""
    all_to_all_algo: str = "auto"
    """commfuse all-to-all algorithm of the 1-bit allreduce's first phase."""
    all_gather_algo: str = "auto"
    """commfuse all-gather algorithm of the 1-bit allreduce's second phase."""
    algo: str = "auto"
    """commfuse allreduce algorithm of the full-precision averages (1-bit Adam's warm-up, 0/1
    Adam's variance steps, and ``none``)."""

    def __post_init__(self) -> None:
        from commfuse.collectives.registry import check_algorithm

        if self.exchange not in ("onebit", "none"):
            raise ValueError(f"exchange must be onebit or none, got {self.exchange!r}")
        check_algorithm("all_to_all", self.all_to_all_algo, key="all_to_all_algo")
        check_algorithm("all_gather", self.all_gather_algo, key="all_gather_algo")
        check_algorithm("all_reduce", self.algo, key="algo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBitAdamConfig(ExchangeConfig):
    """1-bit Adam (Tang et al. 2021): Adam for ``freeze_step`` steps with averaged gradients,
    then the variance frozen and the momentum averaged in 1 bit with error feedback."""

    freeze_step: int = 100
    """Steps of plain Adam (full-precision gradient averages) before the variance freezes and
    the momentum is compressed, counted from the first step of the model's training (a run
    that continues an AdamW's moments continues its step count). The paper uses about 15-25%
    of training; 0 suits only a run that starts with an Adam's moments (a zero variance
    freezes its coordinates)."""

    #: Resuming continues bit for bit (the residuals are in the checkpoint).
    resume_caveat: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.freeze_step < 0:
            raise ValueError(f"freeze_step must be >= 0, got {self.freeze_step}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig(ExchangeConfig):
    """0/1 Adam (Lu et al. 2022): the variance updated at ever sparser steps until
    ``var_freeze_step``, 1-bit momentum in between, then local steps with 1-bit
    synchronisation at ever sparser steps."""

    var_freeze_step: int = 100
    """Step after which the variance is never updated again and local steps begin, counted as
    ``freeze_step`` (DeepSpeed's default is 100000 for BERT-scale runs)."""
    var_update_scaler: int = 16
    """Variance updates at each interval before the interval doubles (1, 1, ..., 2, 2, ...)."""
    local_step_scaler: int = 16
    """Synchronisations at each interval of the local phase before the interval doubles
    (DeepSpeed's default is 32678)."""
    local_step_clipper: int = 16
    """The longest interval between two synchronisations of the local phase, in steps."""

    #: Resuming continues bit for bit (the residuals and the anchor are in the checkpoint).
    resume_caveat: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.var_freeze_step < 0:
            raise ValueError(f"var_freeze_step must be >= 0, got {self.var_freeze_step}")
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        super().__post_init__()


def variance_steps(config: ZeroOneAdamConfig) -> list[int]:
    """The steps (1-based) at which 0/1 Adam updates the variance with averaged gradients:
    ``var_update_scaler`` steps 1 apart, then as many 2 apart, 4 apart, ..., up to
    ``var_freeze_step``."""
    out: list[int] = []
    step, interval = 0, 1
    while True:
        for _ in range(config.var_update_scaler):
            step += interval
            if step > config.var_freeze_step:
                return out
            out.append(step)
        interval *= 2


def sync_steps(config: ZeroOneAdamConfig, last_step: int) -> list[int]:
    """The steps (1-based, up to ``last_step``) after ``var_freeze_step`` at which 0/1 Adam's
    local phase synchronises: ``local_step_scaler`` steps 1 apart, as many 2 apart, ..., the
    interval clipped at ``local_step_clipper``."""
    out: list[int] = []
    step, interval = config.var_freeze_step, 1
    while True:
        for _ in range(config.local_step_scaler):
            step += interval
            if step > last_step:
                return out
            out.append(step)
        interval = min(2 * interval, config.local_step_clipper)
