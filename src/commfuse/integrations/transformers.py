"""commfuse's compressed DDP hook under transformers' ``Trainer``, as a callback.

The ``Trainer`` wraps the model in DDP inside ``train()`` and hands callbacks the unwrapped
model, and its checkpoints hold the model, optimizer, scheduler and RNG states, not a hook's.
``CompressionCallback(trainer, compressor)``:

1. at ``on_train_begin`` (the model is wrapped by then) registers ``compressed_allreduce_hook``
   on ``trainer.model_wrapped`` with a ``CompressionState`` of the model;
2. at ``on_save`` writes each rank's hook state into the checkpoint's folder, beside the
   Trainer's own per-rank RNG files (error feedback differs per rank);
3. on a resumed ``train()`` (``state.global_step`` above 0 at ``on_train_begin``) loads this
   rank's file from the checkpoint the run resumes from, so the run continues exactly. The
   Trainer tells callbacks neither that path nor its own object, so the callback notes the
   ``resume_from_checkpoint`` of the trainer's ``train`` (which it wraps: a folder anywhere, or
   ``True`` for the last under ``output_dir``); without one, ``output_dir/checkpoint-<step>``.

Example:
    ```python
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(CompressionCallback(trainer, PowerSGD(rank=4)))
    trainer.train()
    ```
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from commfuse.comm import CommConfig
from commfuse.compress.base import Compressor
from commfuse.hooks import CompressionState, compressed_allreduce_hook


def state_file(folder: str) -> str:
    """This rank's hook-state file in a checkpoint folder."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(folder, f"commfuse_hook_state_rank{rank}.pt")


class CompressionCallback(TrainerCallback):
    """Average the ``Trainer``'s gradients through ``compressor`` (commfuse's DDP hook), its
    state saved and resumed with the Trainer's checkpoints.

    Args:
        trainer: the ``Trainer`` this callback is added to (callbacks are not given it).
        compressor: how every bucket is exchanged (``PowerSGD(rank=4)``, ``TopK(ratio=0.01)``).
        comm_config: the hook communicator's deadlines and tracing.

    Raises:
        ValueError: ``compressor`` is not a commfuse compressor.

    Example:
        ```python
        trainer.add_callback(CompressionCallback(trainer, PowerSGD(rank=4)))
        ```
    """

    def __init__(
        self, trainer: Trainer, compressor: Compressor, *, comm_config: CommConfig | None = None
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise ValueError(f"CompressionCallback needs a commfuse compressor, got {compressor!r}")
        self.trainer = trainer
        self.compressor = compressor
        self.comm_config = comm_config
        self.hook_state: CompressionState | None = None
        """The hook's state once training began (bytes: ``hook_state.comm.stats``)."""
        self._registered_on: DistributedDataParallel | None = None
        self._resume_from: str | None = None
        trainer.train = self._noting_checkpoint(trainer.train)  # type: ignore[method-assign]

    def _noting_checkpoint(self, train: Callable[..., Any]) -> Callable[..., Any]:
        """``train`` that first notes the folder it resumes from (for ``on_train_begin``)."""

        @functools.wraps(train)
        def train_noting_checkpoint(*args: Any, **kwargs: Any) -> Any:
            folder = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            if folder is True:
                folder = get_last_checkpoint(self.trainer.args.output_dir)  # type: ignore[no-untyped-call]
            self._resume_from = os.fspath(folder) if isinstance(folder, str | os.PathLike) else None
            return train(*args, **kwargs)

        return train_noting_checkpoint

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        if isinstance(model, DistributedDataParallel) and model is not self._registered_on:
            self.hook_state = CompressionState(
                self.compressor, module=model.module, config=self.comm_config
            )
            model.register_comm_hook(self.hook_state, compressed_allreduce_hook)
            self._registered_on = model
        if self.hook_state is None or state.global_step == 0:
            return
        folder = self._resume_from or os.path.join(
            args.output_dir, f"checkpoint-{state.global_step}"
        )
        path = state_file(folder)
        if os.path.exists(path):
            self.hook_state.load_state_dict(torch.load(path, weights_only=True))
        else:
            warnings.warn(
                f"resuming at step {state.global_step} without the hook's state ({path} is "
                "missing): the compressor starts afresh (error feedback lost)",
                stacklevel=2,
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook_state is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.hook_state.state_dict(), state_file(folder))
