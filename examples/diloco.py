"""DiLoCo: each rank takes H AdamW steps on its own, then the replicas average what moved.

commfuse launch --nproc 2 examples/diloco.py
commfuse launch --hosts 2 --link 100mbit examples/diloco.py
"""

import torch
import torch.distributed as dist

from commfuse.comm import Communicator
from commfuse.compress import FP16
from commfuse.localsgd import PeriodicSyncOptimizer, diloco


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()
    torch.manual_seed(0)  # replicas start equal (DiLoCo's paper starts from a pre-trained model)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    # Every H=5 inner steps: average the pseudo-gradient (anchor - params) in fp16, then an
    # outer Nesterov step (lr 0.7, momentum 0.9) moves the anchor.
    config = diloco(H=5, outer_lr=0.7, outer_momentum=0.9, compressor=FP16())
    optimizer = PeriodicSyncOptimizer(inner, net, comm, config)
    # A torch scheduler sets the inner rate (the outer step keeps its own, as in the paper).
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=12)

    data = torch.Generator().manual_seed(comm.rank)
    for step in range(12):
        x = torch.randn(64, 32, generator=data)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()  # an inner step; every 5th also the outer step
        optimizer.zero_grad()
        schedule.step()
        if comm.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")

    optimizer.finish()  # average what moved since the last exchange: one model on every rank
    checksum = sum(float(p.detach().double().sum()) for p in net.parameters())
    print(f"rank {comm.rank} checksum {checksum:.10f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
