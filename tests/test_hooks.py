"""commfuse compressors as torch DDP communication hooks, on real DDP models over gloo."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commfuse.cli.spec import compressor_from_spec
from commfuse.compress import BucketLayout, Compressor, NoCompression, PowerSGD
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
        comp = compressor_from_spec(spec, algo="native", gather_algo="native")
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
        "buckets": len(state.compressor.layouts) if state else 0,
        "stats": state.comm.stats.snapshot() if state else {},
    }


def every_hook(specs: list[str], steps: int) -> dict[str | None, dict[str, Any]]:
    return {spec: train(spec, steps) for spec in [None, *specs]}


@pytest.mark.e2e
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
            assert traffic["calls"] >= 40 * run["buckets"], spec
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
    state = CompressionState(compressor_from_spec("none", algo="no-such-algo"), module=ddp)
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
    state = CompressionState(compressor_from_spec("topk:ratio=0.5"), module=model)
    grad = torch.arange(8, dtype=torch.float32)
    layout = BucketLayout.of([("weight", (1, 8))])
    state.compressor.reduce_(state.comm, grad, bucket=0, step=state.next_step(layout))
    saved = state.state_dict()
    other = CompressionState(compressor_from_spec("topk:ratio=0.5"), module=model)
    other.load_state_dict(saved)
    residual = other.compressor.state_dict()["feedback"]["residuals"]["#0"]  # no layout given
    return other.steps == {"weight": 1} and torch.equal(
        residual, torch.tensor([0, 1, 2, 3, 0, 0, 0, 0.0])
    )


def powersgd_hook_bytes(steps: int) -> dict[str, Any]:
    """Per step: the bytes the hook allreduced, and the layout it handed the compressor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)  # 577 parameters: one bucket
    state = CompressionState(
        compressor_from_spec("powersgd:rank=2,warmup=1", algo="native"), module=ddp
    )
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    x, y = regression_data(torch.distributed.get_rank())
    per_step = []
    for _ in range(steps):
        before = state.comm.stats.snapshot().get("all_reduce", {"native_bytes": 0, "calls": 0})
        nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        after = state.comm.stats.snapshot()["all_reduce"]
        per_step.append(
            (after["native_bytes"] - before["native_bytes"], after["calls"] - before["calls"])
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


def conv_net() -> nn.Module:
    """A small conv net (46k parameters): with ``bucket_cap_mb=0.05`` DDP gives it 3 buckets."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
        nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 10 * 10, 10),
    )  # fmt: skip


def many_buckets(powersgd: bool, steps: int) -> dict[str, Any]:
    """Train the conv net under torch DDP in small buckets with commfuse's hook (uncompressed, or
    rank-2 PowerSGD after 2 warm-up steps); per step, the
    averaged gradients DDP left in ``.grad`` beside the float64 mean of every rank's own
    gradients (all-gathered from a copy of the model without DDP), and the hook's bytes."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model, plain = conv_net(), conv_net()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    compressor: Compressor = (
        PowerSGD(rank=2, warmup=2, algo="native") if powersgd else NoCompression(algo="native")
    )
    state = CompressionState(compressor, module=model)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"max_error": [], "bytes": [], "calls": [], "grads": []}
    for _ in range(steps):
        x, y = torch.randn(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()  # type: ignore[no-untyped-call]
        before = state.comm.stats.snapshot().get("all_reduce", {"native_bytes": 0, "calls": 0})
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        after = state.comm.stats.snapshot()["all_reduce"]
        out["bytes"].append(after["native_bytes"] - before["native_bytes"])
        out["calls"].append(after["calls"] - before["calls"])
        errors = []
        for mine, own in zip(model.parameters(), plain.parameters(), strict=True):
            assert mine.grad is not None and own.grad is not None
            gathered = [torch.empty_like(own.grad) for _ in range(world)]
            torch.distributed.all_gather(gathered, own.grad)
            mean = torch.stack(gathered).double().mean(0)
            errors.append(float((mine.grad.double() - mean).abs().max() / mean.abs().max()))
        out["max_error"].append(max(errors))
        out["grads"].append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
        opt.step()
    out["buckets"] = len(state.compressor.layouts)
    out["layouts"] = {}
    if isinstance(compressor, PowerSGD):
        out["layouts"] = {
            b: [tuple(s) for s in lay.shapes] for b, lay in compressor.layouts.items()
        }
    return out


def powersgd_bucket_bytes(shapes: list[tuple[int, ...]], rank: int) -> int:
    """Bytes one rank allreduces for one compressed step of a bucket (fp32): every matrix whose
    rank-r factors are smaller than it sends P (rows x r) and Q (cols x r), the rest is plain."""
    numel = 0
    for shape in shapes:
        size = math.prod(shape)
        rows, cols = shape[0], size // max(shape[0], 1)
        r = min(rank, rows, cols)
        numel += (rows + cols) * r if len(shape) >= 2 and (rows + cols) * r < size else size
    return 4 * numel


def test_hook_runs_with_many_buckets_under_torch_ddp(pool: Any) -> None:
    """Three ranks, torch DDP in three buckets (where torch's own powerSGD_hook fails on gloo:
    docs/torch-hooks-on-gloo.md). Uncompressed, commfuse's hook gives the plain average of
    the ranks' gradients and allreduces every gradient once; PowerSGD runs past its first
    compressed steps, keeps the replicas equal, and sends each bucket's factors, to the byte."""
    grad_bytes = 4 * sum(p.numel() for p in conv_net().parameters())
    for result in pool(3).run(many_buckets, False, 3, timeout_s=120):
        assert result["buckets"] == 3
        assert max(result["max_error"]) < 1e-6, result["max_error"]
        # Step 0 runs in DDP's initial single bucket; then in the 3 it rebuilt in gradient order.
        assert result["bytes"] == [grad_bytes] * 3 and result["calls"] == [1, 3, 3]
    ranks = pool(3).run(many_buckets, True, 5, timeout_s=120)
    for result in ranks:
        # The two warm-up steps are the plain average; then PowerSGD's factors per bucket.
        assert max(result["max_error"][:2]) < 1e-6, result["max_error"]
        compressed = sum(powersgd_bucket_bytes(s, 2) for s in result["layouts"].values())
        assert len(result["layouts"]) == 3 and compressed < grad_bytes / 4
        # The hook counts steps per parameter: the buckets DDP built at its rebuild (step 1)
        # are as far as their parameters, so the warm-up ends at step 2 in every bucket.
        assert result["bytes"][:2] == [grad_bytes] * 2 and result["bytes"][2:] == [compressed] * 3
    for step in range(5):
        assert torch.equal(ranks[0]["grads"][step], ranks[1]["grads"][step])
        assert torch.equal(ranks[0]["grads"][step], ranks[2]["grads"][step])


def resume_in_other_buckets(steps: int) -> dict[str, Any]:
    """Train the conv net under torch DDP in one bucket past PowerSGD's warm-up, then resume
    from the hook's state_dict in DDP with small buckets (3: other indices, other parameters
    per bucket): the hook's bytes at the last resumed step, and what those buckets send
    compressed."""
    rank = torch.distributed.get_rank()

    def run(bucket_cap_mb: float, saved: dict[str, Any] | None, num_steps: int) -> Any:
        model = conv_net()
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        spec = "powersgd:rank=2,warmup=2"
        state = CompressionState(compressor_from_spec(spec, algo="native"), module=ddp)
        if saved is not None:
            state.load_state_dict(saved)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(num_steps):
            x = torch.randn(8, 1, 16, 16, generator=gen)
            y = torch.randint(0, 10, (8,), generator=gen)
            state.comm.stats.reset()
            nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        return state

    trained = run(25.0, None, steps)  # one bucket
    # The first resumed step runs DDP's initial buckets, the second its rebuilt ones.
    resumed = run(0.05, trained.state_dict(), 2)
    fresh_past_warmup = run(0.05, None, 4)  # the same buckets, past the warm-up
    return {
        "resumed": resumed.comm.stats.total().native_bytes,
        "compressed": fresh_past_warmup.comm.stats.total().native_bytes,
        "steps": sorted(set(resumed.steps.values())),
        "buckets": len(resumed.compressor.layouts),
    }


def test_step_counts_follow_the_parameters_into_other_buckets(pool: Any) -> None:
    """A step count kept by bucket index would restart the warm-up of every bucket whose index
    is new after the resume (uncompressed fp32), sending more than the compressed step."""
    for result in pool(2).run(resume_in_other_buckets, 3, timeout_s=120):
        assert result["buckets"] > 1, result
        assert result["steps"] == [5], result
        assert result["resumed"] == result["compressed"], result


def test_the_state_waits_for_the_process_group() -> None:
    """A trainer's strategy is configured before its process group starts: building the state
    then is fine, and using it without a group names the fix."""
    assert not torch.distributed.is_initialized()
    state = CompressionState(PowerSGD(rank=2), module=nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"before torch\.distributed\.init_process_group"):
        state.comm  # noqa: B018  # the property binds


def bind_at_first_bucket(steps: int) -> dict[str, Any]:
    """Build the hook's state as if no process group were up yet, then train under DDP: the
    state binds in the first bucket's hook call, and the hook averages from that step on."""
    from unittest import mock

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
        state = CompressionState(NoCompression(algo="native"), module=model)
    unbound = state._comm is None
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = regression_data(torch.distributed.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {
        "unbound": unbound,
        "bytes": state.comm.stats.snapshot()["all_reduce"]["native_bytes"],
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def test_a_state_built_before_the_group_binds_at_the_first_bucket(pool: Any) -> None:
    results = pool(2).run(bind_at_first_bucket, 3, timeout_s=120)
    for result in results:
        assert result["unbound"]
        assert result["bytes"] >= 3 * 577 * 4  # every step's buckets went through the hook
    assert torch.equal(results[0]["params"], results[1]["params"])
