"""``digits``: an MLP classifier on scikit-learn's handwritten digits (ships in the package).

The 1797 8x8 images of ``sklearn.datasets.load_digits`` (UCI optdigits test set), scaled to
[0, 1]. A fixed, stratified-by-construction split: every 5th image (index % 5 == 0) is held out,
the rest train. Each rank's batch is drawn with replacement from the training images with a
generator seeded from (seed, step, rank). Small enough that a test runs dozens of steps in a
second, yet a real data set with a real held-out accuracy (about 95% after a few hundred steps).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.workloads.base import Workload, batch_generator

#: Every HELDOUT_EVERY-th image is held out.
HELDOUT_EVERY = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """Options of ``--workload digits:key=value,...``."""

    hidden: int = 128
    """Width of each of the two hidden layers."""
    batch: int = 32
    """Images per rank per step."""
    lr: float = 1e-2
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.batch < 1:
            raise ValueError(
                f"hidden and batch must be at least 1, got {self.hidden}, {self.batch}"
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@functools.lru_cache(maxsize=1)
def load_split_tensors() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train": (x, y), "heldout": (x, y)}``; x float32 (n, 64) in [0, 1], y int64."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    held = torch.arange(len(y)) % HELDOUT_EVERY == 0
    return {"train": (x[~held], y[~held]), "heldout": (x[held], y[held])}


class Digits(Workload):
    """See the module docstring."""

    name = "digits"

    def __init__(self, options: DigitsConfig | None = None, *, device: torch.device) -> None:
        super().__init__(device=device)
        self.options = options or DigitsConfig()

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # initialised on the CPU, then moved: the same on every device
        h = self.options.hidden
        model = nn.Sequential(
            nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)
        )
        return model.to(self.device)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.options.lr, weight_decay=self.options.weight_decay)

    def batch(
        self, step: int, rank: int, world_size: int, *, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        x, y = load_split_tensors()["train"]
        # Drawn and gathered on the CPU (the seeded generator and the images live there), then
        # moved to the workload's device.
        gen = batch_generator(seed, step, rank)
        idx = torch.randint(0, len(y), (self.options.batch,), generator=gen, device="cpu")
        return x[idx].to(self.device, non_blocking=True), y[idx].to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x, y = (t.to(self.device, non_blocking=True) for t in load_split_tensors()["heldout"])
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(x)
        model.train(was_training)
        return {
            "loss": float(F.cross_entropy(logits, y)),
            "accuracy": float((logits.argmax(1) == y).float().mean()),
        }

    def describe(self) -> str:
        o = self.options
        return f"digits (MLP 64-{o.hidden}-{o.hidden}-10, {o.batch} images/rank/step, AdamW)"
