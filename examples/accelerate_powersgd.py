"""commfuse's PowerSGD hook under Hugging Face Accelerate: one call after ``prepare``.

Run it on 2 local ranks (or under torchrun or accelerate launch, unchanged):

    commfuse launch --nproc 2 examples/accelerate_powersgd.py
    torchrun --nproc-per-node 2 examples/accelerate_powersgd.py
"""

import torch
from accelerate import Accelerator

from commfuse.compress import PowerSGD
from commfuse.integrations.accelerate import compress_gradients


def main() -> None:
    # Without cpu=True, Accelerate on a machine without a GPU runs each rank alone, silently.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The hook on the DDP model, its state registered for save_state/load_state.
    state = compress_gradients(accelerator, model, PowerSGD(rank=4, warmup=2))

    data = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own batches
    for step in range(8):
        x = torch.randn(64, 32, generator=data).to(accelerator.device)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)  # buckets are compressed and averaged while backward goes on
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss.item():.4f}")
    accelerator.save_state("out/accelerate_powersgd")  # with each rank's PowerSGD state

    accelerator.print(f"hook exchanged {state.comm.stats.total().handed_bytes} bytes on rank 0")
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {accelerator.process_index} checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
