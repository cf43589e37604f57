"""1-bit Adam, 0/1 Adam and their two-phase 1-bit allreduce on real gloo process groups.

References are independent of the code under test: a plain-loop replay of the 1-bit allreduce
for every rank on one process (``two_phase_reference``); torch's own single-tensor AdamW for
the warm-up, and Adam with its variance frozen written out here for the compressed phase.
Bytes are each rank's point-to-point traffic, counted by the communicator, against the
allreduce's formula.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from commfuse.comm import Communicator
from commfuse.optim import (
    CompressedAllReduce,
    OneBitAdam,
    OneBitAdamConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
    handed_bytes_per_rank,
    sync_steps,
    two_phase_reference,
    variance_steps,
    wire_bytes_per_rank,
)
from commfuse.optim.compressed_all_reduce import message_bytes
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
EXACT: dict[str, Any] = {"all_to_all_algo": "pairwise", "all_gather_algo": "ring"}


def buffer(rank: int, call: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(104729 * rank + call)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * (1 + rank) + 0.2).to(dtype)


# -- the 1-bit allreduce ----------------------------------------------------------------------
def onebit_bytes_and_reference(sizes: list[int]) -> list[str]:
    comm = Communicator()
    world, rank = comm.world_size, comm.rank
    failures = []
    for numel in sizes:
        reducer = CompressedAllReduce(all_to_all_algo="pairwise", all_gather_algo="ring")
        workers: list[torch.Tensor] | None = None
        servers: list[torch.Tensor] | None = None
        for call in range(3):
            comm.stats.reset()
            x = buffer(rank, call, numel)
            reducer.all_reduce_(comm, x, key="m")
            total = comm.stats.total()
            want_bytes = wire_bytes_per_rank(numel, world)
            if total.bytes_sent != want_bytes or total.bytes_recv != want_bytes:
                failures.append(
                    f"n={numel} call {call}: sent {total.bytes_sent}, received "
                    f"{total.bytes_recv}, formula {want_bytes}"
                )
            if total.messages_sent != 2 * (world - 1) * (numel > 0):
                failures.append(f"n={numel}: {total.messages_sent} messages, 2 (P - 1) expected")
            if total.handed_bytes != handed_bytes_per_rank(numel, world):
                failures.append(f"n={numel}: handed {total.handed_bytes}")
            if rank == 0 and numel <= 1001:  # the replay is plain Python: one rank, small sizes
                inputs = [buffer(r, call, numel) for r in range(world)]
                want, workers, servers = two_phase_reference(inputs, workers, servers)
                if not torch.allclose(x, want, rtol=1e-6, atol=1e-6):
                    failures.append(
                        f"n={numel} call {call}: off the replay by {(x - want).abs().max()}"
                    )
                if not torch.allclose(reducer.worker_error["m"], workers[0], atol=1e-5):
                    failures.append(f"n={numel} call {call}: worker residual off the replay")
                if not torch.allclose(reducer.server_error["m"], servers[0], atol=1e-5):
                    failures.append(f"n={numel} call {call}: server residual off the replay")
            # Every rank decodes the same gathered messages: the same bits everywhere.
            gathered = torch.empty(world * numel)
            comm.all_gather(gathered, x)
            if not all(torch.equal(row, x) for row in gathered.view(world, numel)):
                failures.append(f"n={numel} call {call}: ranks disagree on the average")
    return failures


@pytest.mark.parametrize("world", [2, 4, 8])
def test_onebit_all_reduce_sends_its_formula_and_matches_the_replay(
    pool: PoolFn, world: int
) -> None:
    """Exact bytes per rank, 2 (P - 1) messages of ``4 ceil((4 + ceil(c / 8)) / 4)`` bytes,
    sizes that do and do not divide by P (and one smaller than P), three calls so the
    residuals take part."""
    for failures in pool(world).run(onebit_bytes_and_reference, [3, 1001, 4096], timeout_s=120):
        assert failures == []


def test_onebit_bytes_per_rank_are_nearly_flat_in_the_world_size() -> None:
    numel = 1 << 20
    per_rank = {p: wire_bytes_per_rank(numel, p) for p in (2, 4, 8, 64)}
    assert per_rank[2] == 2 * message_bytes(numel // 2) == 2 * (4 + numel // 16)
    for p in (4, 8, 64):
        assert per_rank[p] < 2 * numel / 8 * 1.01  # at most 2 n / 8, whatever P
    assert per_rank[64] / per_rank[2] < 2.01
    assert 2 * 4 * numel * 7 / 8 / per_rank[8] > 31  # vs a ring allreduce of fp32 at P = 8


def error_feedback_sums(
    numel: int, calls: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    comm = Communicator()
    reducer = CompressedAllReduce()
    sent = torch.zeros(numel, dtype=torch.float64)
    true = torch.zeros(numel, dtype=torch.float64)
    for call in range(calls):
        x = buffer(comm.rank, call, numel, torch.float64)
        true += x
        reducer.all_reduce_(comm, x, key="m")
        sent += x
    return sent, true, reducer.worker_error["m"], reducer.server_error["m"]


def test_sent_plus_residuals_is_the_true_sum(pool: PoolFn) -> None:
    """``P sum_t out_t + sum_i e_worker_i + P e_server = sum_t sum_i x_i``, to float64
    rounding (3 ranks, 20 calls, a size that leaves padding)."""
    world, numel = 3, 1000
    results = pool(world).run(error_feedback_sums, numel, 20, timeout_s=60)
    sent = results[0][0]
    assert all(torch.equal(r[0], sent) for r in results)
    true = torch.stack([r[1] for r in results]).sum(0)
    workers = torch.stack([r[2] for r in results]).sum(0).reshape(-1)[:numel]
    servers = torch.cat([r[3].reshape(-1) for r in results])[:numel]
    balance = world * sent + workers + world * servers - true
    assert float(balance.abs().max()) < 1e-12 * float(true.abs().max())
    # Not trivially: the residuals hold a real part of the sum.
    assert float((world * sent - true).abs().max()) > 1e-3


# -- 1-bit Adam -------------------------------------------------------------------------------
def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=g)
    out: torch.Tensor = ((model(x) - x[:, :3].sin()) ** 2).mean()
    return out


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


HYPER: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}


def onebit_vs_frozen_adam(freeze: int, steps: int) -> list[float]:
    """Per step, the largest difference between 1-bit Adam with an fp32 exchange and the
    reference: torch's AdamW (single tensor) on the averaged gradients for the warm-up, then
    the variance frozen, momentum of the averaged gradients, written out here."""
    comm = Communicator()
    world = comm.world_size
    model = tiny_model()
    config = OneBitAdamConfig(freeze_step=freeze, exchange="none")
    opt = OneBitAdam(model.parameters(), comm, config, **HYPER)
    ref = tiny_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    beta1, beta2 = HYPER["betas"]
    lr, wd, eps = HYPER["lr"], HYPER["weight_decay"], HYPER["eps"]
    diffs = []
    for step in range(steps):
        loss_of(model, comm.rank, step).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        grads = []
        for r in range(world):
            ref.zero_grad()
            loss_of(ref, r, step).backward()  # type: ignore[no-untyped-call]
            grads.append([p.grad.clone() for p in ref.parameters() if p.grad is not None])
        average = [
            torch.stack([gs[i] for gs in grads]).sum(0) / world for i in range(len(grads[0]))
        ]
        if step < freeze:
            for p, g in zip(ref.parameters(), average, strict=True):
                p.grad = g
            ref_opt.step()
        else:
            t = step + 1
            with torch.no_grad():
                for p, g in zip(ref.parameters(), average, strict=True):
                    state = ref_opt.state[p]
                    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                    denom = state["exp_avg_sq"].sqrt() / (1 - beta2**freeze) ** 0.5 + eps
                    p.mul_(1 - lr * wd)
                    p.sub_(lr / (1 - beta1**t) * state["exp_avg"] / denom)
        diffs.append(float((flat_params(model) - flat_params(ref)).abs().max()))
    return diffs


def test_onebit_adam_uncompressed_is_adam_with_frozen_variance(pool: PoolFn) -> None:
    for diffs in pool(2).run(onebit_vs_frozen_adam, 4, 10, timeout_s=60):
        # Warm-up: torch's AdamW bit for bit (two ranks: the average of two is exact).
        assert diffs[:4] == [0.0] * 4
        # Then the same method up to the rounding of where the average is taken.
        assert max(diffs) < 1e-6


def train_compressed(
    kind: str,
    options: dict[str, Any],
    steps: int,
    *,
    resume_at: int = 0,
    zero_residuals: bool = False,
) -> tuple[torch.Tensor, int, list[int]]:
    """``steps`` steps of 1-bit or 0/1 Adam (resumed from a checkpoint taken after
    ``resume_at`` steps when it is not 0): the final parameters, the exchanges, and the bytes
    each step sent."""
    comm = Communicator()
    cls: Any = OneBitAdam if kind == "onebit" else ZeroOneAdam
    make: Any = OneBitAdamConfig if kind == "onebit" else ZeroOneAdamConfig
    config = make(**options, **EXACT)
    model = tiny_model()
    opt = cls(model.parameters(), comm, config, **HYPER)
    per_step = []
    for step in range(steps):
        if resume_at and step == resume_at:
            saved = io.BytesIO()
            torch.save((model.state_dict(), opt.state_dict()), saved)
            model = tiny_model()  # a fresh process's objects, then the checkpoint
            opt = cls(model.parameters(), comm, config, **HYPER)
            weights, state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
            if zero_residuals:
                for errors in state["compressed"]["onebit"].values():
                    for e in errors.values():
                        e.zero_()
            model.load_state_dict(weights)
            opt.load_state_dict(state)
        before = comm.stats.total().bytes_sent
        loss_of(model, comm.rank, step).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        per_step.append(comm.stats.total().bytes_sent - before)
    params = flat_params(model)
    gathered = torch.empty(comm.world_size * params.numel())
    comm.all_gather(gathered, params)
    assert all(torch.equal(row, params) for row in gathered.view(comm.world_size, -1)), (
        "replicas differ"
    )
    return params, opt.exchanges, per_step


ONEBIT: tuple[str, dict[str, Any]] = ("onebit", {"freeze_step": 3})
ZEROONE: tuple[str, dict[str, Any]] = (
    "zeroone",
    {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4},
)


@pytest.mark.parametrize(
    ("kind", "options", "resume_at"), [(*ONEBIT, 6), (*ZEROONE, 12), (*ZEROONE, 4)]
)
def test_resume_mid_way_is_bit_exact(
    pool: PoolFn, kind: str, options: dict[str, Any], resume_at: int
) -> None:
    """A checkpoint in the compressed phase (1-bit Adam), inside a local interval and inside
    the variance-freezing phase (0/1 Adam) resumes to the same bits; without the residuals in
    it the run would differ (the test can fail)."""
    steps = 16
    straight = pool(2).run(train_compressed, kind, options, steps, timeout_s=60)
    resumed = pool(2).run(train_compressed, kind, options, steps, resume_at=resume_at, timeout_s=60)
    broken = pool(2).run(
        train_compressed,
        kind,
        options,
        steps,
        resume_at=resume_at,
        zero_residuals=True,
        timeout_s=60,
    )
    for a, b, c in zip(straight, resumed, broken, strict=True):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
        assert not torch.equal(a[0], c[0])


def test_bytes_per_step_follow_the_phases(pool: PoolFn) -> None:
    """1-bit Adam: the warm-up's steps send a ring allreduce of the fp32 gradients
    (``algo=ring``), the compressed steps the 1-bit allreduce's formula. 0/1 Adam: nothing at all between
    synchronisations of the local phase, and the formula at each of ``sync_steps``."""
    numel = sum(p.numel() for p in tiny_model().parameters())
    one = wire_bytes_per_rank(numel, 2)
    onebit = pool(2).run(train_compressed, "onebit", {"freeze_step": 3, "algo": "ring"}, 8)
    for _, exchanges, per_step in onebit:
        # A ring allreduce at P = 2: each rank sends one half in each of its two phases.
        assert per_step == [4 * numel] * 3 + [one] * 5
        assert exchanges == 5
    steps = 28  # ends on a synchronisation: one model on every rank
    kind, options = ZEROONE
    config = ZeroOneAdamConfig(**options)
    syncs = set(sync_steps(config, steps))
    variance = set(variance_steps(config))
    runs = pool(2).run(train_compressed, kind, {**options, "algo": "ring"}, steps)
    for _, exchanges, per_step in runs:
        for t, sent in enumerate(per_step, start=1):
            if t in variance:
                assert sent == 4 * numel, (t, sent)  # a full-precision gradient average
            elif t <= config.var_freeze_step or t in syncs:
                assert sent == one, (t, sent)
            else:
                assert sent == 0, (t, sent)
        assert exchanges == config.var_freeze_step - len(variance) + len(syncs)


def test_zeroone_policies_double_their_intervals() -> None:
    config = ZeroOneAdamConfig(
        var_freeze_step=20, var_update_scaler=3, local_step_scaler=2, local_step_clipper=4
    )
    assert variance_steps(config) == [1, 2, 3, 5, 7, 9, 13, 17]
    assert sync_steps(config, 40) == [21, 22, 24, 26, 30, 34, 38]
