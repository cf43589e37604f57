"""Pipeline parallelism on gloo: cut a model into one stage per rank, run a 1F1B step.

commfuse launch --nproc 2 examples/pipeline.py
commfuse launch --hosts 4 --link 100mbit examples/pipeline.py
"""

import torch
import torch.distributed as dist
from torch import nn

from commfuse.comm import Communicator
from commfuse.pipeline import PipelineRuntime, cut, lower, one_f_one_b, replay


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()
    torch.manual_seed(0)  # the same model on every rank; each keeps its own stage
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    p, m = comm.world_size, 6

    schedule = one_f_one_b(num_stages=p, num_microbatches=m)  # plain data: print(schedule)
    stages = cut(model, [i * 8 // p for i in range(1, p)])
    runtime = PipelineRuntime(
        lower(schedule), {comm.rank: stages[comm.rank]}, comm, loss_fn=nn.functional.mse_loss
    )
    x, y = torch.randn(24, 16), torch.randn(24, 16)
    sizes = [5, 3, 4, 4, 6, 2]  # micro-batches need not be equal
    result = runtime.step(
        x.split(sizes) if comm.rank == 0 else None, y.split(sizes) if comm.rank == p - 1 else None
    )

    if comm.rank == p - 1:  # the unsplit model on the whole batch gives the same loss
        whole = nn.functional.mse_loss(model(x), y).item()
        assert result.loss is not None and abs(result.loss - whole) < 1e-5 * abs(whole)
    bubble = replay(schedule).bubble_fraction  # (p - 1) / (m + p - 1) with equal stages
    sent = comm.stats.total().bytes_sent
    print(f"rank {comm.rank} ok: {sent} bytes sent, the schedule's bubble {bubble:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
