"""Which order a bucket holds its tensors in under torch DDP and under commfuse's engine, and
what PowerSGD makes of the difference (one process, a world of one: both still compress).

PowerSGD starts each bucket's Q from one normal draw seeded by (seed, bucket) and cut into the
matrices' Q's in the order the bucket holds its tensors (torch's hook does the same with its
own generator). The order therefore decides which numbers each matrix starts from:

* commfuse's engine (``ddp/reducer.py``) lays out its buckets once, in reverse registration
  order, and keeps them;
* torch DDP lays out its first step's buckets with registration order inside each bucket,
  and after that step rebuilds them in the order the gradients became ready in it.

Where a model's layers are registered in the order its forward runs them (``nn.Sequential``,
charlm), the ready order is the reverse registration order: from the second step on, torch's
buckets are the engine's, and commfuse's hook on torch DDP (per-step fault tolerance) computes
the engine's bits (tests/test_ft.py's fault-free PowerSGD run relies on it). Where a layer
registered first runs last, the orders differ, each weight starts from another Q, and the two
runs agree in distribution only. The engine keeps its order: it is known before the first
step, where torch's comes from a recorded pass that a resumed run must replay
(``train/torch_ddp.py``); docs/data-parallel.md, "PowerSGD", says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.nn.parallel import DistributedDataParallel

from commfuse.comm import Communicator
from commfuse.compress import PowerSGD
from commfuse.ddp import DataParallel, DataParallelConfig
from commfuse.hooks import CompressionState, compressed_allreduce_hook

#: Two uncompressed steps (torch DDP rebuilds its buckets after the first), then one compressed.
WARMUP = 2
X = torch.randn(8, 24, generator=torch.Generator().manual_seed(1))


class LateFirst(nn.Module):
    """Two linear layers, the one that runs last registered first: its gradients are ready
    first, so torch's rebuilt bucket holds it first, while the engine's reverse registration
    order holds it last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.late = nn.Linear(32, 24)
        self.early = nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.early(x)))  # type: ignore[no-any-return]


def sequential() -> nn.Module:
    """The same two layers, registered in the order they run."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24))


Run = tuple[dict[str, torch.Tensor], list[tuple[str, ...]]]
"""A run's averaged gradients after its first compressed step, and the layouts (parameter
names, in bucket order) PowerSGD was handed at each step."""


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layout(compressor: PowerSGD) -> tuple[str, ...]:
    [layout] = compressor.layouts.values()  # one bucket
    return layout.names


def on_torch_ddp(make: Callable[[], nn.Module]) -> Run:
    """torch DDP with commfuse's PowerSGD hook (what per-step fault tolerance runs)."""
    model = make()
    ddp = DistributedDataParallel(model)
    compressor = PowerSGD(rank=4, warmup=WARMUP)
    ddp.register_comm_hook(CompressionState(compressor, module=model), compressed_allreduce_hook)
    layouts = []
    for _ in range(WARMUP + 1):
        ddp.zero_grad()
        ddp(X).sum().backward()
        layouts.append(_layout(compressor))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, layouts


def on_the_engine(make: Callable[[], nn.Module]) -> Run:
    """commfuse's data-parallel engine with the same PowerSGD."""
    model = make()
    compressor = PowerSGD(rank=4, warmup=WARMUP)
    engine = DataParallel(model, Communicator(), config=DataParallelConfig(compressor=compressor))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the same gradients every step
    layouts = []
    for _ in range(WARMUP + 1):
        optimizer.zero_grad()
        engine(X).sum().backward()
        engine.step(optimizer)
        layouts.append(_layout(compressor))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, layouts


@pytest.mark.usefixtures("world_of_one")
def test_layers_registered_in_the_order_they_run_get_the_engines_bits_on_torch_ddp() -> None:
    torch_grads, torch_layouts = on_torch_ddp(sequential)
    engine_grads, engine_layouts = on_the_engine(sequential)
    reverse_registration = ("2.bias", "2.weight", "0.bias", "0.weight")
    # torch's first step: registration order inside the bucket; then rebuilt in ready order,
    # which is the engine's order throughout.
    assert (
        torch_layouts
        == [("0.weight", "0.bias", "2.weight", "2.bias")] + [reverse_registration] * WARMUP
    )
    assert engine_layouts == [reverse_registration] * (WARMUP + 1)
    for name, grad in torch_grads.items():
        assert torch.equal(grad, engine_grads[name]), name


@pytest.mark.usefixtures("world_of_one")
def test_a_layer_registered_first_and_run_last_starts_from_another_q_on_torch_ddp() -> None:
    torch_grads, torch_layouts = on_torch_ddp(LateFirst)
    engine_grads, engine_layouts = on_the_engine(LateFirst)
    ready = ("late.bias", "late.weight", "early.bias", "early.weight")
    reverse_registration = ("early.bias", "early.weight", "late.bias", "late.weight")
    assert torch_layouts[1:] == [ready] * WARMUP
    assert engine_layouts == [reverse_registration] * (WARMUP + 1)
    # The difference this pins: biases travel exactly and agree; each weight's rank-4
    # approximation starts from another slice of the bucket's first Q, and differs.
    assert torch.equal(torch_grads["late.bias"], engine_grads["late.bias"])
    assert torch.equal(torch_grads["early.bias"], engine_grads["early.bias"])
    assert not torch.equal(torch_grads["late.weight"], engine_grads["late.weight"])
    assert not torch.equal(torch_grads["early.weight"], engine_grads["early.weight"])
