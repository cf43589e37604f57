"""Local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo against exact references.

References are computed independently: plain inner training on one rank; torch's own DDP for
H = 1; and for DiLoCo a single-process replay of every replica with the outer Nesterov step
written out by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from commfuse.cli.spec import strategy_from_spec
from commfuse.comm import Communicator
from commfuse.compress import DeMo, Int4, SparseLoCo
from commfuse.localsgd import (
    PeriodicMethod,
    PeriodicSyncOptimizer,
    diloco,
    local_sgd,
    post_local_sgd,
    slowmo,
    streaming_diloco,
)
from commfuse.localsgd.fragments import fragments_due, split_into_fragments
from commfuse.testing import RankPool
from commfuse.train.strategy import describe_strategy

PoolFn = Callable[[int], RankPool]
Method = Callable[..., PeriodicMethod]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 2))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 4, generator=g)
    return x, x[:, :2] * 0.5 - x[:, 2:] ** 2


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    loss: torch.Tensor = ((model(x) - y) ** 2).mean()
    return loss


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(
    method: Method, options: dict[str, Any], steps: int, *, inner: str = "sgd"
) -> tuple[torch.Tensor, PeriodicSyncOptimizer]:
    comm = Communicator()
    model = tiny_model()
    opt_inner: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if inner == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01)
    )
    opt = PeriodicSyncOptimizer(opt_inner, model, comm, method(**copy.deepcopy(options)))
    for step in range(steps):
        loss_of(model, comm.rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
    opt.finish()
    return flat_params(model), opt


# -- one rank: every strategy is its inner optimizer ---------------------------------------
PLAIN = [
    (local_sgd, {"H": 3}),
    (post_local_sgd, {"H": 3, "warmup_steps": 2}),
    (slowmo, {"H": 3, "beta": 0}),
    (diloco, {"H": 3, "outer_lr": 1, "outer_momentum": 0}),
    (
        streaming_diloco,
        {
            "H": 4,
            "num_fragments": 2,
            "outer_lr": 1,
            "outer_momentum": 0,
            "overlap_steps": 0,
            "mix_global": 1,
        },
    ),
]


def one_rank_equals_inner(method: Method, options: dict[str, Any]) -> float:
    got, _ = train(method, options, 7, inner="adamw")
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(7):
        loss_of(model, 0, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        inner.step()
        inner.zero_grad()
    return float((got - flat_params(model)).abs().max())


@pytest.mark.parametrize(("method", "options"), PLAIN)
def test_one_rank_equals_inner_optimizer(
    pool: PoolFn, method: Method, options: dict[str, Any]
) -> None:
    (err,) = pool(1).run(one_rank_equals_inner, method, options)
    assert err < 1e-6


# -- H = 1 local SGD with plain SGD is synchronous data parallel ---------------------------
def h1_equals_ddp() -> tuple[float, int, int]:
    got, opt = train(local_sgd, {"H": 1, "algo": "native"}, 5)
    comm = opt.world_comm
    calls = comm.stats["all_reduce"].calls
    model = tiny_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):
        loss_of(ddp, comm.rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        sgd.step()
        sgd.zero_grad()
    ref = flat_params(model)
    # Averaging parameters instead of gradients reorders float32 rounding: compare at the
    # parameters' scale.
    return float((got - ref).abs().max() / ref.abs().max()), calls, got.numel()


@pytest.mark.parametrize("world", [2, 3])
def test_h1_local_sgd_equals_synchronous_data_parallel(pool: PoolFn, world: int) -> None:
    for rel, calls, _ in pool(world).run(h1_equals_ddp):
        assert rel < 1e-6
        assert calls == 5  # one exchange of the whole model per step, nothing else (the
        # replicas are in sync at the end: finish() sends nothing)


# -- DiLoCo against a hand-computed replay of every replica --------------------------------
def diloco_vs_replay(period: int, periods: int) -> tuple[float, int, int, list[float]]:
    steps = period * periods
    got, opt = train(
        diloco,
        {"H": period, "outer_lr": 0.7, "outer_momentum": 0.9, "algo": "native"},
        steps,
        inner="adamw",
    )
    world = opt.world_comm.world_size
    replicas = [tiny_model() for _ in range(world)]
    inners = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in replicas]
    anchor = flat_params(replicas[0]).clone()
    momentum = torch.zeros_like(anchor)
    for p_index in range(periods):
        for local in range(period):
            step = p_index * period + local
            for rank, (m, o) in enumerate(zip(replicas, inners, strict=True)):
                loss_of(m, rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
                o.step()
                o.zero_grad()
        deltas = [anchor - flat_params(m) for m in replicas]
        delta = sum(deltas[1:], deltas[0]) / world
        momentum = 0.9 * momentum + delta
        anchor = anchor - 0.7 * (delta + 0.9 * momentum)  # Nesterov
        for m in replicas:
            torch.nn.utils.vector_to_parameters(anchor.clone(), m.parameters())
    sent = opt.world_comm.stats["all_reduce"]
    return (
        float((got - anchor).abs().max()),
        sent.calls,
        sent.native_bytes,
        [s.drift for s in opt.syncs],
    )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_diloco_outer_step_matches_hand_computed_reference(pool: PoolFn, world: int) -> None:
    for err, calls, payload, drifts in pool(world).run(diloco_vs_replay, 3, 2):
        assert err < 1e-5
        numel = sum(p.numel() for p in tiny_model().parameters())
        assert (calls, payload) == (2, 2 * numel * 4)  # two exchanges of the model, fp32
        assert len(drifts) == 2 and all(d > 0 for d in drifts)  # replicas did drift apart


# -- streaming: fragments, staggering, overlap ---------------------------------------------
def test_fragments_cover_every_parameter_once_per_cycle() -> None:
    params = [torch.zeros(n) for n in (7, 1, 30, 2, 2, 9, 100, 3)]
    for num_fragments, period in [(1, 5), (2, 4), (4, 8), (3, 10), (8, 8)]:
        fragments = split_into_fragments(params, num_fragments)
        elements = [
            (piece.param, e)
            for f in fragments
            for piece in f
            for e in range(piece.start, piece.stop)
        ]
        assert sorted(elements) == [(i, e) for i, p in enumerate(params) for e in range(p.numel())]
        counts = [sum(piece.numel for piece in f) for f in fragments]
        assert max(counts) - min(counts) <= 1  # 1/F of the model each, to the element
        for cycle_start in (1, 1 + period, 1 + 5 * period):
            due = [
                f
                for t in range(cycle_start, cycle_start + period)
                for f in fragments_due(t, num_fragments, period)
            ]
            assert sorted(due) == list(range(num_fragments))  # each exactly once per H steps
    with pytest.raises(ValueError, match="cannot fill"):
        split_into_fragments([torch.zeros(1), torch.zeros(1)], 3)


def streaming_bytes() -> tuple[list[int], int, list[int]]:
    _, opt = train(
        streaming_diloco,
        # Without the final synchronisation: this test counts the periodic exchanges only.
        {"H": 4, "num_fragments": 2, "overlap_steps": 1, "algo": "native", "final_sync": False},
        8,
        inner="adamw",
    )
    sizes = [sum(piece.numel for piece in f) for f in opt.fragments]
    return sizes, opt.world_comm.stats["all_reduce"].native_bytes, [s.step for s in opt.syncs]


def test_streaming_sends_each_fragment_at_its_own_step(pool: PoolFn) -> None:
    for sizes, payload, steps in pool(2).run(streaming_bytes):
        # 8 steps, H=4, 2 fragments: fragment 1 at steps 2 and 6, fragment 0 at 4 and 8.
        assert steps == [2, 4, 6, 8]
        assert payload == 4 * 2 * sum(sizes)
        assert max(sizes) < sum(sizes)  # one sync moves only part of the model


# -- the final synchronisation: one model on every rank at the end ------------------------
def final_models(
    method: Method, options: dict[str, Any], steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    """Every rank's parameters after ``finish()`` without and with the final synchronisation,
    and the number of exchanges of each run."""
    comm = Communicator()

    def everyone(flat: torch.Tensor) -> list[torch.Tensor]:
        out = torch.empty(comm.world_size * flat.numel())
        comm.all_gather(out, flat)
        return list(out.view(comm.world_size, -1))

    drifted, opt_drifted = train(method, {**options, "final_sync": False}, steps, inner="adamw")
    synced, opt_synced = train(method, options, steps, inner="adamw")
    return everyone(drifted), everyone(synced), len(opt_drifted.syncs), len(opt_synced.syncs)


@pytest.mark.parametrize("world", [2, 3])
def test_final_sync_of_local_sgd_is_the_replicas_average(pool: PoolFn, world: int) -> None:
    # H=8 stopped after 5 steps: no periodic exchange yet, then one of the whole model. With
    # outer lr 1 and no momentum the outer step is the plain average.
    drifted, synced, n_drifted, n_synced = pool(world).run(
        final_models, local_sgd, {"H": 8, "algo": "native"}, 5
    )[0]
    assert (n_drifted, n_synced) == (0, 1)
    assert not torch.equal(drifted[0], drifted[1])  # the replicas did drift apart
    average = torch.stack(drifted).mean(0)
    for replica in synced:
        assert torch.equal(replica, synced[0])  # bitwise one model
        assert float((replica - average).abs().max()) < 1e-6


@pytest.mark.parametrize(
    ("method", "options", "steps", "extra"),
    [
        # Fragment 1 syncs at step 2 and 6 (applied at 7, mixed with the local values: out of
        # sync at the end), fragment 0 at 4 and 8 (in flight at the end: applied exactly, not
        # sent again): one more exchange.
        (streaming_diloco, {"H": 4, "num_fragments": 2, "overlap_steps": 1}, 8, 1),
        # Stopped exactly at a period's end: already one model, nothing more is sent.
        (diloco, {"H": 3}, 6, 0),
    ],
)
def test_final_sync_leaves_one_model(
    pool: PoolFn, method: Method, options: dict[str, Any], steps: int, extra: int
) -> None:
    drifted, synced, n_drifted, n_synced = pool(3).run(final_models, method, options, steps)[0]
    assert n_synced == n_drifted + extra
    assert all(torch.equal(replica, synced[0]) for replica in synced)
    if extra:
        assert not torch.equal(drifted[0], drifted[1])


# -- checkpoint in the middle of a period --------------------------------------------------
def resume_mid_period(method: Method, options: dict[str, Any]) -> float:
    comm = Communicator()
    straight, _ = train(method, options, 9, inner="adamw")

    model = tiny_model()
    opt = PeriodicSyncOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        comm,
        method(**copy.deepcopy(options)),  # a compressor's state is its own
    )
    for step in range(5):
        loss_of(model, comm.rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())

    model2 = tiny_model()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # garbage, overwritten by the checkpoint
    opt2 = PeriodicSyncOptimizer(
        torch.optim.AdamW(model2.parameters(), lr=0.01),
        model2,
        comm,
        method(**copy.deepcopy(options)),  # a compressor's state is its own
    )
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    for step in range(5, 9):
        loss_of(model2, comm.rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt2.step()
        opt2.zero_grad()
    opt2.finish()
    return float((straight - flat_params(model2)).abs().max())


@pytest.mark.parametrize(
    ("method", "options"),
    [
        (diloco, {"H": 3}),
        (slowmo, {"H": 4}),
        (streaming_diloco, {"H": 4, "num_fragments": 2, "overlap_steps": 2}),
        # The outer-gradient compressors: their residuals (momentum) are in the checkpoint.
        (diloco, {"H": 2, "compressor": SparseLoCo(chunk_numel=16, num_kept_per_chunk=3)}),
        (diloco, {"H": 2, "compressor": DeMo(chunk_numel=8, num_kept_per_chunk=2)}),
        (
            streaming_diloco,
            {"H": 2, "num_fragments": 2, "overlap_steps": 1, "compressor": Int4(chunk_numel=8)},
        ),
    ],
)
def test_resume_mid_period_equals_uninterrupted(
    pool: PoolFn, method: Method, options: dict[str, Any]
) -> None:
    assert pool(2).run(resume_mid_period, method, options) == [0.0, 0.0]


# -- hierarchical: every step inside a host, every H across ------------------------------
def test_hierarchical_periods(pool: PoolFn) -> None:
    results = pool(4).run(hierarchical_counts_2x2)
    for intra_calls, inter_calls, spread in results:
        assert (intra_calls, inter_calls) == (6, 2)
        assert spread == 0.0  # all four replicas equal after the last synchronisation


def hierarchical_counts_2x2() -> tuple[int, int, float]:
    comm = Communicator()
    model = tiny_model()
    cfg = local_sgd(H=3, hierarchical=True, ranks_per_host=2, algo="native")
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, cfg)
    for step in range(6):
        loss_of(model, comm.rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
    got = flat_params(model)
    everyone = [torch.zeros_like(got) for _ in range(comm.world_size)]
    torch.distributed.all_gather(everyone, got)
    spread = max(float((e - everyone[0]).abs().max()) for e in everyone)
    return opt.grad_comm.stats["all_reduce"].calls, opt.outer_comm.stats["all_reduce"].calls, spread


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="unknown key 'K'"):
        strategy_from_spec("diloco:K=3")
    with pytest.raises(ValueError, match="not a valid int"):
        strategy_from_spec("local-sgd:H=many")
    with pytest.raises(ValueError, match="unknown strategy 'fedavg'"):
        strategy_from_spec("fedavg")
    with pytest.raises(ValueError, match="num_fragments=9 > H=4"):
        streaming_diloco(H=4, num_fragments=9)


def test_diloco_gives_sparseloco_its_papers_outer_step_unless_told_otherwise() -> None:
    """SparseLoCo's decayed residual is its outer momentum: under ``diloco`` it gets its paper's
    plain average (lr 1, no momentum) for each outer setting left unset, with a warning naming
    what was applied; a setting given is kept, and other compressors keep DiLoCo's step."""
    with pytest.warns(UserWarning, match="applied outer_lr=1, outer_momentum=0"):
        paper = diloco(H=20, compressor=SparseLoCo())
    # The config keeps what it was given; the settings it runs are its ``periodic()``.
    run = paper.periodic()
    assert (run.outer_lr, run.outer_momentum) == (1.0, 0.0)
    with pytest.warns(UserWarning, match="applied outer_momentum=0 "):
        assert diloco(outer_lr=0.7, compressor=SparseLoCo()).periodic().outer_momentum == 0.0
    stacked = diloco(H=20, outer_lr=0.7, outer_momentum=0.9, compressor=SparseLoCo())
    run = stacked.periodic()
    assert (run.outer_lr, run.outer_momentum) == (0.7, 0.9)
    for config in (diloco(H=20), diloco(compressor=DeMo()), diloco(compressor=Int4())):
        run = config.periodic()
        assert (run.outer_lr, run.outer_momentum) == (0.7, 0.9)
    with pytest.warns(UserWarning, match="applied outer_lr=1, outer_momentum=0"):
        streamed = streaming_diloco(H=8, num_fragments=2, compressor=SparseLoCo())
    run = streamed.periodic()
    assert (run.outer_lr, run.outer_momentum) == (1.0, 0.0)
    # The command line builds the same configs, and describes each by what it was given.
    with pytest.warns(UserWarning):
        assert strategy_from_spec("diloco:H=20,compressor=sparseloco") == paper
    assert describe_strategy(paper) == "diloco:H=20,compressor=sparseloco"
    assert (
        describe_strategy(stacked)
        == "diloco:H=20,outer_lr=0.7,outer_momentum=0.9,compressor=sparseloco"
    )
    assert strategy_from_spec(describe_strategy(stacked)) == stacked


def inner_lr_scaled() -> dict[str, float]:
    """One rank of post-local SGD (2 synchronous steps) with inner_lr_scale=0.5 against AdamW
    whose lr is halved from step 2 on; the optimizer's own lr is left as it was."""
    got, opt = train(
        post_local_sgd, {"H": 3, "warmup_steps": 2, "inner_lr_scale": 0.5}, 7, inner="adamw"
    )
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(7):
        for group in inner.param_groups:
            group["lr"] = 0.01 if step < 2 else 0.005
        loss_of(model, 0, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        inner.step()
        inner.zero_grad()
    return {
        "err": float((got - flat_params(model)).abs().max()),
        "lr_after": float(opt.param_groups[0]["lr"]),
    }


def test_inner_lr_scale_applies_to_the_periodic_phase_only(pool: PoolFn) -> None:
    (r,) = pool(1).run(inner_lr_scaled)
    assert r["err"] < 1e-6
    assert r["lr_after"] == 0.01
    with pytest.raises(ValueError, match="inner_lr_scale must be > 0"):
        diloco(inner_lr_scale=0)
