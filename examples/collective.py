"""commfuse's collectives: torch's names, an algorithm per call, asynchronous handles.

commfuse launch --nproc 2 examples/collective.py
commfuse launch --hosts 4 --link 1gbit examples/collective.py
"""

import torch
import torch.distributed as dist

from commfuse import collectives as C
from commfuse.comm import Communicator


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()
    world = comm.world_size

    grad = torch.full((1 << 20,), float(comm.rank + 1))
    C.all_reduce(comm, grad, "avg")  # algo="auto": the tuner picks per size and topology
    assert torch.all(grad == (world + 1) / 2)

    params = torch.arange(1 << 18, dtype=torch.float32) if comm.rank == 0 else torch.empty(1 << 18)
    handle = C.broadcast(comm, params, root=0, algo="pipeline", async_op=True)
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # overlaps with the broadcast
    handle.wait()  # raises CommTimeoutError past the communicator's deadline
    assert torch.equal(params, torch.arange(1 << 18, dtype=torch.float32))

    shards = torch.full((4 * world,), float(comm.rank))
    mine = torch.empty(4)
    C.reduce_scatter(comm, mine, shards, "sum", algo="ring")
    assert torch.all(mine == sum(range(world)))

    # Every operation is counted: commfuse's own algorithms byte for byte, gloo's by payload.
    sent = comm.stats.total().bytes_sent
    print(f"rank {comm.rank} ok: {sent} bytes sent point to point, {busy.shape} GEMM overlapped")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
