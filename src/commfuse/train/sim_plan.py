"""A training strategy as the simulator's communication plan: ``plan_for(strategy)``.

The simulator prices the same strategy configs that ``commfuse train`` runs
(``commfuse.train.strategy``), so a prediction and a measured run name the same thing::

    plan = plan_for(CommfuseDPConfig(compressor=PowerSGD(rank=4)))
    simulate_step(cluster, transformer(), plan)

What each config becomes (bucket caps as the engines lay them out: ``bucket_cap_mb``, and the
config's ``first_bucket_cap_mb``, 1 MiB by default, for the first bucket launched):

Design notes: ``docs/simulator.md``, "What each strategy config becomes in the simulator".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal

from commfuse.compress import BF16, FP16, PowerSGD
from commfuse.decentral import DecentralMethod
from commfuse.localsgd import (
    ADPSGDConfig,
    DreamDDPConfig,
    LocalSGDClipConfig,
    PALSGDConfig,
    PeriodicMethod,
    PeriodicSyncConfig,
    SyncMethod,
)
from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig
from commfuse.optim.compressed_all_reduce import chunk_numel, message_bytes
from commfuse.sim.plan import ONE_BUFFER_MB, CommPlan
from commfuse.train.strategy import (
    CommfuseDPConfig,
    StrategyConfig,
    TorchDDPConfig,
    TorchPowerSGDConfig,
)

if TYPE_CHECKING:
    import torch

#: The first bucket's cap of torch DDP and ``commfuse.ddp.DataParallel``, MiB.
_FIRST_BUCKET_CAP_MB = 1.0


@dataclasses.dataclass(frozen=True)
class OneBitMessage:
    """The two-phase 1-bit allreduce of 1-bit and 0/1 Adam
    (``commfuse.optim.compressed_all_reduce``) as the simulator's message: each rank's all-to-all
    and all-gather each send ``P - 1`` chunk messages (signs and a scale of ``ceil(n / P)``
    elements), the link traffic of a ring allreduce of ``S = P`` such messages, in as many
    steps, ``2 (P - 1)``; so it is priced as that allreduce."""

    name: ClassVar[str] = "onebit"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"

    def payload_bytes(self, numel: int, dtype: torch.dtype, world_size: int) -> int:
        """``S``: ``world_size`` messages of one chunk (the signs whatever ``dtype``)."""
        return world_size * message_bytes(chunk_numel(numel, world_size))


def plan_for(
    strategy: StrategyConfig,
    *,
    bucket_cap_mb: float = 25.0,
    compression_gbyte_per_s: float = 0.0,
    fused_chunks: int = 1,
    overlap: bool = True,
) -> CommPlan:
    """The simulator's plan of ``strategy`` (see the module docstring).

    Args:
        strategy: a training strategy config (``TorchDDPConfig()``, ``diloco(H=50)``, ...).
        bucket_cap_mb: the run's gradient bucket cap (``commfuse train --bucket-cap-mb``).
        compression_gbyte_per_s: the machine's rate of compressing plus decompressing, GB of
            input per second (0: free), charged before each compressed message.
        fused_chunks: chunks of the model's fused compute + collective operators (1: unfused).
        overlap: launch buckets during backward (False: all after it).

    Raises:
        ValueError: a strategy the simulator does not model (hierarchical local SGD, the
            optimizers that communicate themselves).
    """
    base = CommPlan(
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=_FIRST_BUCKET_CAP_MB,
        overlap=overlap,
        fused_chunks=fused_chunks,
        compression_gbyte_per_s=compression_gbyte_per_s,
    )
    if isinstance(strategy, TorchDDPConfig):
        # torch's 16-bit hooks send what commfuse's cast compressors send: 2 bytes an element.
        cast = {"none": None, "fp16": FP16(), "bf16": BF16()}[strategy.hook]
        return dataclasses.replace(
            base,
            algorithm="native",
            first_bucket_cap_mb=strategy.first_bucket_cap_mb,
            compressor=cast,
            finite_agreement=False,
        )
    if isinstance(strategy, TorchPowerSGDConfig):
        factors = PowerSGD(rank=strategy.rank, warmup=0, wire=strategy.wire, algo="native")
        first = strategy.first_bucket_cap_mb
        return dataclasses.replace(
            base,
            algorithm="native",
            first_bucket_cap_mb=bucket_cap_mb if first is None else first,
            compressor=factors,
            finite_agreement=False,
        )
    if isinstance(strategy, CommfuseDPConfig):
        compressor = strategy.compressor
        if compressor is None:
            return dataclasses.replace(
                base, algorithm=strategy.algo, first_bucket_cap_mb=strategy.first_bucket_cap_mb
            )
        algos = (("all_reduce", compressor.algo), ("all_gather", compressor.gather_algo))
        return dataclasses.replace(
            base,
            algorithm=strategy.algo,
            algorithms=tuple((c, a) for c, a in algos if a != "auto"),
            first_bucket_cap_mb=strategy.first_bucket_cap_mb,
            compressor=compressor,
            finite_agreement=not compressor.nonfinite_reaches_every_rank,
        )
    if isinstance(strategy, SyncMethod):
        # The methods that decide when to synchronise, priced by their fixed-period twin.
        strategy = _fixed_period_twin(strategy)
    if isinstance(strategy, PeriodicMethod):
        strategy = strategy.periodic()
        if strategy.hierarchical:
            raise ValueError(
                "the simulator does not model hierarchical local SGD (gradients averaged "
                "inside each host every step); simulate it without hierarchical"
            )
        fragments = strategy.num_fragments
        compressor = strategy.compressor
        return dataclasses.replace(
            base,
            algorithm=strategy.algo if compressor is None else compressor.algo,
            local_sgd_period=max(1, round(strategy.H / fragments)),
            outer_fraction=1.0 / fragments,
            compressor=compressor,
            finite_agreement=False,  # the outer exchange agrees on nothing first
        )
    if isinstance(strategy, OneBitAdamConfig):
        # The optimizer step exchanges one flat buffer of the whole momentum after backward.
        return dataclasses.replace(
            base,
            bucket_cap_mb=ONE_BUFFER_MB,
            first_bucket_cap_mb=0.0,
            overlap=False,
            compressor=OneBitMessage(),
            finite_agreement=False,
        )
    if isinstance(strategy, ZeroOneAdamConfig):
        return dataclasses.replace(
            base,
            local_sgd_period=strategy.local_step_clipper,
            compressor=OneBitMessage(),
            finite_agreement=False,
        )
    if isinstance(strategy, DecentralMethod):
        raise ValueError(
            f"the simulator has no plan for {strategy.name} yet (its exchange is point-to-point "
            "with neighbours, not a collective); run it with commfuse train or compare"
        )
    raise ValueError(f"not a strategy config: {type(strategy).__name__}")


def _fixed_period_twin(method: SyncMethod) -> PeriodicSyncConfig:
    """The fixed-period config that sends what ``method`` sends per step: PALSGD and local SGD
    with clipping are DiLoCo and local SGD; DreamDDP sends 1/H of the model every step, as
    streaming DiLoCo with one fragment per step (its overlap with the backward pass is not
    modelled). ADPSGD sends ``num_syncs`` models over ``total_steps``, and one more at the end with
    ``final_sync`` (the default): its mean period. SelSync
    decides from the run's gradients, which the simulator cannot see.

    Raises:
        ValueError: SelSync, or ADPSGD without ``total_steps``.
    """
    if isinstance(method, PALSGDConfig | LocalSGDClipConfig):
        return method.periodic()
    if isinstance(method, DreamDDPConfig):
        return dataclasses.replace(method.periodic(), num_fragments=method.H)
    if isinstance(method, ADPSGDConfig):
        if not method.total_steps:
            raise ValueError(
                "the simulator prices adpsgd at its mean period, total_steps over its syncs: "
                "give total_steps (adpsgd:total_steps=1000,num_syncs=10)"
            )
        sends = method.num_syncs + int(method.final_sync)  # the final average closes a period
        period = max(1, round(method.total_steps / sends))
        return dataclasses.replace(method.periodic(), H=period)
    raise ValueError(
        f"the simulator does not model {method.name}: when it synchronises depends on the run; "
        "simulate local-sgd with the period it averaged (steps / syncs of a real run)"
    )
