"""``DataParallel``: data-parallel training of any ``nn.Module`` with commfuse collectives.

Usage, on every rank (the process group is up, e.g. under ``commfuse launch``)::

    model = DataParallel(net, config=DataParallelConfig(algo="auto"))
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()          # buckets are reduced while backward runs
        model.step(optimizer)    # steps unless the gradients were non-finite
        optimizer.zero_grad()

What it does: rank 0's parameters and buffers are broadcast at construction; buffers again
before each synchronized forward (``broadcast_buffers``); gradients are averaged in buckets
during backward (``reducer.py``); a rank whose backward produced no gradient joins the
others' reduction at its next forward or ``step()``; ``no_sync()`` accumulates gradients locally for gradient
accumulation; ``state_dict()`` / ``load_state_dict()`` hold the module's weights and, under
``_extra_state``, the engine's own state (step counter, bucket layout, compressor state:
``engine_state_dict()``), so a resumed run is bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from commfuse.collectives import broadcast
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor
from commfuse.ddp.config import DataParallelConfig
from commfuse.ddp.graph import unreachable_params
from commfuse.ddp.reducer import Reducer, StepStats


def _broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Copy rank 0's tensors into every rank's: one flat broadcast per dtype (coalesced, as
    torch DDP does, so a model with hundreds of small tensors pays alpha a few times only)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            broadcast(comm, flat, 0, algo="auto")
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
                offset += tensor.numel()


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``comm`` (the world when None).

    Args:
        module: the model; its parameters and buffers are broadcast from rank 0 at construction.
        comm: the data-parallel group; None: a ``Communicator`` over the world.
        config: buckets, algorithm, compressor, non-finite policy; None: ``DataParallelConfig()``.

    Raises:
        ValueError: ``module`` is not an ``nn.Module``, or the config is inconsistent (the message
            names the field).
        NonFiniteGradientError: from ``loss.backward()`` (its end, where the buckets land), with
            ``on_nonfinite="raise"``, when a gradient is NaN or Inf on some rank (names the
            parameter); the gradients are zeroed and a ``step()`` after it does not step.
        CommTimeoutError: a bucket's exchange passed the communicator's deadline.

    Example:
        ```python
        model = DataParallel(net, comm, config=DataParallelConfig(compressor=PowerSGD(rank=4)))
        loss_fn(model(batch)).backward()  # buckets leave as their last gradient arrives
        model.step(optimizer)  # waits for the buckets; skips the step on NaN/Inf anywhere
        optimizer.zero_grad()
        ```
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        *,
        config: DataParallelConfig | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.comm = comm if comm is not None else Communicator()
        self.config = config or DataParallelConfig()
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named and not self.config.skip_communication:
            raise ValueError(
                "the module has no parameter with requires_grad=True: nothing to train"
            )
        if not self.config.skip_communication:
            # Every parameter (frozen ones too) and buffer starts as rank 0's.
            _broadcast_tensors(
                self.comm, [p.data for p in module.parameters()] + list(module.buffers())
            )
        self.reducer = Reducer(named, self.comm, self.config)
        # Listed once, as torch DDP does (``modules_buffers``): buffers are updated in place.
        self._synced_buffers = [] if self.config.skip_communication else list(module.buffers())

    # -- training ----------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        synchronized = self.reducer.sync and torch.is_grad_enabled()
        if synchronized:
            # Before any collective of this forward: the other ranks may be waiting in their
            # end-of-backward for this rank's buckets (see _catch_up).
            self._catch_up()
            if self.config.broadcast_buffers and self._synced_buffers:
                _broadcast_tensors(self.comm, self._synced_buffers)
        output = self.module(*args, **kwargs)
        if synchronized and self.training:
            self.reducer.awaiting_backward = True
            if self.config.find_unused_parameters:
                self.reducer.unused_in_forward = unreachable_params(output, self.reducer.params)
        return output

    def _catch_up(self, *, stepping: bool = False) -> None:
        """A synchronized training forward that reached no hook in backward (no gradient on
        this rank): reduce now, so the ranks that did get gradients are not left waiting.

        From ``step()`` this is exact: the averages land in ``.grad`` before the optimizer
        runs. From the next forward it is too late when the average is not zero: the other
        ranks had gradients and stepped with them, this rank did not, so the replicas differ;
        the reduction still runs, freeing the others, then this rank raises. An average of
        zero is two synchronized forwards before one backward (no rank had a gradient): it
        costs one extra reduction and a warning; run the extra forward under ``no_sync()`` or
        ``torch.no_grad()``."""
        if not (self.reducer.awaiting_backward and self.reducer.sync):
            return
        step = self.reducer.step
        self.reducer.reduce_without_backward()
        if stepping or self.reducer.last_step_skipped:
            return
        if any(bool(p.grad.any()) for p in self.reducer.params if p.grad is not None):
            raise RuntimeError(
                f"rank {self.comm.rank}: the backward after the synchronized forward of step "
                f"{step} gave DataParallel's parameters no gradient on this rank while other "
                "ranks had some, and this rank did not join their reduction before stepping, "
                "so its replica no longer matches theirs; call DataParallel.step(optimizer) "
                "instead of optimizer.step(): it joins the reduction first"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next backward outside
        reduces the sum of all of them (gradient accumulation without communication)."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last synchronized backward found a non-finite
        gradient (``on_nonfinite="skip"``) or, with ``staleness=1``, nothing has landed yet
        (the first step); returns whether it stepped. On a rank whose last
        synchronized forward got no backward gradient, it first joins the other ranks'
        reduction with zero gradients."""
        self._catch_up(stepping=True)
        if self.reducer.last_step_skipped or not self.reducer.update_ready:
            return False
        optimizer.step()
        return True

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last synchronized backward had a NaN/Inf gradient (and was zeroed)."""
        return self.reducer.last_step_skipped

    @property
    def last_stats(self) -> StepStats | None:
        """What the last synchronized step communicated and waited for."""
        return self.reducer.last_stats

    @property
    def num_steps(self) -> int:
        """Synchronized backward passes so far (the compressors' ``step``)."""
        return self.reducer.step

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.reducer.names[i] for i in group] for group in self.reducer.groups]

    def choices(self) -> dict[str, Any]:
        """What this engine chose that decides its bits, for a run's record: the bucket layout
        (``bucket_layout``, MG-WFBP's merged one once merged), each bucket's algorithm, the
        tuner's picks so far (``algo="auto"``: from its cost model, a calibrated profile or a
        timed trial; the same on every rank) and the compressor's settings."""
        from commfuse.collectives.profile import TunerState
        from commfuse.collectives.registry import resolve

        reducer, config = self.reducer, self.config
        compressor = config.compressor
        if config.skip_communication:
            algos = ["none"] * len(reducer.buckets)
        elif compressor is not None:
            algos = [f"{compressor.name}:{compressor.algo}"] * len(reducer.buckets)
        elif reducer.direct:
            algos = ["native"] * len(reducer.buckets)
        elif config.algo != "auto":
            algos = [resolve("all_reduce", config.algo)] * len(reducer.buckets)
        else:
            picked = self.comm.owned(TunerState).choices
            algos = [picked.get(("all_reduce", b.nbytes), "auto") for b in reducer.buckets]
        tuner = self.comm.owned(TunerState).choices
        return {
            "bucket_layout": self.bucket_layout,
            "merged_by_cost": config.merge_buckets_by_cost and reducer.merged,
            "bucket_algorithms": algos,
            "tuner": {f"{c}:{n}": algo for (c, n), algo in sorted(tuner.items())},
            "compressor": None if compressor is None else compressor_choices(compressor),
        }

    # -- checkpoints -------------------------------------------------------------------------------
    def engine_state_dict(self) -> dict[str, Any]:
        """The engine's own state: step counter, bucket layout, the tuner's picks, compressor
        state and, with ``staleness=1``, the averaged gradient still in flight (waited for here, applied at the
        next step as usual). (The module's weights are in ``state_dict()``, as for any module;
        the optimizer's are the caller's.)"""
        from commfuse.collectives.profile import TunerState

        state: dict[str, Any] = {
            "step": self.reducer.step,
            "bucket_groups": [list(g) for g in self.reducer.groups],
            "merged": self.reducer.merged,
            # algo="auto"'s picks (from a timed trial, a calibrated profile or the model): a
            # resumed run reduces with the same algorithms, in the same order, not with what
            # a new trial on a differently loaded machine would pick.
            "tuner_choices": [
                [collective, nbytes, algo]
                for (collective, nbytes), algo in sorted(
                    self.comm.owned(TunerState).choices.items()
                )
            ],
        }
        in_flight = self.reducer.land_in_flight()  # first: the compressor state it updates
        if in_flight is not None:
            state["in_flight"] = in_flight
        if self.config.compressor is not None:
            state["compressor"] = self.config.compressor.state_dict()
        return state

    def load_engine_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``engine_state_dict()``: the same layout makes the same sums, bit for bit."""
        missing = {"step", "bucket_groups", "merged"} - set(state)
        if missing:
            raise ValueError(f"engine state is missing {sorted(missing)}")
        if (self.config.compressor is None) != ("compressor" not in state):
            raise ValueError(
                "engine state and config disagree on the compressor: "
                f"state has {'one' if 'compressor' in state else 'none'}, config has "
                f"{'one' if self.config.compressor is not None else 'none'}"
            )
        if ("in_flight" in state) and not self.config.staleness:
            raise ValueError(
                "engine state holds a gradient in flight but the config has staleness=0"
            )
        from commfuse.collectives.tuner import remember_choice

        for collective, nbytes, algo in state.get("tuner_choices", []):  # before the layout,
            remember_choice(self.comm, collective, int(nbytes), algo)  # which asks the tuner
        self.reducer.set_layout(state["bucket_groups"])
        self.reducer.step = int(state["step"])
        self.reducer._reset_step()
        self.reducer.awaiting_backward = False
        self.reducer.merged = bool(state["merged"])
        self.reducer.restore_in_flight(state.get("in_flight"))
        if self.config.compressor is not None:
            self.config.compressor.load_state_dict(state["compressor"])

    # nn.Module carries this in state_dict() under "_extra_state", so dp.state_dict() holds the
    # weights and the engine's state, and dp.load_state_dict() restores both.
    def get_extra_state(self) -> dict[str, Any]:
        return self.engine_state_dict()

    def set_extra_state(self, state: Any) -> None:
        self.load_engine_state_dict(state)

    def close(self) -> None:
        """Land a reduction still in flight (``staleness=1``) and remove the gradient hooks
        (the wrapped module then trains locally again). Call it before other collectives on the
        same process group: a flight left running would race them."""
        self.reducer.close()


def compressor_choices(compressor: Compressor) -> dict[str, Any]:
    """A compressor's settings and the tensors of each bucket it compressed, in bucket order
    (its state is seeded and filed by them: PowerSGD's first Q by the bucket's index)."""
    settings = {
        field.name: getattr(compressor, field.name)
        for field in dataclasses.fields(compressor)
        if field.init
    }
    return {
        "name": compressor.name,
        "settings": {
            k: v if isinstance(v, (int, float, str, bool)) else repr(v) for k, v in settings.items()
        },
        "layouts": {
            int(bucket): list(layout.names) for bucket, layout in sorted(compressor.layouts.items())
        },
    }
