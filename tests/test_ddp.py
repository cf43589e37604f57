"""DataParallel on real ranks: the same parameters as torch's DistributedDataParallel, the
collectives and bytes its bucket layout implies, overlap with backward, NaN handling, resume.

Each rank function trains torch DDP and commfuse's engine side by side on the same data and
seeds (the same collectives in the same order on every rank), then compares parameters: bitwise
where the reduction order is the same (one parameter per bucket with gloo's native allreduce,
whatever the world size; any layout at world sizes 1 and 2, where a sum of two is commutative),
else within 1e-6 relative.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Literal, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commfuse.cli.spec import compressor_from_spec
from commfuse.collectives import all_reduce
from commfuse.collectives.blocks import even_blocks
from commfuse.comm import CommConfig, Communicator
from commfuse.compress import Compressor
from commfuse.ddp import DataParallel, DataParallelConfig, NonFiniteGradientError
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
TINY_MB = 1e-6  # rounds to a 1-byte cap: one parameter per bucket


class Net(nn.Module):
    """Frozen layer, a branch used only on even ranks, and a layer no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(12, 12)
        self.dead = nn.Linear(12, 3)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.frozen(torch.relu(self.inp(x))))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        out: torch.Tensor = self.head(h)
        return out


def _batches(steps: int, micro: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [[torch.randn(4, 6, generator=gen) for _ in range(micro)] for _ in range(steps)]


def _train(
    model: nn.Module,
    wrapper: Any,
    batches: list[list[torch.Tensor]],
    unused: bool,
    set_to_none: bool = True,
) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    use_branch = not unused or dist.get_rank() % 2 == 0
    for micro in batches:
        for k, x in enumerate(micro):
            sync = k == len(micro) - 1
            ctx = wrapper.no_sync() if not sync else _null()
            with ctx:
                wrapper(x, use_branch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def against_torch_ddp(
    algo: str, cap_mb: float, micro: int, unused: bool, set_to_none: bool = True
) -> dict[str, Any]:
    torch.manual_seed(1 + dist.get_rank())  # different initial weights: the broadcast must fix them
    ours_net, theirs_net = Net(), Net()
    theirs_net.load_state_dict(ours_net.state_dict())
    config = DataParallelConfig(
        algo=algo, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb, find_unused_parameters=unused
    )
    ours = DataParallel(ours_net, Communicator(), config=config)
    # torch annotates list[int], but scales each cap with int(cap_mb * 2**20): fractional MiB work
    theirs = DDP(theirs_net, bucket_cap_mb_list=[cap_mb], find_unused_parameters=unused)  # type: ignore[list-item]
    batches = _batches(3, micro)
    _train(theirs_net, theirs, batches, unused, set_to_none)
    _train(ours_net, ours, batches, unused, set_to_none)
    ours.close()
    head = ours_net.head.weight
    index = next(i for i, q in enumerate(ours.reducer.params) if q is head)
    bucket, slot = ours.reducer.where[index]
    return {
        # The averaged bucket slot is the gradient (no copy back; with set_to_none=False
        # autograd accumulated the next steps straight into it).
        "grad_is_bucket": head.grad is not None
        and head.grad.data_ptr() == ours.reducer.buckets[bucket].view(slot).data_ptr(),
        "ours": _params(ours_net),
        "theirs": _params(theirs_net),
        "dead_grad_none": ours_net.dead.weight.grad is None,
        "frozen_unchanged": bool(torch.equal(ours_net.frozen.weight, theirs_net.frozen.weight)),
        "layout": ours.bucket_layout,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_equal_to_torch_ddp(pool: PoolFn, world: int) -> None:
    """One parameter per bucket: the same buffers as torch DDP, so the same sums, bit for bit;
    with gradient accumulation, a branch unused on odd ranks, a dead layer, a frozen layer."""
    results = pool(world).run(against_torch_ddp, "native", TINY_MB, 2, True, timeout_s=120)
    for r in results:
        assert torch.equal(r["ours"], r["theirs"])
        assert r["dead_grad_none"] and r["frozen_unchanged"]
        assert ["frozen.weight"] not in r["layout"]  # frozen parameters are not bucketed
        assert len(r["layout"]) == 8  # 4 trainable layers x (weight, bias)
    assert all(torch.equal(results[0]["ours"], r["ours"]) for r in results)


@pytest.mark.parametrize("world", [2, 3])
def test_bitwise_equal_to_torch_ddp_when_grads_are_kept(pool: PoolFn, world: int) -> None:
    """zero_grad(set_to_none=False): .grad is the bucket slot from the first step on, autograd
    accumulates into it (micro-batches under no_sync too), and the result stays torch's."""
    results = pool(world).run(against_torch_ddp, "native", TINY_MB, 2, True, False, timeout_s=120)
    for r in results:
        assert torch.equal(r["ours"], r["theirs"])
        assert r["grad_is_bucket"]


@pytest.mark.parametrize(
    ("world", "algo"), [(2, "native"), (3, "native"), (4, "ring"), (3, "ring")]
)
def test_close_to_torch_ddp_with_shared_buckets(pool: PoolFn, world: int, algo: str) -> None:
    """Several parameters per bucket (1 KB caps), and commfuse's own ring: the same to 1e-6."""
    results = pool(world).run(against_torch_ddp, algo, 0.001, 1, True, timeout_s=120)
    for r in results:
        assert any(len(bucket) > 1 for bucket in r["layout"])
        if world <= 2:
            assert torch.equal(r["ours"], r["theirs"])
        torch.testing.assert_close(r["ours"], r["theirs"], rtol=1e-6, atol=1e-7)


def _ring_bytes(numel: int, world: int, rank: int, itemsize: int) -> int:
    b = [stop - start for start, stop in even_blocks(numel, world)]
    sent = [b[(rank - s) % world] for s in range(world - 1)]
    sent += [b[(rank + 1 - s) % world] for s in range(world - 1)]
    return sum(sent) * itemsize


def traffic(algo: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    comm = Communicator()
    dp = DataParallel(
        net,
        comm,
        config=DataParallelConfig(algo=algo, bucket_cap_mb=0.004, first_bucket_cap_mb=0.0002),
    )
    before = comm.stats.snapshot()
    dp(torch.randn(8, 16)).sum().backward()
    after = comm.stats.snapshot()
    stats = dp.last_stats
    assert stats is not None
    sizes = [b.flat.numel() for b in dp.reducer.buckets]
    calls = {k: after[k]["calls"] - before.get(k, {}).get("calls", 0) for k in after}
    expected_ring = sum(_ring_bytes(n, comm.world_size, comm.rank, 4) for n in sizes)
    return {
        "stats": stats,
        "sizes": sizes,
        "calls": calls,
        "expected_ring": expected_ring,
        "n_params": 6,
    }


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_collectives_and_bytes_match_layout(pool: PoolFn, algo: str) -> None:
    results = pool(3).run(traffic, algo, timeout_s=60)
    for r in results:
        stats, sizes = r["stats"], r["sizes"]
        # first bucket: last layer's bias (16 B) + weight (512 B) pass 200 B; then 4 KB caps
        assert sizes == [4 + 128, 32 + 1024, 32 + 512]
        assert stats.num_buckets == 3 and stats.num_collectives == 3
        if algo == "native":
            assert r["calls"]["all_reduce"] == 3
            assert stats.native_bytes == 4 * sum(sizes) and stats.bytes_sent == 0
        else:
            assert "all_reduce" not in r["calls"]
            assert stats.bytes_sent == r["expected_ring"] and stats.native_bytes == 0
        # Overlap: the first bucket left while 4 of the 6 gradients were still to come.
        assert stats.launched_after_grads[0] == 2 < r["n_params"]
        assert list(stats.launched_after_grads) == sorted(stats.launched_after_grads)


@dataclasses.dataclass(kw_only=True)
class HalfCompressor(Compressor):
    """A tiny fp16 compressor with error feedback written as a user would, on the base class:
    the engine drives it through ``Compressor`` alone (agreement round first, state filed by
    the base's layout keys)."""

    name: ClassVar[str] = "half-test"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        key = self._state_key(bucket)
        residual = self.feedback.residuals.get(key)
        corrected = grad + (residual if residual is not None else torch.zeros_like(grad))
        half = corrected.half()
        if commit:
            self.feedback.update(key, corrected - half.float())
        all_reduce(comm, half, "sum", algo="native")
        grad.copy_(half.float() / comm.world_size)

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        return 2 * numel


def _state_finite(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return bool(torch.isfinite(state).all()) if state.is_floating_point() else True
    if isinstance(state, dict):
        return all(_state_finite(v) for v in state.values())
    if isinstance(state, list | tuple):
        return all(_state_finite(v) for v in state)
    return True


def nonfinite(mode: Literal["skip", "raise"], compressor: str | None) -> dict[str, Any]:
    """3 steps on 2 ranks, rank 1's step-1 input NaN. ``compressor``: None, "half-test" (a
    custom one: agreement round first) or a commfuse.compress spec (fp16 and PowerSGD skip the
    round: their output turns non-finite everywhere and is checked)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    comp: Any = None
    if compressor == "half-test":
        comp = HalfCompressor()
    elif compressor is not None:
        comp = compressor_from_spec(compressor)
    dp = DataParallel(
        net, config=DataParallelConfig(on_nonfinite=mode, compressor=comp, bucket_cap_mb=TINY_MB)
    )
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    out: dict[str, Any] = {"skipped": [], "messages": [], "error": None}
    for step in range(3):
        x = torch.randn(3, 4)
        if step == 1 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        before = _params(net).clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                dp(x).sum().backward()
            except NonFiniteGradientError as err:
                out["error"] = str(err)
                # A step() after the caught error skips, as on_nonfinite="skip" would.
                out["stepped_after_error"] = dp.step(opt)
                out["unchanged_after_error"] = bool(torch.equal(before, _params(net)))
                return out
        out["messages"] += [str(w.message) for w in caught]
        stepped = dp.step(opt)
        opt.zero_grad()
        out["skipped"].append(dp.last_step_skipped)
        assert stepped != dp.last_step_skipped
        if dp.last_step_skipped:
            out["unchanged"] = bool(torch.equal(before, _params(net)))
    if comp is not None:
        out["residual_finite"] = _state_finite(comp.state_dict())
        out["collectives_last_step"] = dp.last_stats is not None and dp.last_stats.num_collectives
    out["finite"] = bool(torch.isfinite(_params(net)).all())
    return out


@pytest.mark.parametrize(
    "compressor",
    [None, "half-test", "fp16:ef=1", "fp16", "powersgd:rank=1", "powersgd:rank=1,warmup=0",
     "acpsgd:rank=1,warmup=0"],
)  # fmt: skip
def test_nonfinite_skip(pool: PoolFn, compressor: str | None) -> None:
    for r in pool(2).run(nonfinite, "skip", compressor, timeout_s=60):
        assert r["skipped"] == [False, True, False]
        assert r["unchanged"] and r["finite"]
        (message,) = r["messages"]
        assert "step 1" in message and "0.weight" in message
        if compressor is not None:
            assert "rank(s) [1]" in message and r["residual_finite"]
        if compressor in ("fp16:ef=1", "fp16", "powersgd:rank=1"):
            assert r["collectives_last_step"] == 1  # one bucket, no agreement round when clean


def test_nonfinite_raise(pool: PoolFn) -> None:
    for r in pool(2).run(nonfinite, "raise", None, timeout_s=60):
        assert r["error"] is not None and "step 1" in r["error"] and "0.weight" in r["error"]
        assert r["stepped_after_error"] is False and r["unchanged_after_error"]


def resume(split: int | None) -> torch.Tensor:
    """6 steps with a compressor and cost-merged buckets; split: checkpoint after that many
    steps and continue in fresh objects."""

    def build() -> tuple[nn.Module, DataParallel, torch.optim.Optimizer]:
        torch.manual_seed(3)
        net = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        )
        config = DataParallelConfig(
            compressor=HalfCompressor(), merge_buckets_by_cost=True, bucket_cap_mb=TINY_MB
        )
        dp = DataParallel(net, config=config)
        return net, dp, torch.optim.AdamW(dp.parameters(), lr=0.01)

    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    data = [torch.randn(4, 5, generator=gen) for _ in range(6)]
    net, dp, opt = build()
    for step, x in enumerate(data):
        if step == split:
            state = {"dp": dp.state_dict(), "opt": opt.state_dict()}
            dp.close()
            net, dp, opt = build()
            dp.load_state_dict(state["dp"])
            opt.load_state_dict(state["opt"])
            assert dp.num_steps == split
        dp(x).pow(2).sum().backward()
        dp.step(opt)
        opt.zero_grad()
    dp.close()
    return _params(net)


def test_resume_is_bit_identical(pool: PoolFn) -> None:
    whole = pool(2).run(resume, None, timeout_s=60)
    split = pool(2).run(resume, 3, timeout_s=60)
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a, b)


def resume_keeps_the_tuners_picks(_: None) -> tuple[str, str]:
    """A run whose ``algo="auto"`` settled on ``ring`` for its bucket (as a timed trial may
    decide on a loaded machine), checkpointed and resumed in a fresh engine: what the resumed
    engine reduces that bucket with, and what a fresh engine's model picks."""
    from commfuse.collectives import tuner
    from commfuse.collectives.profile import TunerState, profile_of
    from commfuse.collectives.tuner import remember_choice

    def build() -> DataParallel:
        torch.manual_seed(0)
        return DataParallel(nn.Linear(64, 64), Communicator(), config=DataParallelConfig())

    dp = build()
    nbytes = dp.reducer.buckets[0].nbytes
    model = tuner.choose_for("all_reduce", nbytes, dp.comm.world_size, profile_of(dp.comm))
    picked = "ring" if model != "ring" else "doubling"
    remember_choice(dp.comm, "all_reduce", nbytes, picked)
    state = dp.engine_state_dict()
    dp.close()
    resumed = build()  # its own communicator: its tuner has picked the model's choice
    resumed.load_engine_state_dict(state)
    got = resumed.comm.owned(TunerState).choices[("all_reduce", nbytes)]
    resumed.close()
    return got, picked


def test_a_resume_reduces_with_the_algorithms_the_run_picked(pool: PoolFn) -> None:
    for got, picked in pool(2).run(resume_keeps_the_tuners_picks, None, timeout_s=60):
        assert got == picked


# -- a rank whose backward gives no gradient at all -----------------------------------------------


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def rank_without_gradient(via_step: bool) -> dict[str, Any]:
    """Rank 1 skips backward at step 1. With ``dp.step(opt)`` it joins the reduction there
    (exact: it contributes zero); with ``opt.step()`` it notices at the next forward (step 2,
    the last, forward only), joins, then raises. A short deadline makes a hang fail the test
    in seconds, not minutes."""
    comm = Communicator(config=CommConfig(deadline_s=15))
    net, ref = _small_net(), _small_net()
    dp = DataParallel(net, comm, config=DataParallelConfig(algo="native"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    out: dict[str, Any] = {"error": None, "warnings": []}
    for step in range(3):
        x = torch.randn(3, 4, generator=gen)
        idle = dist.get_rank() == 1 and step == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                y = dp(x)
            except RuntimeError as err:
                out["error"] = str(err)
                break
            if step == 2 and not via_step:
                break
            if not idle:
                y.pow(2).sum().backward()
            if via_step:
                dp.step(opt)
            else:
                opt.step()
        out["warnings"] += [str(w.message) for w in caught]
        opt.zero_grad()
        if not via_step:
            continue  # rank 1 joins only at the next forward: no other collective before
        # The reference: the same sums by hand (pre-divided, one flat native allreduce in the
        # engine's launch order, so every element is summed in the same order).
        ref_opt.zero_grad()
        ref(x).pow(2).sum().mul(0.0 if idle else 1.0).backward()
        order = list(reversed(list(ref.parameters())))
        # cast: the backward just above gave every parameter a gradient
        flat = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in order]) * (
            1 / comm.world_size
        )
        dist.all_reduce(flat)
        offset = 0
        for p in order:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        ref_opt.step()
    dp.close()
    out["ours"], out["ref"] = _params(net), _params(ref)
    return out


def test_rank_without_gradient_joins_at_step(pool: PoolFn) -> None:
    results = pool(3).run(rank_without_gradient, True, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["error"] is None
        assert torch.equal(r["ours"], r["ref"])  # rank 1 contributed exactly zero
        assert torch.equal(r["ours"], results[0]["ours"])
        expected = ["rank 1: no gradient reached"] if rank == 1 else []
        assert [w[: len("rank 1: no gradient reached")] for w in r["warnings"]] == expected


def test_rank_without_gradient_raises_at_next_forward(pool: PoolFn) -> None:
    results = pool(3).run(rank_without_gradient, False, timeout_s=60)
    assert results[0]["error"] is None and results[2]["error"] is None  # not left waiting
    assert not torch.equal(results[0]["ours"], results[1]["ours"])  # what the error is about
    error = results[1]["error"]
    assert error is not None and error.startswith("rank 1:") and "DataParallel.step" in error


# -- unused parameters marked ready when backward starts --------------------------------------------


def early_unused(direct_param_loss: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    config = DataParallelConfig(
        algo="native",
        bucket_cap_mb=TINY_MB,
        first_bucket_cap_mb=TINY_MB,
        find_unused_parameters=True,
    )
    dp = DataParallel(net, config=config)
    loss = dp(torch.randn(4, 6)).pow(2).mean()
    if direct_param_loss:
        loss = loss + net.dead.weight.pow(2).sum()  # reads a parameter the outputs cannot reach
    try:
        loss.backward()
    except RuntimeError as err:
        return {"error": str(err)}
    stats = dp.last_stats
    assert stats is not None
    dp.close()
    return {"error": None, "layout": dp.bucket_layout, "after": stats.launched_after_grads}


def test_unused_parameters_launch_when_backward_starts(pool: PoolFn) -> None:
    for r in pool(2).run(early_unused, False, timeout_s=60):
        # Launch order: head.bias, head.weight, dead.bias, dead.weight, branch.bias, ...
        assert r["layout"][:4] == [["head.bias"], ["head.weight"], ["dead.bias"], ["dead.weight"]]
        used = 6  # head, branch, inp: weight + bias each
        # dead's buckets leave right behind head's, not after all 6 gradients.
        assert r["after"][2] == r["after"][3] == r["after"][1] < used
        assert r["after"][-1] == used


def test_loss_reading_an_unreachable_parameter_is_named(pool: PoolFn) -> None:
    for r in pool(2).run(early_unused, True, timeout_s=60):
        assert r["error"] is not None and "'dead.weight'" in r["error"]
        assert "find_unused_parameters" in r["error"]


# -- the real compressors of commfuse.compress --------------------------------------------------


def with_compressor(spec: str, split: int | None) -> dict[str, Any]:
    """6 steps of a small regression; split: checkpoint after that many steps, continue in
    fresh objects. Returns losses, parameters, and per step the payload against the
    compressor's claim."""

    def build() -> tuple[nn.Module, DataParallel, torch.optim.Optimizer, Any]:
        torch.manual_seed(11)
        net = nn.Sequential(
            nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )
        comp = compressor_from_spec(spec, algo="native", gather_algo="native")
        config = DataParallelConfig(compressor=comp, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001)
        dp = DataParallel(net, Communicator(), config=config)
        return net, dp, torch.optim.SGD(dp.parameters(), lr=0.05), comp

    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    w_true = torch.linspace(-1, 1, 12)
    data = [torch.randn(16, 12, generator=gen) for _ in range(2)] * 3  # steps 4-5 = steps 0-1
    net, dp, opt, comp = build()
    out: dict[str, Any] = {"losses": [], "payload": [], "claimed": []}
    for step, x in enumerate(data):
        if step == split:
            state = dp.state_dict(), opt.state_dict()
            dp.close()
            net, dp, opt, comp = build()
            dp.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        loss = (dp(x).squeeze(1) - x @ w_true).pow(2).mean()
        loss.backward()
        dp.step(opt)
        opt.zero_grad()
        stats = dp.last_stats
        assert stats is not None and stats.bytes_sent == 0  # native collectives only
        world = dist.get_world_size()
        buckets = dp.reducer.buckets
        out["payload"].append(stats.native_bytes)
        out["claimed"].append(
            sum(
                comp.payload_bytes(b.flat.numel(), b.flat.dtype, world, step=step, bucket=b.index)
                for b in buckets
            )
            # The finiteness flags, one per tensor, unless the compressor needs no agreement.
            + (0 if comp.nonfinite_reaches_every_rank else sum(4 * len(b.params) for b in buckets))
        )
        out["losses"].append(float(loss))
    dp.close()
    out["params"] = _params(net)
    out["num_buckets"] = len(dp.reducer.buckets)
    return out


@pytest.mark.parametrize(
    "spec", ["fp16", "powersgd:rank=2,warmup=2", "acpsgd:rank=2,warmup=1", "topk:ratio=0.1"]
)
def test_real_compressors_train_count_and_resume(pool: PoolFn, spec: str) -> None:
    whole = pool(2).run(with_compressor, spec, None, timeout_s=90)
    split = pool(2).run(with_compressor, spec, 3, timeout_s=90)
    for a, b in zip(whole, split, strict=True):
        assert a["num_buckets"] >= 2
        assert a["payload"] == a["claimed"]  # bytes on the wire = the compressor's claim
        assert b["payload"] == b["claimed"]
        assert torch.equal(a["params"], b["params"])  # resume is bit-identical
        assert sum(a["losses"][4:]) < sum(a["losses"][:2])  # it trains (same two batches)
    assert torch.equal(whole[0]["params"], whole[1]["params"])
    if spec != "fp16":  # fp16 is 2x smaller; PowerSGD and top-k much more, after warm-up
        full = sum(4 * n for n in [12 * 32 + 32, 32 * 32 + 32, 32 + 1])
        assert whole[0]["claimed"][-1] < full / 2
