"""The baselines: PyTorch's own DistributedDataParallel, bare and with its built-in hooks.

* ``TorchDDPConfig()`` (``ddp``): ``torch.nn.parallel.DistributedDataParallel`` (bucketed ring allreduce overlapped
  with backward, Li et al., "PyTorch Distributed", VLDB 2020). The baseline of every speed-up.
* ``TorchDDPConfig(hook="fp16" | "bf16")`` (``ddp-fp16`` / ``ddp-bf16``): DDP with ``default_hooks.fp16_compress_hook`` /
  ``bf16_compress_hook`` (each bucket cast to 16 bits, allreduced, cast back).
* ``TorchPowerSGDConfig()`` (``ddp-powersgd``): DDP with ``powerSGD_hook.powerSGD_hook`` (Vogels et al., "PowerSGD:
  Practical Low-Rank Gradient Compression", NeurIPS 2019): rank-r factors P, Q allreduced in
  place of each matrix gradient, with error feedback and warm start; ``wire=bf16`` / ``fp16``
  wraps it in torch's ``bf16_compress_wrapper`` / ``fp16_compress_wrapper`` (the bucket is cast
  to 16 bits before the hook, so the warm-up allreduces and the factors travel in 16 bits).
  torch's DDP accepts its bf16 hooks only in a build with CUDA and NCCL 2.10+
  (``bf16_hooks_supported``); elsewhere ``ddp-bf16`` and ``wire=bf16`` are refused with a
  ValueError and ``wire=fp16`` is the 16-bit peer.

Bytes are the payload handed to allreduce: for bare DDP every bucket, i.e. every trainable
parameter's gradient, once per synchronised step; for hooks, every tensor the hook hands to
``torch.distributed.all_reduce`` (counted by wrapping that function in the rank process, which
is where torch's hooks call it).

Design notes: ``docs/data-parallel.md``, "torch DDP baselines at their strongest".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from commfuse.train.checkpoint import numpy_rng_from_dict, numpy_rng_to_dict
from commfuse.train.strategy import (
    Strategy,
    StrategyContext,
    TorchDDPConfig,
    TorchPowerSGDConfig,
    register_builder,
)

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


def bf16_hooks_supported() -> bool:
    """Whether DDP accepts torch's bf16 hooks here: ``register_comm_hook`` refuses
    ``bf16_compress_hook`` and ``bf16_compress_wrapper`` unless torch was built with CUDA (or
    ROCm) and NCCL 2.10+, or has XPU and XCCL, whatever the process group's backend."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)  # type: ignore[no-untyped-call]
    xpu = dist.is_xccl_available() and torch.xpu.is_available()
    return bool((cuda and nccl) or xpu)


def check_bf16_hooks(what: str, hint: str) -> None:
    """ValueError (``what``, the reason, then ``hint``) unless DDP accepts the bf16 hooks here."""
    if not bf16_hooks_supported():
        raise ValueError(
            f"{what}torch's DDP accepts its bf16 hooks only in a build with CUDA and NCCL "
            f"2.10+ (or XPU), and this torch {torch.__version__} has neither; {hint}"
        )


def check_first_bucket(cap_mb: float) -> None:
    """ValueError unless the first bucket's cap is positive."""
    if not cap_mb > 0:
        raise ValueError(f"first_bucket_cap_mb must be > 0, got {cap_mb}")


def bucket_caps(bucket_cap_mb: float, first_bucket_cap_mb: float | None) -> dict[str, Any]:
    """torch DDP's keyword arguments for commfuse's caps: ``first_bucket_cap_mb`` for the first
    bucket launched (None: the same as the rest), ``bucket_cap_mb`` for the rest."""
    if first_bucket_cap_mb is not None and first_bucket_cap_mb < bucket_cap_mb:
        # torch reads the list in gradient order after its rebuild: the last entry repeats.
        return {
            "bucket_cap_mb": bucket_cap_mb,
            "bucket_cap_mb_list": [first_bucket_cap_mb, bucket_cap_mb],
        }
    return {"bucket_cap_mb": bucket_cap_mb}


def ddp_choices(ddp: DistributedDataParallel) -> dict[str, Any]:
    """torch DDP's bucket layout as its logging data has it (the bytes of each bucket, in
    its order), and whether it rebuilt its buckets in gradient order."""
    data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    return {
        "bucket_sizes": str(data.get("bucket_sizes", "")),
        "rebuilt_buckets": bool(data.get("has_rebuilt_buckets", 0)),
    }


class _TorchDDP(Strategy):
    """torch DDP with an optional built-in communication hook."""

    def __init__(
        self,
        ctx: StrategyContext,
        *,
        static_graph: bool = False,
        bucket_view: bool = True,
        first_bucket_cap_mb: float | None = 1.0,
        hook: Callable[..., Any] | None = None,
        hook_state: Any = None,
    ) -> None:
        super().__init__(ctx)
        self.ddp = DistributedDataParallel(
            ctx.module,
            process_group=ctx.comm.group,
            static_graph=static_graph,
            gradient_as_bucket_view=bucket_view,
            **bucket_caps(ctx.bucket_cap_mb, first_bucket_cap_mb),
        )
        self.hook_state = hook_state
        self._counter: _AllReduceCounter | None = None
        self._analytic_bytes = 0
        self._grad_bytes = sum(
            p.numel() * p.element_size() for p in ctx.module.parameters() if p.requires_grad
        )
        self._syncing = True
        # The reducer's parameters in its own order (its indices), and the order (those indices)
        # in which the first synchronised backward made them ready: DDP's rebuilt buckets.
        self._reducer_params: list[nn.Parameter] = self.ddp._build_params_for_reducer()[0]  # type: ignore[no-untyped-call]
        self._ready_order: list[int] | None = None
        self._replaying = False
        if hook is not None:
            self.ddp.register_comm_hook(hook_state, self._replayable(hook))
            self._counter = _AllReduceCounter()
            self._counter.install()

    def _replayable(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook``, but while a bucket order is replayed (``_replay_order``) it hands each
        bucket back as it is, with no communication."""

        def recorded(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            if self._replaying:
                done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            result: torch.futures.Future[torch.Tensor] = hook(state, bucket)
            return result

        # DDP checks a hook's annotations as objects; this module's are strings.
        recorded.__annotations__ = {
            "bucket": GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        return recorded

    def _backward_recording_order(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, filing the order in which it makes each parameter's gradient
        ready (the order DDP rebuilds its buckets in after this, its first synchronised one)."""
        order: list[int] = []
        handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self._reducer_params)
        ]
        try:
            loss.backward()  # type: ignore[no-untyped-call]
        finally:
            for handle in handles:
                handle.remove()
        self._ready_order = order

    def _replay_order(self, order: list[int]) -> None:
        """Make DDP rebuild its buckets at its next forward from ``order`` (the reducer's
        indices), as the run that recorded it did: one backward marks every parameter ready in
        that order while the hook hands each bucket back uncommunicated. The gradients it
        leaves are dropped."""
        reducer = self.ddp.reducer
        if sorted(order) != list(range(len(self._reducer_params))):
            raise ValueError("the checkpoint's bucket order is not over this model's parameters")
        # On the parameters' device, as every buffer commfuse allocates.
        device = self._reducer_params[0].device
        anchor = torch.zeros((), device=device, requires_grad=True)
        trigger = anchor.clone()

        def mark_ready(grad: torch.Tensor) -> torch.Tensor:
            for i in order:
                reducer._autograd_hook(i)  # type: ignore[attr-defined]
            return grad

        trigger.register_hook(mark_ready)  # type: ignore[no-untyped-call]
        reducer.prepare_for_backward([])
        self._replaying = True
        try:
            trigger.backward()  # type: ignore[no-untyped-call]
        finally:
            self._replaying = False
        for p in self._reducer_params:
            p.grad = None
        self._ready_order = list(order)

    @property
    def model(self) -> nn.Module:
        return self.ddp

    def choices(self) -> dict[str, Any]:
        return ddp_choices(self.ddp)

    def zero_grad(self) -> None:
        super().zero_grad()
        if self._counter is not None:
            self._counter.arm()  # a step begins: its hook's all_reduces are this strategy's

    def backward(self, loss: torch.Tensor) -> None:
        if self.hook_state is not None and self._ready_order is None and self._syncing:
            self._backward_recording_order(loss)
        else:
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
            return {
                "powersgd": _powersgd_state_dict(self.hook_state),
                "bucket_order": list(self._ready_order or []),
            }
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.hook_state, powerSGD_hook.PowerSGDState):
            if "powersgd" not in state:
                raise ValueError("checkpoint has no PowerSGD hook state for ddp-powersgd")
            _load_powersgd_state_dict(self.hook_state, state["powersgd"])
            if state.get("bucket_order"):
                self._replay_order(list(state["bucket_order"]))
        else:
            super().load_state_dict(state)

    def close(self) -> None:
        if self._counter is not None:
            self._counter.uninstall()


def _powersgd_state_dict(state: powerSGD_hook.PowerSGDState) -> dict[str, Any]:
    """torch's PowerSGDState as plain data (weights-only loadable): every slot but the process
    group (torch's own ``__getstate__`` leaves it out too), its numpy RNG as tensors."""
    out: dict[str, Any] = {}
    for slot in powerSGD_hook.PowerSGDState.__slots__:
        if slot == "process_group":
            continue
        value = getattr(state, slot)
        out[slot] = numpy_rng_to_dict(value.get_state()) if slot == "rng" else value
    return out


def _load_powersgd_state_dict(state: powerSGD_hook.PowerSGDState, saved: dict[str, Any]) -> None:
    """Restore :func:`_powersgd_state_dict` into ``state``, keeping its process group."""
    slots = set(powerSGD_hook.PowerSGDState.__slots__) - {"process_group"}
    if set(saved) != slots:
        raise ValueError(
            f"not a PowerSGDState of this torch: missing {sorted(slots - set(saved))}, "
            f"unknown {sorted(set(saved) - slots)}"
        )
    for slot, value in saved.items():
        if slot == "rng":
            state.rng.set_state(numpy_rng_from_dict(value))
        else:
            setattr(state, slot, value)


_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def _ddp(config: TorchDDPConfig, ctx: StrategyContext) -> Strategy:
    return _TorchDDP(
        ctx,
        static_graph=config.static_graph,
        bucket_view=config.bucket_view,
        first_bucket_cap_mb=config.first_bucket_cap_mb,
        hook=None if config.hook == "none" else _HOOKS[config.hook],
    )


def _ddp_powersgd(opts: TorchPowerSGDConfig, ctx: StrategyContext) -> Strategy:
    state = powerSGD_hook.PowerSGDState(
        process_group=ctx.comm.group,
        matrix_approximation_rank=opts.rank,
        start_powerSGD_iter=opts.warmup,
        min_compression_rate=opts.min_compression_rate,
        use_error_feedback=opts.error_feedback,
        warm_start=opts.warm_start,
        orthogonalization_epsilon=opts.epsilon,
        batch_tensors_with_same_shape=opts.batch_same_shape,
        random_seed=ctx.seed,
    )
    hook: Callable[..., Any] = powerSGD_hook.powerSGD_hook
    if opts.wire == "bf16":
        hook = default_hooks.bf16_compress_wrapper(hook)
    elif opts.wire == "fp16":
        hook = default_hooks.fp16_compress_wrapper(hook)
    return _TorchDDP(
        ctx,
        bucket_view=opts.bucket_view,
        first_bucket_cap_mb=opts.first_bucket_cap_mb,
        hook=hook,
        hook_state=state,
    )


register_builder(TorchDDPConfig, _ddp)
register_builder(TorchPowerSGDConfig, _ddp_powersgd)
