"""DataParallel with ``staleness=1`` (Pipe-SGD) on real ranks: each step applies the previous
step's averaged gradient, exactly (against a hand-written delayed reference), resumes bit for
bit with the gradient in flight checkpointed, and skips a NaN step without corrupting the
compressor's state. Also PowerSGD's fp16 warm-up: the average, and half the bytes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commfuse.cli.spec import compressor_from_spec, strategy_from_spec
from commfuse.comm import Communicator
from commfuse.compress import PowerSGD
from commfuse.ddp import DataParallel, DataParallelConfig
from commfuse.testing import RankPool
from commfuse.train import CommfuseDPConfig

PoolFn = Callable[[int], RankPool]
TINY_MB = 1e-6  # one parameter per bucket: native allreduce sums in the reference's order


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _data(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(40 + dist.get_rank())
    return [torch.randn(6, 5, generator=gen) for _ in range(steps)]


def stale_against_reference(steps: int) -> dict[str, Any]:
    """SGD with momentum through DataParallel(staleness=1) and through a reference that
    all-reduces every parameter's pre-divided gradient and steps with it one step later."""
    world = dist.get_world_size()
    data = _data(steps)
    ref = _net(1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pending: list[torch.Tensor] | None = None
    for x in data:
        ref(x).pow(2).mean().backward()
        grads = []
        for p in ref.parameters():
            assert p.grad is not None
            g = p.grad * (1.0 / world)
            dist.all_reduce(g)
            grads.append(g)
        if pending is not None:
            for p, g in zip(ref.parameters(), pending, strict=True):
                p.grad = g
            ref_opt.step()
        pending = grads
        ref_opt.zero_grad()

    net = _net(1)
    config = DataParallelConfig(staleness=1, algo="native", bucket_cap_mb=TINY_MB)
    dp = DataParallel(net, Communicator(), config=config)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    stepped, gradient_steps = [], []
    for x in data:
        dp(x).pow(2).mean().backward()
        stepped.append(dp.step(opt))
        opt.zero_grad()
        assert dp.last_stats is not None
        gradient_steps.append(dp.last_stats.gradient_step)
    dp.close()
    return {
        # Bitwise up to 2 ranks (a sum of two is commutative), else within 1e-6 relative:
        # at 3 ranks gloo's async bucket allreduces and the reference's sum in another order.
        "same": bool(torch.equal(_params(net), _params(ref)))
        if world <= 2
        else bool(torch.allclose(_params(net), _params(ref), rtol=1e-6, atol=1e-7)),
        "stepped": stepped,
        "gradient_steps": gradient_steps,
        "moved": bool(not torch.equal(_params(net), _params(_net(1)))),
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stale_update_is_the_previous_steps_average(pool: PoolFn, world: int) -> None:
    for r in pool(world).run(stale_against_reference, 5, timeout_s=60):
        assert r["same"] and r["moved"]
        assert r["stepped"] == [False, True, True, True, True]  # nothing has landed at step 0
        assert r["gradient_steps"] == [-1, 0, 1, 2, 3]


def stale_resume(spec: str, split: int | None) -> dict[str, Any]:
    """6 AdamW steps with a compressor and staleness=1; split: checkpoint after that many
    steps (a gradient is then in flight) and continue in fresh objects."""

    def build() -> tuple[nn.Module, DataParallel, torch.optim.Optimizer]:
        net = _net(5)
        comp = compressor_from_spec(spec, algo="native")
        config = DataParallelConfig(staleness=1, compressor=comp, bucket_cap_mb=0.002)
        dp = DataParallel(net, Communicator(), config=config)
        return net, dp, torch.optim.AdamW(dp.parameters(), lr=0.01)

    net, dp, opt = build()
    held_in_flight = False
    for step, x in enumerate(_data(6)):
        if step == split:
            state = dp.state_dict(), opt.state_dict()
            held_in_flight = "in_flight" in state[0]["_extra_state"]
            dp.close()
            net, dp, opt = build()
            dp.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        dp(x).pow(2).mean().backward()
        dp.step(opt)
        opt.zero_grad()
    dp.close()
    return {"params": _params(net), "held_in_flight": held_in_flight}


@pytest.mark.parametrize("spec", ["none", "powersgd:rank=2,warmup=2"])
def test_stale_resume_is_bit_identical(pool: PoolFn, spec: str) -> None:
    whole = pool(2).run(stale_resume, spec, None, timeout_s=60)
    split = pool(2).run(stale_resume, spec, 3, timeout_s=60)
    for a, b in zip(whole, split, strict=True):
        assert b["held_in_flight"]
        assert torch.equal(a["params"], b["params"])
    assert torch.equal(whole[0]["params"], whole[1]["params"])


def stale_nonfinite(spec: str | None) -> dict[str, Any]:
    """4 steps, rank 1's step-1 input NaN: the step that applies step 1's gradient (step 2)
    is skipped, names step 1 and the rank, and leaves the weights and the compressor finite."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    torch.manual_seed(0)
    comp = compressor_from_spec(spec, algo="native") if spec else None
    dp = DataParallel(net, config=DataParallelConfig(staleness=1, compressor=comp))
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    out: dict[str, Any] = {"stepped": [], "messages": []}
    for step in range(4):
        x = torch.randn(3, 4)
        if step == 1 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        before = _params(net).clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp(x).sum().backward()
        out["messages"] += [str(w.message) for w in caught]
        out["stepped"].append(dp.step(opt))
        opt.zero_grad()
        if step == 2:
            out["unchanged"] = bool(torch.equal(before, _params(net)))
    # The last step's reduction is still in flight on the engine's worker thread: land it, or
    # its collectives race the next job's on the same process group (a gloo size mismatch).
    dp.close()
    out["finite"] = bool(torch.isfinite(_params(net)).all())
    if comp is not None:
        out["state_finite"] = all(
            bool(torch.isfinite(t).all())
            for t in comp.state_dict()["feedback"]["residuals"].values()
        )
    return out


@pytest.mark.parametrize("spec", [None, "powersgd:rank=1,warmup=0"])
def test_stale_nonfinite_skips_the_step_that_would_apply_it(pool: PoolFn, spec: str | None) -> None:
    for r in pool(2).run(stale_nonfinite, spec, timeout_s=60):
        assert r["stepped"] == [False, True, False, True]
        assert r["unchanged"] and r["finite"]
        (message,) = r["messages"]
        assert "step 1" in message and "0.weight" in message
        if spec is not None:
            assert "rank(s) [1]" in message and r["state_finite"]


def test_staleness_config_errors() -> None:
    with pytest.raises(ValueError, match="staleness must be 0 or 1"):
        DataParallelConfig(staleness=2)  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(ValueError, match="find_unused_parameters"):
        DataParallelConfig(staleness=1, find_unused_parameters=True)
    config = strategy_from_spec("powersgd:rank=4,staleness=1,warmup=2")
    assert isinstance(config, CommfuseDPConfig)
    assert isinstance(config.compressor, PowerSGD)
    assert (config.staleness, config.compressor.rank, config.compressor.warmup) == (1, 4, 2)
    fp16 = strategy_from_spec("fp16")
    assert isinstance(fp16, CommfuseDPConfig) and fp16.staleness == 0
    with pytest.raises(ValueError, match="staleness='yes' is not a valid int"):
        strategy_from_spec("fp16:staleness=yes")


def fp16_warmup() -> dict[str, Any]:
    """PowerSGD's warm-up in fp16 on integer-valued gradients: the exact average, in half the
    bytes of the fp32 warm-up, as claimed; after the warm-up, factors as usual."""
    comm = Communicator()
    world = comm.world_size
    grad = torch.arange(64, dtype=torch.float32) * world + comm.rank * 2.0
    want = torch.arange(64, dtype=torch.float32) * world + (world - 1.0)
    comp = compressor_from_spec("powersgd:rank=1,warmup=1,warmup_fp16=1", algo="native")
    comm.stats.reset()
    out = grad.clone()
    comp.reduce_(comm, out, bucket=0, step=0)
    sent = comm.stats.total().native_bytes
    return {
        "exact": bool(torch.equal(out, want)),
        "sent": sent,
        "claimed": comp.payload_bytes(64, torch.float32, world, step=0),
        "after": comp.payload_bytes(64, torch.float32, world, step=1),
    }


def test_powersgd_fp16_warmup_sends_half(pool: PoolFn) -> None:
    for r in pool(2).run(fp16_warmup, timeout_s=60):
        assert r["exact"]
        assert r["sent"] == r["claimed"] == 64 * 2
        assert r["after"] < 64 * 2


@pytest.mark.e2e
def test_stale_engine_result_through_a_fresh_launch() -> None:
    """The same job through ``commfuse.cluster.run`` (fresh processes that ``os._exit`` right
    after sending their result): a tensor result used to travel as a shared-memory descriptor
    that the parent fetched from the rank after it had gone ("connection reset")."""
    from commfuse.cluster import run

    results = run(stale_resume, "powersgd:rank=2,warmup=2", 3, world_size=2, timeout_s=120)
    assert all(r["held_in_flight"] for r in results)
    assert torch.equal(results[0]["params"], results[1]["params"])
