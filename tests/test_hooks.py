"""commfuse compressors as torch DDP communication hooks, on real DDP models over gloo."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commfuse.compress import PowerSGD, make_compressor
from commfuse.hooks import CompressionState, compressed_allreduce_hook

#: Settings sized for a 577-parameter model in ~260-element buckets.
HOOK_SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "qsgd",
    "terngrad",
    "sign",
    "ef-sign",
    "topk:ratio=0.1",
    "randomk:ratio=0.25",
    "randblock:ratio=0.25",
    "dgc:ratio=0.1,warmup=5,momentum=0.5",
    "powersgd:rank=2,warmup=2",
    "powersgd:rank=2,warmup=2,warmup_rank=8,wire=bf16",
    "acpsgd:rank=4,warmup=2",
]


def regression_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own shard of one regression problem (a shared teacher, rank-seeded inputs)."""
    teacher = torch.randn(16, generator=torch.Generator().manual_seed(99))
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(rank))
    return x, torch.tanh(x @ teacher).unsqueeze(1) + 0.5 * x[:, :1]


def train(spec: str | None, steps: int) -> dict[str, Any]:
    """Train a small MLP with DDP (``spec`` None: torch's default allreduce, no hook)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    # A tiny bucket cap gives several buckets, so per-bucket state and ordering are exercised.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = None
    if spec is not None:
        comp = make_compressor(spec, algo="native", gather_algo="native")
        state = CompressionState(comp, module=model)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = regression_data(rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "steps": dict(state.steps) if state else {},
        "stats": state.comm.stats.snapshot() if state else {},
    }


def every_hook(specs: list[str], steps: int) -> dict[str | None, dict[str, Any]]:
    return {spec: train(spec, steps) for spec in [None, *specs]}


def test_every_hook_trains_and_none_equals_torch_default(pool: Any) -> None:
    results = pool(2).run(every_hook, HOOK_SPECS, 40, timeout_s=180)
    for per_rank in results:
        baseline = per_rank[None]
        for spec in HOOK_SPECS:
            run = per_rank[spec]
            first, last = run["losses"][0], sum(run["losses"][-5:]) / 5
            assert last < 0.6 * first, (spec, first, last)
            # One step per bucket per iteration, counted per bucket.
            assert set(run["steps"].values()) == {40}, (spec, run["steps"])
            traffic = run["stats"]["all_gather" if spec.split(":")[0] in
                                   ("int8", "qsgd", "terngrad", "sign", "ef-sign", "topk", "dgc")
                                   else "all_reduce"]  # fmt: skip
            assert traffic["calls"] >= 40 * len(run["steps"]), spec
        # Without compression, the hook's average is torch's: divide-then-sum and sum-then-
        # divide agree bitwise when the world size is a power of two.
        for mine, torch_default in zip(per_rank["none"]["params"], baseline["params"], strict=True):
            assert torch.equal(mine, torch_default)
    # Replicas agree: every rank holds the same parameters after each hook.
    for spec in HOOK_SPECS:
        for a, b in zip(results[0][spec]["params"], results[1][spec]["params"], strict=True):
            assert torch.equal(a, b), spec


def hook_error_reaches_backward() -> str:
    """A compressor that fails on the worker thread fails backward (not a hang)."""
    ddp = DistributedDataParallel(nn.Linear(4, 1))
    state = CompressionState(make_compressor("none", algo="no-such-algo"), module=ddp)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except Exception as err:
        return str(err)
    return "no error"


def test_hook_error_reaches_backward(pool: Any) -> None:
    for message in pool(2).run(hook_error_reaches_backward, timeout_s=60):
        assert "unknown all_reduce algorithm 'no-such-algo'" in message


def test_state_dict_of_the_hook_state_round_trips(pool: Any) -> None:
    results = pool(1).run(hook_state_round_trip)
    assert results == [True]


def hook_state_round_trip() -> bool:
    model = nn.Linear(8, 1, bias=False)
    state = CompressionState(make_compressor("topk:ratio=0.5"), module=model)
    grad = torch.arange(8, dtype=torch.float32)
    state.compressor.reduce_(state.comm, grad, bucket=0, step=state.next_step(0))
    saved = state.state_dict()
    other = CompressionState(make_compressor("topk:ratio=0.5"), module=model)
    other.load_state_dict(saved)
    residual = other.compressor.state_dict()["feedback"]["residuals"]["#0"]  # no layout given
    return other.steps == {0: 1} and torch.equal(residual, torch.tensor([0, 1, 2, 3, 0, 0, 0, 0.0]))


def powersgd_hook_bytes(steps: int) -> dict[str, Any]:
    """Per step: the bytes the hook allreduced, and the layout it handed the compressor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)  # 577 parameters: one bucket
    state = CompressionState(make_compressor("powersgd:rank=2,warmup=1", algo="native"), module=ddp)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    x, y = regression_data(torch.distributed.get_rank())
    per_step = []
    for _ in range(steps):
        before = state.comm.stats.snapshot().get("all_reduce", {"payload_bytes": 0, "calls": 0})
        nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        after = state.comm.stats.snapshot()["all_reduce"]
        per_step.append(
            (after["payload_bytes"] - before["payload_bytes"], after["calls"] - before["calls"])
        )
    compressor = state.compressor
    assert isinstance(compressor, PowerSGD)
    return {
        "per_step": per_step,
        "layouts": {b: [tuple(s) for s in lay.shapes] for b, lay in compressor.layouts.items()},
    }


def test_powersgd_hook_compresses_each_weight_matrix(pool: Any) -> None:
    """The hook hands PowerSGD the bucket's tensor shapes, so each weight is its own matrix:
    (32, 16) at rank 2 sends (32 + 16) x 2 factors; the (1, 32) weight (rank 1 would be 33 > 32
    elements) and both biases go uncompressed, packed with the P's: 2 allreduces per step."""
    for result in pool(2).run(powersgd_hook_bytes, 3, timeout_s=60):
        assert result["layouts"] == {0: [(1,), (1, 32), (32,), (32, 16)]}  # DDP: reverse order
        warmup = 577 * 4
        compressed = (1 + 32 + 32 + (32 + 16) * 2) * 4
        assert result["per_step"] == [(warmup, 1), (compressed, 2), (compressed, 2)]
