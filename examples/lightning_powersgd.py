"""commfuse's PowerSGD hook in a PyTorch Lightning run, on CPU or GPU, its state in the checkpoint.

Run it on 2 local ranks (or under torchrun, unchanged):

    commfuse launch --nproc 2 examples/lightning_powersgd.py
    torchrun --nproc-per-node 2 examples/lightning_powersgd.py
"""

import os

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

from commfuse.compress import PowerSGD
from commfuse.integrations.lightning import CommfuseDDPStrategy


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)
        )

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :4] > 0).long().argmax(dim=1)
    data = DataLoader(TensorDataset(x, y), batch_size=32)  # Lightning shards it per rank
    model = Classifier()
    # Rank-4 factors after 2 uncompressed warm-up steps, on CPU (gloo) as on GPU (NCCL).
    strategy = CommfuseDDPStrategy(PowerSGD(rank=4, warmup=2))
    trainer = lightning.Trainer(
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="out/lightning_powersgd",
    )
    trainer.fit(model, data)  # checkpoints hold every rank's PowerSGD state

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {trainer.global_rank} checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
