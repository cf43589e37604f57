"""DiLoCo across replicas that FSDP2 shards: 4 ranks are 2 replicas of 2 shards each.

commfuse launch --nproc 4 examples/fsdp2_diloco.py
commfuse launch --hosts 2 --ranks-per-host 2 --link 100mbit examples/fsdp2_diloco.py
(a host per replica: FSDP2 inside each host, DiLoCo's exchanges over the slow link)
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from commfuse.comm import Communicator
from commfuse.localsgd import PeriodicSyncOptimizer, diloco


def main() -> None:
    dist.init_process_group("gloo")
    replicas = 2
    shards = dist.get_world_size() // replicas
    # Rows are replicas, columns shards: ranks [[0, 1], [2, 3]]. FSDP2 shards each replica over
    # its row; DiLoCo averages each shard with the same shard of the other rows (a column).
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    comm = Communicator(mesh["replicate"].get_group(), name="replicate")

    torch.manual_seed(0)  # replicas start equal (DiLoCo's paper starts from a pre-trained model)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])  # not mesh: HSDP would average replicas every step
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    # Every H=5 inner steps each rank averages its shards' pseudo-gradient with its column,
    # then the outer Nesterov step moves its shards' anchor (its outer state is its shards').
    optimizer = PeriodicSyncOptimizer(inner, net, comm, diloco(H=5))

    data = torch.Generator().manual_seed(dist.get_rank())  # every rank its own batches
    for step in range(12):
        x = torch.randn(64, 32, generator=data)
        y = (x[:, :4] > 0).long().argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()  # FSDP2 averages the gradients over the row (the replica's ranks)
        optimizer.step()  # an inner step; every 5th also the outer step
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}")

    optimizer.finish()  # average what moved since the last exchange: one model on every rank
    # A checkpoint is each rank's own: torch.save(optimizer.state_dict(), f"outer-{rank}.pt").
    full = [p.full_tensor() for p in net.parameters()]
    checksum = sum(float(t.detach().double().sum()) for t in full)
    print(f"rank {dist.get_rank()} checksum {checksum:.10f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
