"""Gossip averaging (D-PSGD): each rank averages its model with one peer a round, no all-reduce.

commfuse launch --nproc 2 examples/gossip.py
commfuse launch --nproc 4 examples/gossip.py   # replicas then differ: neighbours only
"""

import torch
import torch.distributed as dist

from commfuse.comm import Communicator
from commfuse.decentral import GossipAveraging, ShiftOne


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()
    torch.manual_seed(0)  # replicas start equal
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    # Bagua's shift_one: a perfect matching that shifts every round; one model sent per round.
    gossip = GossipAveraging(net.parameters(), comm, ShiftOne(comm.world_size), every=1)

    data = torch.Generator().manual_seed(comm.rank)
    for step in range(12):
        x = torch.randn(64, 32, generator=data)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()  # a local step on this rank's own gradient
        optimizer.zero_grad()
        gossip.step()  # then average with this round's peer
        if comm.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")

    sent = comm.stats["gossip"].bytes_sent
    print(f"rank {comm.rank} sent {sent} bytes in {gossip.rounds} rounds")
    checksum = sum(float(p.detach().double().sum()) for p in net.parameters())
    print(f"rank {comm.rank} checksum {checksum:.10f}")  # 2 ranks: each round averages both
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
