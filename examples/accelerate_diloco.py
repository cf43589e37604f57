"""DiLoCo under Hugging Face Accelerate: the model stays out of ``prepare``.

Run it on 2 local ranks (or under torchrun or accelerate launch, unchanged):

    commfuse launch --nproc 2 examples/accelerate_diloco.py
    torchrun --nproc-per-node 2 examples/accelerate_diloco.py
"""

import torch
from accelerate import Accelerator

from commfuse.integrations.accelerate import periodic_optimizer
from commfuse.localsgd import diloco


def main() -> None:
    # Without cpu=True, Accelerate on a machine without a GPU runs each rank alone, silently.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    # Not accelerator.prepare(model): DDP would all-reduce the gradients at every step.
    model.to(accelerator.device)
    inner = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    # Every H=4 inner steps the replicas average their deltas and take DiLoCo's outer step;
    # each rank's replica and outer state are registered for save_state/load_state.
    optimizer = periodic_optimizer(accelerator, model, inner, diloco(H=4))

    data = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own batches
    for step in range(12):
        x = torch.randn(64, 32, generator=data).to(accelerator.device)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()  # an inner step; every 4th also the exchange and the outer step
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss.item():.4f}")
    accelerator.save_state("out/accelerate_diloco")  # with each rank's replica and outer state
    optimizer.finish()  # average what moved since the last exchange: one model on every rank

    accelerator.print(f"{len(optimizer.syncs)} exchanges in 12 steps")
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {accelerator.process_index} checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
