"""commfuse's compressors as PyTorch DDP communication hooks: one line for a plain DDP user.

```python
from commfuse.compress import TopK
from commfuse.hooks import CompressionState, compressed_allreduce_hook

ddp = torch.nn.parallel.DistributedDataParallel(model)
ddp.register_comm_hook(CompressionState(TopK(ratio=0.01), module=ddp),
                       compressed_allreduce_hook)
```

DDP calls a hook as ``hook(state, bucket) -> Future[Tensor]`` each time a bucket of gradients
is ready during backward, in bucket order on every rank, and waits on the futures before the
optimizer step (the shape of torch's own ``allreduce_hook`` and ``powerSGD_hook``). This hook:

1. takes the bucket's flat buffer (``bucket.buffer()``) and its index (``bucket.index()``),
   hands the compressor the bucket's layout: the names of its parameters (from ``module``)
   and their shapes (``Compressor.set_layout``), and counts the step under those parameters.
   The compressor files the bucket's state (residuals, momentum, factors) under them too, and
   PowerSGD compresses each weight matrix on its own, as torch's ``powerSGD_hook`` does;
2. queues ``compressor.reduce_`` on the communicator's worker thread
   (``Communicator.submit``), so backward keeps computing the next buckets
   while this one is compressed and exchanged, which is the overlap DDP exists for;
3. returns a Future that the worker completes with the averaged buffer (or the error).

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations at
registration and rejects string annotations.)

Design notes: ``docs/data-parallel.md``, "The DDP hooks: rebuilt buckets and the private process
group".
"""

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # = dist.GradBucket, visible to mypy

from commfuse.comm import CommConfig, Communicator
from commfuse.compress.base import Compressor
from commfuse.compress.layout import BucketLayout


@dataclasses.dataclass
class CompressionState:
    """What ``compressed_allreduce_hook`` needs: a compressor, the names of the parameters,
    a communicator, step counters.

    It may be built before ``torch.distributed.init_process_group()`` (a trainer's strategy is
    often configured first): it then binds to the process group at its first use, the first
    bucket DDP hands the hook, on every rank at once.

    Raises:
        ValueError: ``module`` has no parameters; at the first use, no process group is up.

    Example:
        ```python
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = CompressionState(PowerSGD(rank=4), module=model)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        ```
    """

    compressor: Compressor
    """The compressor every bucket goes through."""
    _: dataclasses.KW_ONLY
    module: torch.nn.Module
    """The model DDP wraps (or the DDP module itself): its parameter names identify each
    bucket's state across DDP's bucket rebuild and in checkpoints."""
    process_group: dist.ProcessGroup | None = None
    """The ranks to average over (DDP's group; None = the world)."""
    config: CommConfig | None = None
    """The communicator's deadlines and tracing (default: ``CommConfig()``)."""
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Steps each parameter has been reduced in, by name: a bucket's ``step`` (handed to the
    compressor) is its parameters' count, so it follows them when DDP rebuilds its buckets or a
    resumed job lays them out anew."""
    names: dict[int, str] = dataclasses.field(init=False, repr=False)
    """``id(parameter) -> name`` for every parameter of ``module``."""
    _comm: Communicator | None = dataclasses.field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.compressor, Compressor):
            raise ValueError(
                "CompressionState needs a commfuse.compress.Compressor object, e.g. "
                f"TopK(ratio=0.01), got {self.compressor!r}"
            )
        # The wrapped model's names, the same whether DDP or its module was passed.
        model = self.module
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        self.names = {id(p): name for name, p in model.named_parameters()}
        if not self.names:
            raise ValueError("CompressionState: module has no parameters to name the buckets by")
        if dist.is_initialized():
            self._bind()

    @property
    def comm(self) -> Communicator:
        """The hook's communicator over a private group of ``process_group``'s ranks, made
        at construction when the process group is up, else at this first use.

        Raises:
            ValueError: no process group is up yet."""
        if self._comm is None:
            self._bind()
        assert self._comm is not None
        return self._comm

    def _bind(self) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "CompressionState is used before torch.distributed.init_process_group(): "
                "start the process group before the first backward"
            )
        parent = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        # Private group: see the module docstring (ordering against DDP's own collectives).
        # Every rank reaches this at the same point (construction, or its first bucket), as
        # ``new_group`` requires.
        private = dist.new_group(ranks=ranks)
        self._comm = Communicator(private, config=self.config, name="ddp-hook")

    def next_step(self, layout: BucketLayout) -> int:
        """The step of the bucket holding ``layout``'s parameters, counted for them: the most
        steps any of them has been through (a rebuilt bucket is as far as its parameters)."""
        step = max((self.steps.get(name, 0) for name in layout.names), default=0)
        for name in layout.names:
            self.steps[name] = step + 1
        return step

    def layout_of(self, bucket: GradBucket) -> BucketLayout:
        """The names and shapes of the parameters in ``bucket``, in buffer order."""
        try:
            names = tuple(self.names[id(p)] for p in bucket.parameters())
        except KeyError:
            raise ValueError(
                "CompressionState: a DDP bucket holds a parameter that is not in "
                "CompressionState.module; pass the model that DDP wraps"
            ) from None
        return BucketLayout(names=names, shapes=tuple(g.shape for g in bucket.gradients()))

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state and the step counters, both by parameter (for a checkpoint;
        a resumed job may bucket the parameters differently)."""
        return {"compressor": self.compressor.state_dict(), "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``.

        Raises:
            ValueError: the step counters name parameters that ``module`` does not have."""
        steps = {str(name): int(count) for name, count in state["steps"].items()}
        unknown = sorted(set(steps) - set(self.names.values()))
        if unknown:
            raise ValueError(
                f"CompressionState.load_state_dict: steps of parameters {unknown[:3]} that the "
                "module does not have; load the checkpoint of this model"
            )
        self.compressor.load_state_dict(state["compressor"])
        self.steps = steps


def compressed_allreduce_hook(
    state: CompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks through ``state.compressor`` on a background thread.

    Args:
        state: the compressor, the private communicator and the per-parameter step counters.
        bucket: DDP's bucket of gradients (its flat buffer, its index, its tensors' shapes).

    Returns:
        A future that completes with the bucket's buffer, averaged over the ranks, or with the
        error of the exchange.

    Raises:
        CommTimeoutError: through the future, when the exchange passed the deadline.
        PeerFailureError: through the future, when a peer died mid-exchange.

    Example:
        ```python
        state = CompressionState(TopK(ratio=0.01), module=model)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        ```
    """
    buffer = bucket.buffer()
    index = bucket.index()
    # The bucket's parameters (views into ``buffer``, in order): their step, the compressor's
    # state for them, and PowerSGD's matrices. Here, on DDP's thread, before the job is queued,
    # so the worker never sees a layout change halfway through a bucket.
    layout = state.layout_of(bucket)
    step = state.next_step(layout)
    compressor = state.compressor
    compressor.set_layout(index, layout)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def work() -> None:
        try:
            with state.comm.at_step(step):
                compressor.reduce_(state.comm, buffer, bucket=index, step=step)
        except Exception as err:
            future.set_exception(err)  # type: ignore[arg-type]
            raise
        future.set_result(buffer)

    state.comm.submit(f"ddp-hook.{compressor.name}[bucket {index}]", work)
    return future
