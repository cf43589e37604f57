"""commfuse under Hugging Face Accelerate: the compressed DDP hook in one call after ``prepare``,
or a periodic method (DiLoCo, local SGD) over a model ``prepare`` did not wrap.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of
torch's hooks and ignores any other value without a word, so commfuse's hook cannot go there.
``compress_gradients(accelerator, model, compressor)``:

1. refuses an ``Accelerator`` whose ``DistributedDataParallelKwargs`` names a hook (ignored, or
   a second hook DDP would refuse), saying what to do instead;
2. builds a ``CompressionState`` for the model ``prepare`` wrapped in DDP and registers
   ``compressed_allreduce_hook`` on it;
3. registers the state with ``accelerator.register_for_checkpointing``, every rank's own (error
   feedback differs per rank), so ``save_state``/``load_state`` resume it exactly.

``periodic_optimizer(accelerator, model, optimizer, method)`` wraps the optimizer in a
``PeriodicSyncOptimizer`` over the unwrapped model (DDP would all-reduce every step besides the
periodic exchange: a prepared model is refused, saying so) and registers each rank's replica,
anchors and outer state for ``save_state``.

Example:
    ```python
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    compress_gradients(accelerator, model, PowerSGD(rank=4))
    ```
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commfuse.comm import CommConfig, Communicator
from commfuse.compress.base import Compressor
from commfuse.hooks import CompressionState, compressed_allreduce_hook
from commfuse.integrations._per_rank import PerRankState
from commfuse.localsgd import PeriodicMethod, PeriodicSyncOptimizer


def compress_gradients(
    accelerator: Accelerator,
    model: nn.Module,
    compressor: Compressor,
    *,
    comm_config: CommConfig | None = None,
) -> CompressionState:
    """Average ``model``'s gradients through ``compressor`` (commfuse's DDP hook), its state
    saved and restored by ``accelerator.save_state``/``load_state``.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare`` returned: DDP over several processes; one process
            has nothing to exchange, and the state is only checkpointed.
        compressor: how every bucket is exchanged (``PowerSGD(rank=4)``, ``TopK(ratio=0.01)``).
        comm_config: the hook communicator's deadlines and tracing.

    Returns:
        The hook's state (its bytes: ``state.comm.stats``).

    Raises:
        ValueError: ``DistributedDataParallelKwargs`` names a hook; ``model`` is not the
            prepared one while several processes run.

    Example:
        ```python
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        state = compress_gradients(accelerator, model, PowerSGD(rank=4))
        ```
    """
    handler: Any = accelerator.ddp_handler
    hook = getattr(handler, "comm_hook", DDPCommunicationHookType.NO)
    if hook != DDPCommunicationHookType.NO:
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={getattr(hook, '__name__', hook)!r}): "
            "Accelerate registers only its DDPCommunicationHookType hooks and ignores any other "
            "value, and DDP takes one hook; leave comm_hook unset and let compress_gradients "
            "register commfuse's"
        )
    if isinstance(model, DistributedDataParallel):
        state = CompressionState(compressor, module=model.module, config=comm_config)
        model.register_comm_hook(state, compressed_allreduce_hook)
    elif accelerator.num_processes == 1:
        state = CompressionState(compressor, module=model, config=comm_config)
    else:
        raise ValueError(
            f"compress_gradients needs the model accelerator.prepare returned (wrapped in "
            f"DistributedDataParallel), got {type(model).__name__}"
        )
    accelerator.register_for_checkpointing(PerRankState(state))
    return state


def periodic_optimizer(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    method: PeriodicMethod,
    *,
    comm_config: CommConfig | None = None,
) -> PeriodicSyncOptimizer:
    """Train ``model`` with a periodic method (DiLoCo, local SGD, streaming DiLoCo ...): each
    rank steps ``optimizer`` on its own replica and the replicas exchange every H steps; each
    rank's replica, anchors and outer state saved and restored by ``save_state``/``load_state``.

    Args:
        accelerator: the ``Accelerator`` of the run (its process group is the replicas').
        model: the plain module, not passed through ``accelerator.prepare`` (which would wrap
            it in DDP and all-reduce the gradients every step besides the exchange); move it
            with ``model.to(accelerator.device)``.
        optimizer: the inner optimizer over ``model``'s parameters, prepared or not.
        method: ``diloco(H=50)``, ``local_sgd(H=8)``, any ``PeriodicMethod``.
        comm_config: the replicas' communicator's deadlines and tracing.

    Returns:
        The optimizer to step (``finish()`` at the end: one model on every rank).

    Raises:
        ValueError: ``model`` is wrapped in DDP over the replicas (from ``prepare``);
            Accelerate runs each of several launched processes alone (no ``cpu=True`` on a
            machine without a GPU).

    Example:
        ```python
        optimizer = periodic_optimizer(accelerator, model, AdamW(model.parameters()), diloco(H=50))
        ```
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes < launched:
        raise ValueError(
            f"{launched} processes were launched but Accelerate runs each alone "
            f"({accelerator.distributed_type}): on a machine without a GPU pass "
            "Accelerator(cpu=True)"
        )
    comm = Communicator(config=comm_config, name="periodic")
    periodic = PeriodicSyncOptimizer(optimizer, model, comm, method)
    accelerator.register_for_checkpointing(PerRankState(periodic))
    return periodic
