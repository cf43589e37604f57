"""Strategies that communicate less often: a ``commfuse.localsgd.PeriodicMethod``
(``local_sgd(H=8)``, ``post_local_sgd``, ``slowmo``, ``diloco``, ``streaming_diloco``, or the
general ``PeriodicSyncConfig``) run by ``PeriodicSyncOptimizer`` under the training loop.

The model is not wrapped: between synchronisations each rank trains its own replica, and the
optimizer step performs whatever exchange is due (see ``commfuse/localsgd/optimizer.py``). On
the command line the keys are the configs' fields (``diloco:H=50,outer_lr=0.7``,
``streaming-diloco:H=50,num_fragments=4``, ``local-sgd:H=8,compressor=int8``,
``hierarchical=1``).

The methods that decide when or what to synchronise (``commfuse.localsgd.SyncMethod``:
``selsync``, ``adpsgd``, ``palsgd``, ``dreamddp``, ``localsgd-clip``) run here too, each with
its own optimizer (``SyncMethod.make_optimizer``); DreamDDP's hooks launch exchanges as the
forward starts, so its strategy pauses them in ``no_sync``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.ddp.wrapper import compressor_choices
from commfuse.localsgd import (
    ADPSGDConfig,
    DiLoCoConfig,
    DreamDDPConfig,
    DreamDDPOptimizer,
    LocalSGDClipConfig,
    LocalSGDConfig,
    PALSGDConfig,
    PeriodicMethod,
    PeriodicSyncConfig,
    PeriodicSyncOptimizer,
    PostLocalSGDConfig,
    SelSyncConfig,
    SelSyncOptimizer,
    SlowMoConfig,
    StreamingDiLoCoConfig,
    SyncMethod,
)
from commfuse.train.strategy import Strategy, StrategyContext, register_builder


class PeriodicSync(Strategy):
    """One rank of a local-SGD-family run."""

    def __init__(self, config: PeriodicMethod | SyncMethod, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.periodic = (
            config.for_run(ctx.run_steps).make_optimizer(ctx.optimizer, ctx.module, ctx.comm)
            if isinstance(config, SyncMethod)
            else PeriodicSyncOptimizer(ctx.optimizer, ctx.module, ctx.comm, config)
        )
        self._communicate = True
        # SelSync and ADPSGD decide when, step by step: no clock whose phases could be compared.
        adaptive = isinstance(config, (SelSyncConfig, ADPSGDConfig))
        self.period_steps = None if adaptive else self.periodic.config.H
        """Steps per period of a method that synchronises on a clock (None: it decides)."""
        # The optimizer's broadcast of rank 0's model is set-up, not a synchronisation.
        self._built_bytes = self.bytes_sent()
        self.final_sync_bytes = 0
        """Bytes this rank sent in the end-of-training synchronisation (``finish()``)."""

    @property
    def model(self) -> nn.Module:
        return self.module

    def optimizer_step(self) -> bool:
        if self._communicate:
            self.periodic.step()
        else:
            self.optimizer.step()
        return True

    def bytes_sent(self) -> int:
        comms = {id(c): c for c in (self.comm, self.periodic.grad_comm, self.periodic.outer_comm)}
        total = 0
        for comm in comms.values():
            total += comm.stats.total().handed_bytes  # as the DDP strategies (commfuse_dp.py)
        return total

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._communicate = False
        if isinstance(self.periodic, DreamDDPOptimizer):
            self.periodic.communicate = False
        try:
            yield
        finally:
            self._communicate = True
            if isinstance(self.periodic, DreamDDPOptimizer):
                self.periodic.communicate = True

    def metrics(self) -> dict[str, Any]:
        """Drift between replicas before each synchronisation (L2, and relative to the model),
        and the bytes per synchronisation of the whole model: this rank's bytes but the
        decisions' (SelSync's flags, ADPSGD's periods, DreamDDP's profile: ``control_bytes``)
        over the models' worth of elements exchanged (streaming DiLoCo's fragments and
        DreamDDP's layers add up to one model per period). A synchronous warm-up's or
        hierarchical mode's gradient averages are among the bytes too."""
        syncs = self.periodic.syncs
        control = self.periodic.control_bytes
        model_numel = sum(p.numel() for p in self.periodic.params)
        models = sum(s.numel for s in syncs) / model_numel
        return {
            "period_steps": self.period_steps,
            "syncs": len(syncs),
            "model_syncs": models,
            "control_bytes": control,
            "bytes_per_sync": (
                (self.bytes_sent() - self._built_bytes - control) / models if syncs else 0.0
            ),
            "sync_steps": [s.step for s in syncs],
            # SelSync: the agreed signal of every step (to choose its threshold from a run).
            "signals": (
                list(self.periodic.signals) if isinstance(self.periodic, SelSyncOptimizer) else None
            ),
            "drift": [s.drift for s in syncs],
            "relative_drift": [s.relative_drift for s in syncs],
            "final_sync_bytes": self.final_sync_bytes,
            # DreamDDP: what its plan expects of each iteration of the period (the model's bound
            # beside the measured steps).
            "planned_iterations": (
                self.periodic.planned_iterations()
                if isinstance(self.periodic, DreamDDPOptimizer)
                else None
            ),
            # DreamDDP: per step after the profile, the seconds spent waiting for exchanges.
            "exchange_wait_s": (
                list(self.periodic.wait_s) if isinstance(self.periodic, DreamDDPOptimizer) else None
            ),
            # DreamDDP with ``trace=1``: every exchange's timeline and every step's start.
            "exchange_trace": (
                {
                    "exchanges": list(self.periodic.trace),
                    "forward_s": list(self.periodic.forward_s),
                    "step_s": list(self.periodic.step_s),
                    "origin_s": self.periodic.trace_origin_s,
                }
                if isinstance(self.periodic, DreamDDPOptimizer) and self.periodic.method.trace
                else None
            ),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"periodic": self.periodic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "periodic" not in state:
            raise ValueError("checkpoint has no local-SGD state (anchors, outer momentum)")
        self.periodic.load_state_dict(state["periodic"])

    def choices(self) -> dict[str, Any]:
        return periodic_choices(self.periodic)

    def close(self) -> None:
        if isinstance(self.periodic, DreamDDPOptimizer):
            self.periodic.close()

    def finish(self) -> None:
        self.periodic.land_in_flight()
        if self.periodic.config.final_sync:
            before = self.bytes_sent()
            self.periodic.average_moved_fragments()
            self.final_sync_bytes += self.bytes_sent() - before


def periodic_choices(periodic: PeriodicSyncOptimizer) -> dict[str, Any]:
    """What decides a local-SGD run's bits beyond its configuration (``Strategy.choices``),
    the same with torchft (``ft/periodic.py``) and without: the outer compressor's settings
    and layouts, and each fragment's pieces (``[parameter, start, stop]``)."""
    compressor = periodic.config.compressor
    return {
        "compressor": None if compressor is None else compressor_choices(compressor),
        "fragments": [[[p.param, p.start, p.stop] for p in f] for f in periodic.fragments],
    }


# The methods that synchronise on a clock (one line each).
register_builder(LocalSGDConfig, PeriodicSync)
register_builder(PostLocalSGDConfig, PeriodicSync)
register_builder(SlowMoConfig, PeriodicSync)
register_builder(DiLoCoConfig, PeriodicSync)
register_builder(StreamingDiLoCoConfig, PeriodicSync)
register_builder(PeriodicSyncConfig, PeriodicSync)
# The methods that decide when or what to synchronise (one line each).
register_builder(SelSyncConfig, PeriodicSync)
register_builder(ADPSGDConfig, PeriodicSync)
register_builder(PALSGDConfig, PeriodicSync)
register_builder(DreamDDPConfig, PeriodicSync)
register_builder(LocalSGDClipConfig, PeriodicSync)
