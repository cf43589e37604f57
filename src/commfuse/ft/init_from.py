"""A fault-tolerant run that starts from a checkpoint (``TrainConfig.init_from``).

torchft's replicas start from the same state without exchanging it (``init_sync=False``: each
builds the model from the seed), so every replica group, every life of it, loads the same
state: rank 0's file of the checkpoint's latest step (a data-parallel checkpoint holds the
same model on every rank; a local-SGD one after its final synchronisation does too). The run
then counts its steps from the checkpoint's, as ``commfuse train --init-from`` does without
torchft: per step, the Manager's committed step starts there and the batches are those of
the steps that follow; per period, the periods are those of the remaining steps and each
inner step trains the batch of its step in the whole run. A replica restarted later loads
the checkpoint too, finds the quorum ahead of it and recovers from a live peer as usual.
"""

from __future__ import annotations

import torch

from commfuse.train import loop
from commfuse.train.loop import TrainConfig


def load_init_from(
    config: TrainConfig, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load ``init_from``'s model and optimizer state (rank 0's file) into ``module`` and
    ``optimizer``, onto the device of ``module``'s parameters; return its step (0 without).

    Raises:
        ValueError: the checkpoint is at or past the run's total, or unreadable.
    """
    device = next(module.parameters()).device
    return loop.load_init_from(config, module, optimizer, rank=0, device=device)
