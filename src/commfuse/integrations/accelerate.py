"""commfuse's compressed DDP hook under Hugging Face Accelerate, in one call after ``prepare``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of
torch's hooks and ignores any other value without a word, so commfuse's hook cannot go there.
``compress_gradients(accelerator, model, compressor)``:

1. refuses an ``Accelerator`` whose ``DistributedDataParallelKwargs`` names a hook (ignored, or
   a second hook DDP would refuse), saying what to do instead;
2. builds a ``CompressionState`` for the model ``prepare`` wrapped in DDP and registers
   ``compressed_allreduce_hook`` on it;
3. registers the state with ``accelerator.register_for_checkpointing``, every rank's own (error
   feedback differs per rank), so ``save_state``/``load_state`` resume it exactly.

Example:
    ```python
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    compress_gradients(accelerator, model, PowerSGD(rank=4))
    ```
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commfuse.comm import CommConfig
from commfuse.compress.base import Compressor
from commfuse.hooks import CompressionState, compressed_allreduce_hook
from commfuse.integrations._per_rank import PerRankState


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
