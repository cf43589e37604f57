"""The baselines: PyTorch's own DistributedDataParallel, bare and with its built-in hooks.

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (bucketed ring allreduce overlapped
  with backward, Li et al., "PyTorch Distributed", VLDB 2020). The baseline of every speed-up.
* ``ddp-fp16`` / ``ddp-bf16``: DDP with ``default_hooks.fp16_compress_hook`` /
  ``bf16_compress_hook`` (each bucket cast to 16 bits, allreduced, cast back).
* ``ddp-powersgd``: DDP with ``powerSGD_hook.powerSGD_hook`` (Vogels et al., "PowerSGD:
  Practical Low-Rank Gradient Compression", NeurIPS 2019): rank-r factors P, Q allreduced in
  place of each matrix gradient, with error feedback and warm start.

These are the peer baselines commfuse must beat, so they run exactly as torch ships them.
Resume: ``ddp``, ``ddp-fp16`` and ``ddp-bf16`` continue bit for bit; ``ddp-powersgd`` saves and
restores its PowerSGDState, but is not bit-exact: a fresh DDP uses its initial bucket layout for
one step and then rebuilds it, and PowerSGD's per-bucket Q and error memories follow the layout.
Bytes are the payload handed to allreduce: for bare DDP every bucket, i.e. every trainable
parameter's gradient, once per synchronised step; for hooks, every tensor the hook hands to
``torch.distributed.all_reduce`` (counted by wrapping that function in the rank process, which
is where torch's hooks call it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from commfuse.train.strategy import Strategy, StrategyContext, register_strategy

# PowerSGDState's pickling logs two NOTEs per rank per checkpoint about its process group,
# which this module handles itself (it re-attaches the group after loading).
logging.getLogger(powerSGD_hook.__name__).setLevel(logging.ERROR)


class _AllReduceCounter:
    """Counts bytes handed to ``torch.distributed.all_reduce`` while it is the armed counter.

    One wrapper per process, put in place with the first counter and removed with the last.
    Several torch-DDP strategies may live in one process (``commfuse bench strategies`` steps
    them in turn): each arms its counter at the start of its step, so each counts its own."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _counters: ClassVar[list[_AllReduceCounter]] = []
    _armed: ClassVar[_AllReduceCounter | None] = None
    _original: ClassVar[Callable[..., Any] | None] = None

    def __init__(self) -> None:
        self.bytes = 0

    def install(self) -> None:
        cls = _AllReduceCounter
        with cls._lock:
            if not cls._counters:
                original = dist.all_reduce

                @functools.wraps(original)
                def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    armed = _AllReduceCounter._armed
                    if armed is not None:
                        armed.bytes += tensor.numel() * tensor.element_size()
                    return original(tensor, *args, **kwargs)

                cls._original = original
                dist.all_reduce = counted
            cls._counters.append(self)
            cls._armed = self

    def arm(self) -> None:
        """Count the all_reduces from now on in this counter (its strategy's step begins)."""
        _AllReduceCounter._armed = self

    def uninstall(self) -> None:
        cls = _AllReduceCounter
        with cls._lock:
            if self in cls._counters:
                cls._counters.remove(self)
            if cls._armed is self:
                cls._armed = cls._counters[-1] if cls._counters else None
            if not cls._counters and cls._original is not None:
                dist.all_reduce = cls._original
                cls._original = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Options of ``ddp``, ``ddp-fp16`` and ``ddp-bf16``."""

    static_graph: bool = False
    """torch DDP's static_graph (the graph and unused parameters do not change between steps)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPPowerSGDOptions:
    """Options of ``ddp-powersgd`` (names of torch's PowerSGDState in brackets)."""

    rank: int = 4
    """Rank r of the low-rank approximation (matrix_approximation_rank)."""
    warmup: int = 2
    """Steps of plain allreduce before compressing (start_powerSGD_iter; torch needs >= 2)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only when it shrinks at least this much (min_compression_rate)."""
    error_feedback: bool = True
    """Add the last step's compression error back (use_error_feedback)."""
    warm_start: bool = True
    """Reuse last step's Q as the starting point (warm_start)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1, got {self.rank}")
        if self.warmup < 2 and (self.error_feedback or self.warm_start):
            raise ValueError(
                f"warmup must be at least 2 with error feedback or warm start (torch rebuilds "
                f"DDP's buckets after the first step), got {self.warmup}"
            )


class TorchDDP(Strategy):
    """torch DDP with an optional built-in communication hook."""

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        static_graph: bool = False,
        hook: Callable[..., Any] | None = None,
        hook_state: Any = None,
    ) -> None:
        super().__init__(ctx)
        self.ddp = DistributedDataParallel(
            ctx.module,
            process_group=ctx.comm.group,
            bucket_cap_mb=ctx.bucket_cap_mb,
            static_graph=static_graph,
        )
        self.hook_state = hook_state
        self._counter: _AllReduceCounter | None = None
        self._analytic_bytes = 0
        self._grad_bytes = sum(
            p.numel() * p.element_size() for p in ctx.module.parameters() if p.requires_grad
        )
        self._syncing = True
        if hook is not None:
            self.ddp.register_comm_hook(hook_state, hook)
            self._counter = _AllReduceCounter()
            self._counter.install()

    @property
    def model(self) -> nn.Module:
        return self.ddp

    def zero_grad(self) -> None:
        super().zero_grad()
        if self._counter is not None:
            self._counter.arm()  # a step begins: its hook's all_reduces are this strategy's

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]
        if self._counter is None and self._syncing and self.comm.world_size > 1:
            self._analytic_bytes += self._grad_bytes  # every bucket, allreduced in backward

    def optimizer_step(self) -> bool:
        self.optimizer.step()
        return True

    def bytes_sent(self) -> int:
        return self._counter.bytes if self._counter is not None else self._analytic_bytes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._syncing = False
        try:
            with self.ddp.no_sync():
                yield
        finally:
            self._syncing = True

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.hook_state, powerSGD_hook.PowerSGDState):
            # PowerSGDState pickles without its process group (its own __getstate__).
            return {"powersgd": self.hook_state.__getstate__()}  # type: ignore[no-untyped-call]
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.hook_state, powerSGD_hook.PowerSGDState):
            if "powersgd" not in state:
                raise ValueError("checkpoint has no PowerSGD hook state for ddp-powersgd")
            group = self.hook_state.process_group
            self.hook_state.__setstate__(state["powersgd"])  # type: ignore[no-untyped-call]
            self.hook_state.process_group = group
        else:
            super().load_state_dict(state)

    def close(self) -> None:
        if self._counter is not None:
            self._counter.uninstall()


def _ddp(opts: DDPOptions, ctx: StrategyContext) -> Strategy:
    return TorchDDP(ctx, static_graph=opts.static_graph)


def _ddp_fp16(opts: DDPOptions, ctx: StrategyContext) -> Strategy:
    return TorchDDP(ctx, static_graph=opts.static_graph, hook=default_hooks.fp16_compress_hook)


def _ddp_bf16(opts: DDPOptions, ctx: StrategyContext) -> Strategy:
    return TorchDDP(ctx, static_graph=opts.static_graph, hook=default_hooks.bf16_compress_hook)


def _ddp_powersgd(opts: DDPPowerSGDOptions, ctx: StrategyContext) -> Strategy:
    state = powerSGD_hook.PowerSGDState(
        process_group=ctx.comm.group,
        matrix_approximation_rank=opts.rank,
        start_powerSGD_iter=opts.warmup,
        min_compression_rate=opts.min_compression_rate,
        use_error_feedback=opts.error_feedback,
        warm_start=opts.warm_start,
        random_seed=ctx.seed,
    )
    return TorchDDP(ctx, hook=powerSGD_hook.powerSGD_hook, hook_state=state)


register_strategy("ddp", DDPOptions, _ddp, help="torch DDP (the baseline)")
register_strategy("ddp-fp16", DDPOptions, _ddp_fp16, help="torch DDP + its fp16_compress_hook")
register_strategy("ddp-bf16", DDPOptions, _ddp_bf16, help="torch DDP + its bf16_compress_hook")
register_strategy(
    "ddp-powersgd",
    DDPPowerSGDOptions,
    _ddp_powersgd,
    help="torch DDP + its powerSGD_hook (rank=4, warmup=2)",
)
