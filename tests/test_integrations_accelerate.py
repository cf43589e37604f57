"""commfuse's hook under Hugging Face Accelerate, on 2 CPU ranks over gloo, with the real
Accelerate: ``commfuse.integrations.accelerate.compress_gradients``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

# Deadlines against a hang, not timings: the first test of a session imports the trainer in
# every rank, tens of seconds each on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same on a resumed run."""
    gen = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + step)
    x = torch.randn(16, 16, generator=gen)
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    return x, x @ teacher / 4


def train(root: str, *, resume: bool, steps: int = 12, save_at: int = 6) -> dict[str, Any]:
    """Train with PowerSGD through the hook; the uninterrupted run saves its state at
    ``save_at``, the resumed one loads it and trains the remaining steps."""
    from accelerate import Accelerator

    from commfuse.compress import PowerSGD
    from commfuse.integrations.accelerate import compress_gradients

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    model, optimizer = accelerator.prepare(net, optimizer)
    state = compress_gradients(accelerator, model, PowerSGD(rank=2, warmup=1, algo="native"))
    start = 0
    if resume:
        accelerator.load_state(root)
        start = save_at
    losses = []
    for step in range(start, steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if not resume and step + 1 == save_at:
            accelerator.save_state(root)
    return {
        "losses": losses,
        "params": torch.cat([p.detach().flatten() for p in net.parameters()]),
        "bytes": state.comm.stats.total().handed_bytes,
        "steps": set(state.steps.values()),
    }


def run_and_resume(root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return train(root, resume=False), train(root, resume=True)


def test_the_hook_trains_and_resumes_exactly(pool: Any, tmp_path: Path) -> None:
    """The hook runs every step (bytes counted, every parameter's step count); a state saved
    mid-run resumes to the same parameters, bit for bit, PowerSGD's factors and error
    feedback (which differ per rank) included."""
    results = pool(2).run(run_and_resume, str(tmp_path), timeout_s=600)
    for full, resumed in results:
        assert sum(full["losses"][-3:]) < 0.5 * sum(full["losses"][:3])
        assert full["steps"] == {12} and resumed["steps"] == {12}
        assert full["bytes"] > 0
        assert torch.equal(resumed["params"], full["params"])
    assert torch.equal(results[0][0]["params"], results[1][0]["params"])


def hook_in_kwargs() -> str:
    """The form Accelerate ignores silently: commfuse's hook in DistributedDataParallelKwargs."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from commfuse.compress import PowerSGD
    from commfuse.hooks import compressed_allreduce_hook
    from commfuse.integrations.accelerate import compress_gradients

    kwargs = DistributedDataParallelKwargs(comm_hook=compressed_allreduce_hook)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    model = accelerator.prepare(nn.Linear(4, 1))
    try:
        compress_gradients(accelerator, model, PowerSGD(rank=1))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_hook_in_the_ddp_kwargs_is_refused(pool: Any) -> None:
    for message in pool(2).run(hook_in_kwargs, timeout_s=600):
        assert "compressed_allreduce_hook" in message
        assert "ignores any other value" in message


def diloco_train(root: str, *, resume: bool, steps: int = 12, save_at: int = 6) -> dict[str, Any]:
    """DiLoCo with H=3 through ``periodic_optimizer`` (the model not prepared, the optimizer
    prepared); the uninterrupted run saves its state at ``save_at``, the resumed one loads it."""
    from accelerate import Accelerator

    from commfuse.integrations.accelerate import periodic_optimizer
    from commfuse.localsgd import diloco

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    inner = accelerator.prepare(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5))
    method = diloco(H=3, outer_lr=0.7, outer_momentum=0.9)
    optimizer = periodic_optimizer(accelerator, net, inner, method)
    start = 0
    if resume:
        accelerator.load_state(root)
        start = save_at
    losses, moved_at = [], []
    for step in range(start, steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        sent = optimizer.world_comm.stats.total().handed_bytes
        optimizer.step()
        optimizer.zero_grad()
        if optimizer.world_comm.stats.total().handed_bytes != sent:
            moved_at.append(step + 1)
        losses.append(float(loss.detach()))
        if not resume and step + 1 == save_at:
            accelerator.save_state(root)
    syncs = len(optimizer.syncs)
    optimizer.finish()
    return {
        "losses": losses,
        "params": torch.cat([p.detach().flatten() for p in net.parameters()]),
        "moved_at": moved_at,
        "syncs": syncs,
    }


def diloco_run_and_resume(root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return diloco_train(root, resume=False), diloco_train(root, resume=True)


def test_diloco_trains_exchanges_every_h_steps_and_resumes_exactly(
    pool: Any, tmp_path: Path
) -> None:
    """The model stays out of ``prepare`` (no DDP all-reduce): bytes move at steps 3, 6, 9 and
    12 only (12 steps / H=3 exchanges), every rank ends with the same model, and a state saved
    at step 6 resumes to the same parameters bit for bit (each rank's replica, inner momentum,
    anchors and outer momentum restored: rank 0's alone would not do)."""
    results = pool(2).run(diloco_run_and_resume, str(tmp_path), timeout_s=600)
    for full, resumed in results:
        assert sum(full["losses"][-3:]) < 0.5 * sum(full["losses"][:3])
        assert full["moved_at"] == [3, 6, 9, 12] and full["syncs"] == 12 // 3
        assert resumed["moved_at"] == [9, 12]
        assert torch.equal(resumed["params"], full["params"])
    assert torch.equal(results[0][0]["params"], results[1][0]["params"])


def diloco_over_a_prepared_model() -> str:
    """The natural form that was silently wrong: the model through ``prepare`` (DDP) and
    DiLoCo over it."""
    from accelerate import Accelerator

    from commfuse.integrations.accelerate import periodic_optimizer
    from commfuse.localsgd import diloco

    accelerator = Accelerator(cpu=True)
    net = nn.Linear(4, 1)
    model, inner = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        periodic_optimizer(accelerator, model, inner, diloco(H=3))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_diloco_over_a_prepared_model_is_refused_saying_what_to_do(pool: Any) -> None:
    for message in pool(2).run(diloco_over_a_prepared_model, timeout_s=600):
        assert "DistributedDataParallel" in message
        assert "accelerator.prepare(loader)" in message and "unwrapped module" in message
