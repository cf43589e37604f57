"""commfuse's PowerSGD as the communication hook of a plain torch DDP script.

Run it on 2 local ranks (or under torchrun, unchanged):

    commfuse launch --nproc 2 examples/ddp_powersgd_hook.py
    torchrun --nproc-per-node 2 examples/ddp_powersgd_hook.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from commfuse.compress import PowerSGD
from commfuse.hooks import CompressionState, compressed_allreduce_hook


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    ddp = DDP(model)
    # Rank-4 factors after 2 uncompressed warm-up steps; error feedback keeps what rank 4 drops.
    state = CompressionState(PowerSGD(rank=4, warmup=2), module=model)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)

    data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
    for step in range(8):
        x = torch.randn(64, 32, generator=data)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()  # buckets are compressed and averaged while backward goes on
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}")

    # Every rank applied the same averaged gradients: the replicas are still identical.
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {dist.get_rank()} checksum {checksum:.10f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
