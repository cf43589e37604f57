"""commfuse's PowerSGD hook under transformers' ``Trainer``, as a callback.

Run it on 2 local ranks (or under torchrun, unchanged):

    commfuse launch --nproc 2 examples/transformers_powersgd.py
    torchrun --nproc-per-node 2 examples/transformers_powersgd.py
"""

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from commfuse.compress import PowerSGD
from commfuse.integrations.transformers import CompressionCallback


class Classifier(torch.nn.Module):
    """A model that returns its loss, as the Trainer expects."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :4] > 0).long().argmax(dim=1)
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    model = Classifier()
    args = TrainingArguments(
        output_dir="out/transformers_powersgd",
        per_device_train_batch_size=32,
        max_steps=8,
        save_steps=4,  # checkpoint-4 and checkpoint-8 hold each rank's PowerSGD state too
        learning_rate=0.05,
        optim="sgd",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(CompressionCallback(trainer, PowerSGD(rank=4, warmup=2)))
    trainer.train()  # train(resume_from_checkpoint=True) resumes the hook's state as well

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {dist.get_rank()} checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
