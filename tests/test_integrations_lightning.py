"""commfuse inside PyTorch Lightning, on 2 CPU ranks over gloo: the compressed DDP hook and a
periodic method through ``commfuse.integrations.lightning``, with the real Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

# Deadlines against a hang, not timings: the first test of a session imports the trainer in
# every rank, tens of seconds each on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def regression_module() -> Any:
    """A small MLP regression as a LightningModule, the same start on every rank."""
    import lightning

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
            self.losses: list[float] = []

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)

    return Regression()


def regression_data() -> torch.utils.data.DataLoader[Any]:
    """64 samples of one teacher, 32 per rank (Lightning's DistributedSampler), 4 batches."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 16, generator=gen)
    y = x @ torch.randn(16, 1, generator=gen) / 4
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(
    strategy: Any,
    epochs: int,
    root: str,
    *,
    resume: str | None = None,
    own_optimizer: bool = False,
    **kw: Any,
) -> Any:
    import lightning

    model = regression_module()
    if own_optimizer:  # configure_optimizers returns the periodic optimizer itself
        from commfuse.comm import Communicator
        from commfuse.localsgd import PeriodicSyncOptimizer

        method = strategy.method

        def configure_optimizers() -> Any:
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
            return PeriodicSyncOptimizer(inner, model, Communicator(), method)

        model.configure_optimizers = configure_optimizers
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        max_epochs=epochs,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
    trainer.fit(model, regression_data(), ckpt_path=resume)
    return model


def params_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def every_epoch(root: str) -> Any:
    import lightning

    return lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=root, filename="{epoch}", every_n_epochs=1, save_top_k=-1
    )


def hook_run(root: str) -> dict[str, Any]:
    """Train 4 epochs under the hook, checkpointing each; then resume a fresh model and
    strategy from the end of epoch 2 and train to epoch 4."""
    from commfuse.compress import PowerSGD
    from commfuse.integrations.lightning import CommfuseDDPStrategy

    strategy = CommfuseDDPStrategy(PowerSGD(rank=2, warmup=1, algo="native"))
    model = fit(strategy, 4, root, callbacks=[every_epoch(root)])
    assert strategy.hook_state is not None
    resumed_strategy = CommfuseDDPStrategy(PowerSGD(rank=2, warmup=1, algo="native"))
    resumed = fit(
        resumed_strategy, 4, root, resume=f"{root}/epoch=1.ckpt", enable_checkpointing=False
    )
    return {
        "losses": model.losses,
        "params": params_of(model),
        "resumed": params_of(resumed),
        "bytes": strategy.hook_state.comm.stats.total().handed_bytes,
        "steps": dict(strategy.hook_state.steps),
    }


def test_the_hook_strategy_trains_and_resumes_exactly(pool: Any, tmp_path: Path) -> None:
    """On CPU (where Lightning's own ``ddp_comm_hook`` is never registered) the hook runs every
    step; a checkpoint from the middle of the run resumes to the same parameters, bit for bit,
    PowerSGD's factors and error feedback included."""
    results = pool(2).run(hook_run, str(tmp_path), timeout_s=600)
    for result in results:
        assert sum(result["losses"][-4:]) < 0.5 * sum(result["losses"][:4])
        assert set(result["steps"].values()) == {16}  # 4 epochs x 4 batches, every parameter
        assert result["bytes"] > 0
        assert torch.equal(result["resumed"], result["params"])
    assert torch.equal(results[0]["params"], results[1]["params"])


def periodic_run(root: str, own_optimizer: bool) -> dict[str, Any]:
    """DiLoCo with H=3 for 4 epochs (16 steps: the last exchange at 15, ``finish()`` averages
    the last step), checkpointing each epoch, then a resume from the end of epoch 2."""
    from commfuse.integrations.lightning import CommfusePeriodicStrategy
    from commfuse.localsgd import diloco

    method = diloco(H=3, outer_lr=0.7, outer_momentum=0.9)
    strategy = CommfusePeriodicStrategy(method)
    model = fit(strategy, 4, root, own_optimizer=own_optimizer, callbacks=[every_epoch(root)])
    resumed_strategy = CommfusePeriodicStrategy(method)
    resumed = fit(
        resumed_strategy,
        4,
        root,
        own_optimizer=own_optimizer,
        resume=f"{root}/epoch=1.ckpt",
        enable_checkpointing=False,
    )
    return {
        "losses": model.losses,
        "params": params_of(model),
        "resumed": params_of(resumed),
        "syncs": len(strategy.periodic.syncs),
        "bytes": strategy.periodic.world_comm.stats.total().handed_bytes,
    }


@pytest.mark.parametrize("own_optimizer", [False, True], ids=["strategy-wraps", "module-returns"])
def test_diloco_runs_as_a_strategy_and_resumes_exactly(
    pool: Any, tmp_path: Path, own_optimizer: bool
) -> None:
    """The strategy wraps the module's optimizer, or takes the ``PeriodicSyncOptimizer`` that
    ``configure_optimizers`` returns (Lightning refused it as "Unknown configuration for model
    optimizers" before it took a closure and showed ``defaults`` and ``state``)."""
    results = pool(2).run(periodic_run, str(tmp_path), own_optimizer, timeout_s=600)
    for result in results:
        assert sum(result["losses"][-4:]) < 0.5 * sum(result["losses"][:4])
        assert result["syncs"] == 16 // 3 + 1  # every 3 steps, and finish()'s average
        assert result["bytes"] > 0
        assert torch.equal(result["resumed"], result["params"])
    assert torch.equal(results[0]["params"], results[1]["params"])
