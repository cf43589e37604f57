"""commfuse's hook under transformers' ``Trainer``, on 2 CPU ranks over gloo, with the real
transformers: ``commfuse.integrations.transformers.CompressionCallback``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

# Deadlines against a hang, not timings: the first test of a session imports the trainer in
# every rank, tens of seconds each on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


class Regression(nn.Module):
    """A small MLP that returns its loss, as the Trainer expects of a model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.net(x), labels)
        self.losses.append(float(loss.detach()))
        return {"loss": loss}


def regression_data() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(128, 16, generator=gen)
    y = x @ torch.randn(16, 1, generator=gen) / 4
    return [{"x": x[i], "labels": y[i]} for i in range(len(x))]


def train(root: str, *, resume: str | None = None) -> dict[str, Any]:
    """12 steps with PowerSGD through the callback, a checkpoint every 6 under ``root`` (a
    resumed run starts from the checkpoint folder ``resume``)."""
    from transformers import Trainer, TrainingArguments

    from commfuse.compress import PowerSGD
    from commfuse.integrations.transformers import CompressionCallback

    model = Regression()
    args = TrainingArguments(
        output_dir=root,
        use_cpu=True,
        per_device_train_batch_size=8,
        max_steps=12,
        save_steps=6,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=regression_data())
    callback = CompressionCallback(trainer, PowerSGD(rank=2, warmup=1, algo="native"))
    trainer.add_callback(callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    assert callback.hook_state is not None
    return {
        "warnings": [str(w.message) for w in caught if "hook's state" in str(w.message)],
        "losses": model.losses,
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "bytes": callback.hook_state.comm.stats.total().handed_bytes,
        "steps": set(callback.hook_state.steps.values()),
    }


def run_and_resume(root: str) -> list[dict[str, Any]]:
    """The run that goes on, then two resumed from its checkpoint-6: in its own output_dir,
    and in another output_dir (the checkpoint found only through ``resume_from_checkpoint``)."""
    full = train(f"{root}/run")
    return [
        full,
        train(f"{root}/run", resume=f"{root}/run/checkpoint-6"),
        train(f"{root}/elsewhere", resume=f"{root}/run/checkpoint-6"),
    ]


def test_the_callback_trains_and_resumes_exactly(pool: Any, tmp_path: Path) -> None:
    """The hook runs every step on the Trainer's DDP model (bytes counted); checkpoint-6
    resumes to the same parameters, bit for bit, as the run that went on (PowerSGD's factors
    and each rank's error feedback restored from the checkpoint's folder), also into another
    ``output_dir`` (where ``output_dir/checkpoint-6`` does not exist)."""
    results = pool(2).run(run_and_resume, str(tmp_path), timeout_s=600)
    for full, *resumed_runs in results:
        assert sum(full["losses"][-3:]) < 0.5 * sum(full["losses"][:3])
        assert full["steps"] == {12} and full["bytes"] > 0
        for resumed in resumed_runs:
            assert resumed["warnings"] == []
            assert resumed["steps"] == {12}
            assert torch.equal(resumed["params"], full["params"])
    assert torch.equal(results[0][0]["params"], results[1][0]["params"])
