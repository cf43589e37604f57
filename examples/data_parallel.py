"""commfuse's DataParallel engine: buckets that leave during backward, compressed with PowerSGD.

commfuse launch --nproc 2 examples/data_parallel.py
commfuse launch --hosts 2 --link 1gbit examples/data_parallel.py   # on an emulated cluster
"""

import torch
import torch.distributed as dist

from commfuse import DataParallel, DataParallelConfig
from commfuse.comm import Communicator
from commfuse.compress import PowerSGD


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()  # the world; deadlines and byte counters on every operation
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    config = DataParallelConfig(bucket_cap_mb=25, compressor=PowerSGD(rank=4, warmup=2))
    model = DataParallel(net, comm, config=config)  # broadcasts rank 0's parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(comm.rank)
    for step in range(8):
        x = torch.randn(64, 32, generator=data)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # each bucket's exchange starts as its last gradient arrives
        model.step(optimizer)  # waits for the buckets; skips the step on NaN/Inf anywhere
        optimizer.zero_grad()
        if comm.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")

    # state_dict() also holds the compressor's error feedback and PowerSGD's factors.
    torch.save(model.state_dict(), f"/tmp/commfuse-example-rank{comm.rank}.pt")
    checksum = sum(float(p.detach().double().sum()) for p in net.parameters())
    print(f"rank {comm.rank} checksum {checksum:.10f}")
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
