"""A tensor-parallel MLP (Megatron's column- then row-parallel linear) with fused operators.

Each rank holds half of each weight; the row-parallel layer's GEMM + AllReduce is fused (each
group of output rows is reduced while the next is computed). The result equals the dense MLP's.

    commfuse launch --nproc 2 examples/fused_linear.py
"""

import torch
import torch.distributed as dist

from commfuse.comm import Communicator
from commfuse.fused import ColumnParallelLinear, RowParallelLinear


def gathered(weight: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """The full weight from every rank's shard (for the dense reference only)."""
    parts = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(parts, weight.detach().contiguous())
    return torch.cat(parts, dim=dim)


def main() -> None:
    dist.init_process_group("gloo")
    comm = Communicator()
    up = ColumnParallelLinear(64, 256, comm, bias=False)  # W1 split on out_features
    down = RowParallelLinear(256, 64, comm, bias=False)  # W2 split on in_features: fused AllReduce

    torch.manual_seed(0)
    x = torch.randn(128, 64, requires_grad=True)  # the same input on every rank
    y = down(torch.relu(up(x)))  # every rank gets the full, replicated output
    y.square().mean().backward()  # backward is overlapped too

    w1 = gathered(up.weight, 0, comm.world_size)
    w2 = gathered(down.weight, 1, comm.world_size)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.relu(x_ref @ w1.T) @ w2.T
    y_ref.square().mean().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    print(f"rank {comm.rank} ok: output {tuple(y.shape)} equals the dense MLP's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
