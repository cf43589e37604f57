"""PyTorch Lightning strategies that run commfuse: a compressed DDP hook, or a periodic method.

Lightning's own ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a hook only
when the device is CUDA, saves the checkpoint from rank 0 alone, and wraps every model in DDP,
so none of its arguments gives commfuse's hook on CPU, its per-rank state on resume, or a
periodic method without a gradient all-reduce every step. The two strategies here do:

1. ``CommfuseDDPStrategy(compressor)`` wraps the model in DDP as Lightning does, then registers
   ``compressed_allreduce_hook`` on any device. ``save_checkpoint`` gathers every rank's
   ``CompressionState.state_dict()`` into the checkpoint; on resume each rank loads its own.
2. ``CommfusePeriodicStrategy(method)`` leaves the model unwrapped and turns the optimizer of
   ``configure_optimizers`` into a ``PeriodicSyncOptimizer`` (or takes one returned there);
   ``finish()`` runs at the end of fit. Replicas differ between synchronisations, so each rank's
   optimizer state (its replica, anchors, inner state) is saved and restored per rank.

Example:
    ```python
    trainer = lightning.Trainer(strategy=CommfuseDDPStrategy(PowerSGD(rank=4)), ...)
    ```
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from commfuse.comm import CommConfig, Communicator
from commfuse.compress.base import Compressor
from commfuse.hooks import CompressionState, compressed_allreduce_hook
from commfuse.integrations._per_rank import gather_states, own_state
from commfuse.localsgd import PeriodicMethod, PeriodicSyncOptimizer

#: The checkpoint's entry holding every rank's state, indexed by global rank.
HOOK_STATES = "commfuse_hook_states"
OPTIMIZER_STATES = "commfuse_optimizer_states"


class CommfuseDDPStrategy(DDPStrategy):
    """Lightning's DDP with commfuse's compressed all-reduce hook, on CPU and GPU.

    Args:
        compressor: how every bucket is exchanged (``PowerSGD(rank=4)``, ``TopK(ratio=0.01)``).
        comm_config: the hook communicator's deadlines and tracing.
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend``, ``timeout``,
            DDP's ``bucket_cap_mb`` ...), but not its ``ddp_comm_*`` hook arguments.

    Raises:
        ValueError: ``compressor`` is not a commfuse compressor, or a ``ddp_comm_*`` argument
            was given too (one hook per model).
    """

    def __init__(
        self, compressor: Compressor, *, comm_config: CommConfig | None = None, **kwargs: Any
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise ValueError(f"CommfuseDDPStrategy needs a commfuse compressor, got {compressor!r}")
        clash = sorted(k for k in kwargs if k.startswith("ddp_comm_"))
        if clash:
            raise ValueError(f"CommfuseDDPStrategy registers its own hook; drop {clash}")
        super().__init__(**kwargs)
        self.compressor = compressor
        self.comm_config = comm_config
        self.hook_state: CompressionState | None = None
        """The hook's state once the model is wrapped (bytes: ``hook_state.comm.stats``)."""
        self._resume: dict[str, Any] | None = None

    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state = CompressionState(
            self.compressor, module=self.model.module, config=self.comm_config
        )
        if self._resume is not None:
            self.hook_state.load_state_dict(self._resume)
            self._resume = None
        # Lightning registers torch's hooks on CUDA only; DDP runs this one on any device.
        self.model.register_comm_hook(self.hook_state, compressed_allreduce_hook)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        # Lightning calls this on every rank and writes rank 0's dictionary.
        if self.hook_state is not None:
            checkpoint[HOOK_STATES] = gather_states(self.hook_state.state_dict())
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if HOOK_STATES in checkpoint:
            own = own_state(checkpoint[HOOK_STATES], "hook states")
            if self.hook_state is not None:
                self.hook_state.load_state_dict(own)
            else:  # restored before the model is wrapped: loaded in configure_ddp
                self._resume = own
        return checkpoint


class CommfusePeriodicStrategy(DDPStrategy):
    """Local SGD, DiLoCo and the other periodic methods as a Lightning strategy: no gradient
    all-reduce, the replicas' exchange every H steps, ``finish()`` at the end of fit.

    Args:
        method: the periodic method (``diloco(H=50)``, ``local_sgd(H=8)``, ...).
        comm_config: the replicas' communicator's deadlines and tracing.
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend``, ``timeout``).

    Raises:
        ValueError: ``configure_optimizers`` returned more than one optimizer.
    """

    def __init__(
        self,
        method: PeriodicMethod,
        *,
        comm_config: CommConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.method = method
        self.comm_config = comm_config

    def configure_ddp(self) -> None:
        """The model stays as it is: each rank trains its own replica between exchanges."""

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"CommfusePeriodicStrategy runs one optimizer, got {len(self.optimizers)} "
                "from configure_optimizers"
            )
        optimizer: Any = self.optimizers[0]  # Lightning's type says torch's Optimizer
        if not isinstance(optimizer, PeriodicSyncOptimizer):
            assert self.lightning_module is not None
            comm = Communicator(config=self.comm_config, name="periodic")
            optimizer = PeriodicSyncOptimizer(optimizer, self.lightning_module, comm, self.method)
        self.optimizers = [optimizer]

    @property
    def periodic(self) -> PeriodicSyncOptimizer:
        """The periodic optimizer (its ``syncs``, ``world_comm.stats``), once fit started."""
        optimizer = self.optimizers[0]
        assert isinstance(optimizer, PeriodicSyncOptimizer)
        return optimizer

    def on_train_end(self) -> None:
        self.periodic.finish()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if "optimizer_states" in checkpoint:
            checkpoint[OPTIMIZER_STATES] = gather_states(checkpoint["optimizer_states"])
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if OPTIMIZER_STATES in checkpoint:
            own = own_state(checkpoint[OPTIMIZER_STATES], "optimizer states")
            checkpoint = {**checkpoint, "optimizer_states": own}
        super().load_optimizer_state_dict(checkpoint)
