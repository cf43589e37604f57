"""SelSync, ADPSGD, PALSGD, DreamDDP and local SGD with clipping on real ranks.

Each is checked against a known method in its degenerate setting (SelSync at threshold 0 is
local SGD with H = 1, PALSGD at p = 0 is DiLoCo, bit for bit; DreamDDP at H = 1 and clipping at
I = 1 against a single-process replay of every replica), for decisions that are the same on
every rank (a divergence would leave ranks in different collectives: the pool's deadline fails
the test), for the bytes each rank sends against the method's formula, and for a resume in the
middle of a period that continues bit for bit.
"""

from __future__ import annotations

import copy
import itertools
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from commfuse.bench.exchange_trace import forward_skew_s, iteration_timeline, message_wire_s
from commfuse.cli.spec import strategy_from_spec, workload_from_spec
from commfuse.comm import Communicator
from commfuse.localsgd import (
    ADPSGDConfig,
    DreamDDPConfig,
    DreamDDPOptimizer,
    LocalSGDClipConfig,
    PALSGDConfig,
    PeriodicMethod,
    PeriodicSyncOptimizer,
    SelSyncConfig,
    SelSyncOptimizer,
    SyncMethod,
    diloco,
    local_sgd,
)
from commfuse.localsgd.adpsgd import next_period
from commfuse.localsgd.layer_parts import cut_layers
from commfuse.localsgd.layer_schedule import brute_force_plan, exposed_s, plan_key, plan_layers
from commfuse.localsgd.selsync import SIGNAL_SCALE
from commfuse.localsgd.sync_method import OuterStep
from commfuse.testing import RankPool
from commfuse.train import TrainConfig, train_rank
from commfuse.train import checkpoint as ckpt
from commfuse.train.metrics import summarize
from commfuse.train.strategy import describe_strategy

PoolFn = Callable[[int], RankPool]
#: Deadline of every multi-rank call here: a rank stuck in a collective its peers never enter
#: fails the test within it.
DEADLINE_S = 60.0


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 2))


NUMEL = sum(p.numel() for p in tiny_model().parameters())


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 4, generator=g)
    y = x[:, :2] * 0.5 - x[:, 2:] ** 2
    loss: torch.Tensor = ((model(x) - y) ** 2).mean()
    return loss


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def inner_for(model: nn.Module, inner: str) -> torch.optim.Optimizer:
    if inner == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def build(
    config: PeriodicMethod | SyncMethod, model: nn.Module, comm: Communicator, inner: str
) -> PeriodicSyncOptimizer:
    opt = inner_for(model, inner)
    if isinstance(config, SyncMethod):
        return config.make_optimizer(opt, model, comm)
    return PeriodicSyncOptimizer(opt, model, comm, config)


def run_steps(
    opt: PeriodicSyncOptimizer, model: nn.Module, rank: int, steps: range, *, lr_decay: bool = False
) -> None:
    for step in steps:
        if lr_decay:
            for group in opt.param_groups:
                group["lr"] = 0.2 / (1 + step)
        loss_of(model, rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()


def train(
    config: PeriodicMethod | SyncMethod, steps: int, *, inner: str = "sgd", finish: bool = True
) -> tuple[torch.Tensor, PeriodicSyncOptimizer, int]:
    """This rank's final parameters, its optimizer and the bytes it sent."""
    comm = Communicator()
    model = tiny_model()
    opt = build(config, model, comm, inner)
    before = comm.stats.total().handed_bytes  # the constructor's broadcast from rank 0
    run_steps(opt, model, comm.rank, range(steps))
    if finish:
        opt.finish()
    return flat(model), opt, comm.stats.total().handed_bytes - before


def everyone(comm: Communicator, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank)."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = torch.zeros(comm.world_size * len(values), dtype=torch.int64)
    comm.all_gather(out, mine)
    return [row.tolist() for row in out.view(comm.world_size, -1)]


# -- SelSync ----------------------------------------------------------------------------------
def selsync_vs_local_sgd() -> tuple[bool, int, int, int]:
    sel, opt, sel_bytes = train(SelSyncConfig(threshold=0, algo="native", final_sync=False), 5)
    ref, _, ref_bytes = train(local_sgd(H=1, algo="native", final_sync=False), 5)
    return torch.equal(sel, ref), sel_bytes, ref_bytes, len(opt.syncs)


def test_selsync_threshold_zero_is_local_sgd_every_step(pool: PoolFn) -> None:
    for equal, sel_bytes, ref_bytes, syncs in pool(2).run(
        selsync_vs_local_sgd, timeout_s=DEADLINE_S
    ):
        assert equal  # bit for bit
        assert syncs == 5
        assert ref_bytes == 5 * 4 * NUMEL
        assert sel_bytes == ref_bytes + 5 * 8  # one int64 flag per step on top


def selsync_decisions(threshold: float) -> tuple[list[list[int]], list[list[int]], int, int, int]:
    comm = Communicator()
    config = SelSyncConfig(threshold=threshold, smoothing_steps=2, algo="native")
    _, opt, sent = train(config, 12)
    assert isinstance(opt, SelSyncOptimizer)
    steps = [s.step for s in opt.syncs]
    # The agreed signal in its fixed point (exact), to compare between ranks.
    levels = [round(x * SIGNAL_SCALE) for x in opt.signals]
    # A fixed length for the gather: pad with -1.
    padded = steps + [-1] * (13 - len(steps))
    return everyone(comm, padded), everyone(comm, levels), len(steps), sent, opt.control_bytes


def test_selsync_decides_alike_on_every_rank_and_sends_what_it_decides(pool: PoolFn) -> None:
    # Each rank sees its own batches, so its changes differ; the max of them is everyone's.
    threshold = 0.4
    for gathered, levels, syncs, sent, control in pool(3).run(
        selsync_decisions, threshold, timeout_s=DEADLINE_S
    ):
        assert all(row == gathered[0] for row in gathered)
        assert all(row == levels[0] for row in levels)  # one signal, bit for bit
        assert 2 < syncs < 12  # some steps stayed local (the final sync counts as one)
        # The steps that synchronised are step 1 (before the window of 2 has a history), those
        # whose signal reached the threshold, then the final average after step 12 (unless
        # step 12 synchronised itself).
        fired = [t + 1 for t, level in enumerate(levels[0]) if level / SIGNAL_SCALE >= threshold]
        assert gathered[0][:syncs] == sorted({1, *fired, 12})
        assert control == 12 * 8
        assert sent == syncs * 4 * NUMEL + control


#: Per rank, the factor c_t of step t's loss ``c_t * sum(p)`` in ``selsync_signal``: the gradient
#: is c_t everywhere, its norm 2 c_t (4 elements), a sequence the test sets.
GRADIENT_SCALES = [
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0],
    [2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0],
]


def paper_signal(norms: list[float], window: int, decay: float) -> list[float]:
    """Tyagi and Swany's signal, written out: per step, the weighted mean (the k-th newest
    weighs (1 - decay)^k) of the last ``window`` relative changes of the weighted mean of the
    last ``window`` norms."""

    def mean(xs: list[float]) -> float:
        ws = [(1 - decay) ** (len(xs) - i) for i in range(len(xs))]
        return sum(w * x for w, x in zip(ws, xs, strict=True)) / sum(ws) if xs else 0.0

    smoothed = [mean(norms[max(0, t - window + 1) : t + 1]) for t in range(len(norms))]
    changes = [abs(b - a) / a for a, b in itertools.pairwise(smoothed)]
    return [mean(changes[max(0, t - window) : t]) for t in range(len(norms))]


def selsync_signal(threshold: float) -> tuple[list[float], list[int], int, int]:
    """SelSync (window 4, the paper's decay) over 12 steps of gradients of known norms: the
    agreed signals, the steps that synchronised, the bytes sent and the decisions' bytes."""
    comm = Communicator()
    model = nn.Module()
    model.p = nn.Parameter(torch.zeros(4))
    opt = SelSyncConfig(threshold=threshold, smoothing_steps=4, algo="native").make_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, comm
    )
    assert isinstance(opt, SelSyncOptimizer)
    before = comm.stats.total().handed_bytes
    for scale in GRADIENT_SCALES[comm.rank]:
        (scale * model.p.sum()).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
        opt.zero_grad()
    opt.finish()
    sent = comm.stats.total().handed_bytes - before
    return list(opt.signals), [s.step for s in opt.syncs], sent, opt.control_bytes


def test_selsync_signal_is_the_papers_smoothed_change_of_the_smoothed_norm(
    pool: PoolFn,
) -> None:
    # Per rank the paper's signal from the norms; the agreed one is the larger, in fixed point.
    per_rank = [paper_signal([2.0 * c for c in cs], 4, 0.01) for cs in GRADIENT_SCALES]
    expected = [max(pair) for pair in zip(*per_rank, strict=True)]
    threshold = 0.15
    for signals, steps, sent, control in pool(2).run(
        selsync_signal, threshold, timeout_s=DEADLINE_S
    ):
        assert signals == pytest.approx(expected, abs=1 / SIGNAL_SCALE)
        # Steps 1 to 3 before the window of 4 has a history, then the signal's, then the final
        # average after step 12.
        fired = [t + 1 for t, x in enumerate(expected) if x >= threshold + 1 / SIGNAL_SCALE]
        assert fired == [7, 8, 9, 10, 11, 12]  # rank 1's jump, then rank 0's; none before
        assert steps == sorted({1, 2, 3, *fired, 12})
        assert control == 12 * 8
        assert sent == len(steps) * 4 * 4 + control


def selsync_window_decisions() -> tuple[list[list[int]], list[list[int]], int, int]:
    """SelSync on windows of 4 steps over a run of 10 (the last window, steps 9 and 10, closed
    by the final average): every rank's sync steps and signal levels, its bytes and its
    decisions' bytes."""
    comm = Communicator()
    config = SelSyncConfig(
        threshold=0.02, smoothing_steps=1, window_steps=4, algo="native"
    ).for_run(10)
    assert config.total_steps == 10
    _, opt, sent = train(config, 10)
    assert isinstance(opt, SelSyncOptimizer)
    steps = [s.step for s in opt.syncs]
    levels = [round(x * SIGNAL_SCALE) for x in opt.signals]
    return (
        everyone(comm, steps + [-1] * (4 - len(steps))),
        everyone(comm, levels),
        sent,
        (opt.control_bytes),
    )


def test_selsync_windows_spend_one_sync_each_where_the_signal_fires_first(pool: PoolFn) -> None:
    for gathered, levels, sent, control in pool(3).run(
        selsync_window_decisions, timeout_s=DEADLINE_S
    ):
        assert all(row == gathered[0] for row in gathered)
        assert all(row == levels[0] for row in levels)
        fired = [t + 1 for t, level in enumerate(levels[0]) if level / SIGNAL_SCALE >= 0.02]
        # Windows (0, 4] and (4, 8]: the first firing step, else the window's last; the last
        # window (8, 10] is the final average's, whatever fires in it.
        expected = [next((t for t in fired if lo < t <= lo + 4), lo + 4) for lo in (0, 4)] + [10]
        assert gathered[0] == [*expected, -1]
        assert expected[:2] != [4, 8]  # the signal chose the steps, not the clock
        assert control == 10 * 8
        assert sent == 3 * 4 * NUMEL + control  # DiLoCo's bytes at period 4: one per window


# -- the outer step of SelSync and ADPSGD ------------------------------------------------------
def outer_step_vs_fixed_period() -> list[tuple[str, bool, int, int, int]]:
    """SelSync at threshold 0 (a sync every step) and ADPSGD over its two probe periods of 3
    (syncs after steps 3 and 6), with each outer step, against local SGD (the plain average)
    and DiLoCo (the Nesterov step) on the same schedule: per case, whether the models are
    equal bit for bit, the method's bytes less its decisions', the reference's bytes, and
    the syncs."""
    out = []
    references: list[tuple[OuterStep, Callable[..., PeriodicMethod]]] = [
        ("average", local_sgd),
        ("nesterov", diloco),
    ]
    for outer, reference in references:
        cases = [
            (SelSyncConfig(threshold=0, outer=outer, algo="native", final_sync=False), 5, 1),
            # Every step fires but min_period_steps spaces the syncs; nothing fires but
            # max_period_steps forces them: both the clock of period 3.
            (
                SelSyncConfig(
                    threshold=0, min_period_steps=3, outer=outer, algo="native", final_sync=False
                ),
                6,
                3,
            ),
            (
                SelSyncConfig(
                    threshold=1e9,
                    min_period_steps=3,
                    max_period_steps=3,
                    outer=outer,
                    algo="native",
                    final_sync=False,
                ),
                6,
                3,
            ),
            # A window of 3 steps whose signal never fires (and no first window to
            # synchronise): its last step; the run's last window ends with the run, at step 6.
            (
                SelSyncConfig(
                    threshold=1e9,
                    smoothing_steps=1,
                    window_steps=3,
                    total_steps=6,
                    outer=outer,
                    algo="native",
                    final_sync=False,
                ),
                6,
                3,
            ),
            (
                ADPSGDConfig(
                    total_steps=12,
                    num_syncs=3,
                    first_period_steps=3,
                    outer=outer,
                    algo="native",
                    final_sync=False,
                ),
                6,
                3,
            ),
        ]
        for config, steps, period in cases:
            got, opt, sent = train(config, steps)
            ref, _, ref_sent = train(reference(H=period, algo="native", final_sync=False), steps)
            name = f"{config.name}:outer={outer}"
            out.append(
                (name, torch.equal(got, ref), sent - opt.control_bytes, ref_sent, len(opt.syncs))
            )
    return out


def test_outer_step_on_a_fixed_schedule_is_local_sgd_or_diloco(pool: PoolFn) -> None:
    for cases in pool(2).run(outer_step_vs_fixed_period, timeout_s=DEADLINE_S):
        names = ["selsync", "selsync", "selsync", "selsync", "adpsgd"]
        assert [name for name, *_ in cases] == [
            f"{name}:outer={outer}" for outer in ("average", "nesterov") for name in names
        ]
        for name, equal, sent, ref_sent, syncs in cases:
            assert equal, name  # bit for bit: the default is the plain average
            assert sent == ref_sent == syncs * 4 * NUMEL, name  # the same exchanges
        assert [syncs for *_, syncs in cases] == [5, 2, 2, 2, 2] * 2


def test_selsync_period_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_period_steps must be >= 1"):
        SelSyncConfig(min_period_steps=0)
    with pytest.raises(ValueError, match=r"max_period_steps \(2\) must be 0 \(none\) or >="):
        SelSyncConfig(min_period_steps=3, max_period_steps=2)
    with pytest.raises(ValueError, match=r"window_steps \(4\) already bounds the gap"):
        SelSyncConfig(window_steps=4, max_period_steps=6)
    with pytest.raises(ValueError, match="window_steps and total_steps must be >= 0"):
        SelSyncConfig(window_steps=-1)


def test_outer_step_settings_are_diloco_s_and_a_bad_one_is_named() -> None:
    assert SelSyncConfig().periodic() == SelSyncConfig(outer="average").periodic()
    nesterov = ADPSGDConfig(total_steps=10, outer="nesterov").periodic()
    assert (nesterov.outer_lr, nesterov.outer_momentum, nesterov.nesterov) == (0.7, 0.9, True)
    with pytest.raises(ValueError, match="outer must be 'average' or 'nesterov'"):
        SelSyncConfig(outer="adam")  # type: ignore[arg-type]  # the check under test


# -- ADPSGD -----------------------------------------------------------------------------------
def test_adpsgd_period_rule() -> None:
    # No decay: the syncs left are spread evenly over the steps left.
    assert next_period(t_k=20, rate_k=1.0, t_1=10, rate_1=1.0, syncs_left=4, total_steps=100) == 20
    # The drift rate fell 4x from step 10 to 20 (a = 2): short periods now, long ones later.
    early = next_period(t_k=20, rate_k=0.25, t_1=10, rate_1=1.0, syncs_left=4, total_steps=100)
    assert early < 20
    # A power-law fall (a = 1): the planned periods lengthen and stay within the run.
    t, rate_1, left, periods = 20, 1.0, 4, []
    while left and t < 100:
        p = next_period(t_k=t, rate_k=(10 / t) ** 1.0, t_1=10, rate_1=rate_1, syncs_left=left,
                        total_steps=100)  # fmt: skip
        periods.append(p)
        t, left = t + p, left - 1
    assert periods == sorted(periods) and periods[0] < periods[-1]  # often early, rarely late
    assert len(periods) == 4 and 80 <= t <= 100


def adpsgd_run(final_sync: bool) -> tuple[list[list[int]], int, int, int]:
    """Every rank's planned sync steps, their count, this rank's bytes (with the final average,
    if any) and its agreements' bytes."""
    comm = Communicator()
    config = ADPSGDConfig(total_steps=24, num_syncs=4, algo="native", final_sync=final_sync)
    model = tiny_model()
    opt = build(config, model, comm, "sgd")
    assert hasattr(opt, "sync_steps")
    before = comm.stats.total().handed_bytes
    # Without the final average a falling learning rate; with it a constant one, whose drift
    # slows little (the case where a plan onto the run's end would waste a sync).
    run_steps(opt, model, comm.rank, range(24), lr_decay=not final_sync)
    opt.finish()
    sent = comm.stats.total().handed_bytes - before
    steps = list(opt.sync_steps)
    return everyone(comm, steps + [-1] * (4 - len(steps))), len(steps), sent, opt.control_bytes


def test_adpsgd_agrees_on_every_period_and_keeps_the_budget(pool: PoolFn) -> None:
    for gathered, syncs, sent, control in pool(3).run(adpsgd_run, False, timeout_s=DEADLINE_S):
        assert all(row == gathered[0] for row in gathered)
        assert gathered[0][:2] == [3, 6]  # two probe periods of T / (2K) = 3 steps
        assert syncs <= 4
        # One agreement (int64) after each sync but the last of the budget.
        assert control == 8 * (syncs - 1 if syncs == 4 else syncs)
        assert sent == syncs * 4 * NUMEL + control


def test_adpsgd_plans_its_budget_before_the_final_average(pool: PoolFn) -> None:
    # The final average closes the last period: the K planned syncs end before the run does,
    # the last planned period no longer than the one the final average closes (a planned sync
    # beside the final average would spend a model on a step or two of drift).
    for gathered, syncs, sent, control in pool(3).run(adpsgd_run, True, timeout_s=DEADLINE_S):
        steps = gathered[0]
        assert all(row == steps for row in gathered)
        assert syncs == 4 and steps[:2] == [3, 6]
        assert steps[-1] < 24 and 24 - steps[-1] >= steps[-1] - steps[-2] - 1
        assert control == 8 * 3  # an agreement after each planned sync but the last
        assert sent == 5 * 4 * NUMEL + control  # K planned syncs and the final average


# -- PALSGD -----------------------------------------------------------------------------------
def palsgd_vs_diloco() -> tuple[bool, int, int, list[list[int]], list[int], int, int]:
    comm = Communicator()
    zero, _, zero_bytes = train(PALSGDConfig(H=3, p=0.0, algo="native"), 7, inner="adamw")
    ref, _, ref_bytes = train(diloco(H=3, algo="native"), 7, inner="adamw")
    pulling = PALSGDConfig(H=3, p=0.4, seed=5, algo="native")
    pulled, opt, pulled_bytes = train(pulling, 7, inner="adamw")
    assert hasattr(opt, "pulls")
    pulls = list(opt.pulls)
    coins = random.Random(5)
    expected = [step for step in range(1, 8) if coins.random() < 0.4]
    return (
        torch.equal(zero, ref),
        zero_bytes,
        ref_bytes,
        everyone(comm, pulls + [-1] * (7 - len(pulls))),
        expected,
        pulled_bytes,
        int(not torch.equal(pulled, ref)),
    )


def test_palsgd_p_zero_is_diloco_and_its_coins_are_shared(pool: PoolFn) -> None:
    for equal, zero_bytes, ref_bytes, pulls, expected, pulled_bytes, moved in pool(2).run(
        palsgd_vs_diloco, timeout_s=DEADLINE_S
    ):
        assert equal  # bit for bit
        assert zero_bytes == ref_bytes == pulled_bytes  # pulls send nothing
        assert 0 < len(expected) < 7
        assert all(row[: len(expected)] == expected for row in pulls)  # the shared coins
        assert moved  # the pulls changed the result


# -- local SGD with clipping ----------------------------------------------------------------
def clip_vs_replay() -> tuple[float, float, int]:
    comm = Communicator()
    got, _, sent = train(LocalSGDClipConfig(H=1, max_norm=0.05, algo="native"), 4)
    replicas = [tiny_model() for _ in range(comm.world_size)]
    largest = 0.0
    for step in range(4):
        for rank, model in enumerate(replicas):
            loss_of(model, rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            largest = max(largest, float(nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(0.1 * p.grad)
                    p.grad = None
        mean = torch.stack([flat(m) for m in replicas]).mean(0)
        for model in replicas:
            nn.utils.vector_to_parameters(mean.clone(), model.parameters())
    return float((got - flat(replicas[0])).abs().max()), largest, sent


def test_clipping_with_period_one_is_the_average_of_clipped_steps(pool: PoolFn) -> None:
    for err, largest, sent in pool(2).run(clip_vs_replay, timeout_s=DEADLINE_S):
        assert largest > 0.05  # the clipping did act
        assert err < 1e-6
        assert sent == 4 * 4 * NUMEL  # the model every step, nothing else


# -- DreamDDP -----------------------------------------------------------------------------------
def test_layer_plan_matches_brute_force() -> None:
    rng = random.Random(0)
    for case in range(80):
        layers, period = rng.randint(1, 6), rng.randint(1, 3)
        backward = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0]) for _ in range(layers)]
        comm = [rng.choice([0.0, 0.5, 1.0, 2.5, 4.0]) for _ in range(layers)]
        # Half the cases wait at each layer's next use, a slack after the last launch; a
        # quarter launch every layer at once, as the forward starts.
        slack = [rng.choice([0.0, 0.5, 1.5, 3.0]) for _ in range(layers)] if case % 2 else None
        if case % 4 == 3:
            backward = [0.0] * layers
        # A third of the cases send an iteration's layers as one message (DreamDDP's default),
        # a fifth balance a load other than the times (slices by their bytes).
        fused = case % 3 == 0
        load = [rng.choice([1.0, 2.0, 5.0]) for _ in range(layers)] if case % 5 == 0 else None
        _, best = brute_force_plan(backward, comm, period, slack, load, fused=fused)
        plan = plan_layers(backward, comm, period, slack, load=load, fused=fused)
        assert len(plan) == layers and all(0 <= h < period for h in plan)
        assert plan_key(plan, backward, comm, period, slack, load, fused=fused) == best
    # The first layer's long exchange apart from the second's: only the last layer's shows.
    plan = plan_layers([1.0, 1.0, 1.0], [2.0, 1.0, 0.5], 3)
    key = plan_key(plan, [1.0] * 3, [2.0, 1.0, 0.5], 3)
    assert plan[0] != plan[1] and key == (0.5, 2.0, 0.5, 0.5)
    assert plan_layers([1.0, 2.0], [5.0, 5.0], 1) == [0, 0]
    # Exchanges the backward pass hides wherever they go: one per iteration, not stacked in the
    # first (every plan exposes nothing, the heaviest iteration's load decides), exactly and
    # when the search stops at its first node.
    for nodes in (200_000, 1):
        plan = plan_layers([1.0] * 6, [0.5] * 5 + [0.0], 5, max_nodes=nodes)
        assert sorted(plan[:5]) == [0, 1, 2, 3, 4], plan
    with pytest.raises(ValueError, match="one time per layer"):
        plan_layers([1.0], [1.0, 2.0], 2)
    with pytest.raises(ValueError, match="one time per layer"):
        plan_layers([1.0], [1.0], 2, [0.0, 1.0])


def test_layer_plan_leaves_no_iteration_empty_that_a_layer_could_fill() -> None:
    # charlm's 28 layers at 100 Mbit/s (2 ms per message, then the bytes), launched together as
    # the forward starts, each with more slack than any exchange: every plan hides them all,
    # and the heaviest iteration can be no lighter than the largest layer alone.
    numels = [25088, 16384, *[512, 197376, 65792, 512, 263168, 262400] * 4, 512, 25186]
    comm = [0.002 + n * 4 * 1.5 / 12.5e6 for n in numels]
    zeros, slack = [0.0] * len(comm), [0.6 + 0.01 * i for i in range(len(comm))]
    plan = plan_layers(zeros, comm, 16, slack)
    assert plan_key(plan, zeros, comm, 16, slack)[:2] == (0.0, max(comm))
    fused = plan_layers(zeros, comm, 16, slack, fused=True)
    assert plan_key(fused, zeros, comm, 16, slack, fused=True)[:2] == (0.0, max(comm))
    assert sorted(set(fused)) == list(range(16))
    assert sorted(set(plan)) == list(range(16))  # every iteration lands something
    # Small cases: an iteration stays empty only where moving any layer into it worsens the key.
    rng = random.Random(1)
    for _ in range(60):
        layers, period = rng.randint(2, 6), rng.randint(2, 4)
        backward = [rng.choice([0.0, 1.0]) for _ in range(layers)]
        comm = [rng.choice([0.5, 1.0, 2.5, 4.0]) for _ in range(layers)]
        slack = [rng.choice([0.0, 1.5, 3.0, 9.0]) for _ in range(layers)]
        plan = plan_layers(backward, comm, period, slack)
        key = plan_key(plan, backward, comm, period, slack)
        assert key == brute_force_plan(backward, comm, period, slack)[1]
        crowded = [layer for layer in range(layers) if plan.count(plan[layer]) > 1]
        for empty in set(range(period)) - set(plan):
            for layer in crowded:
                moved = [empty if i == layer else h for i, h in enumerate(plan)]
                assert plan_key(moved, backward, comm, period, slack) > key


def test_layer_plan_counts_the_slack_to_each_layers_use() -> None:
    # The last layer of the backward pass, exchanged in 3: all of it past the backward pass,
    # 1 of it past the 2 of compute before its next use, and nothing before a use 3 later.
    assert exposed_s([1], [1.0, 1.0], [0.0, 3.0]) == 3.0
    assert exposed_s([1], [1.0, 1.0], [0.0, 3.0], [5.0, 2.0]) == 1.0
    # Layer 1's exchange queues behind layer 0's (starts at 3, not 2): 0.5 late for its use.
    assert exposed_s([0, 1], [1.0, 1.0], [2.0, 2.0], [3.0, 2.5]) == 0.5
    assert exposed_s([1], [1.0, 1.0], [2.0, 2.0], [3.0, 2.5]) == 0.0
    assert exposed_s([0, 1], [1.0, 1.0], [2.0, 2.0], [0.5, 3.0]) == 0.5  # layer 0's own
    # Two long exchanges of layers needed early: one per iteration hides both behind the
    # slack; without it both iterations show one.
    plan = plan_layers([1.0, 1.0], [2.0, 2.0], 2, [2.0, 2.0])
    assert sorted(plan) == [0, 1] and plan_key(plan, [1.0] * 2, [2.0] * 2, 2, [2.0] * 2)[0] == 0
    # A forward of 0.5, a backward of 2 (1 per layer), an optimizer step of 0.1; the first
    # layer (used at 0 in the forward) exchanged in 2, the second (used at 0.5) in 0.5.
    # Launched from the backward pass (the first layer last), the first layer's exchange
    # has the optimizer step to hide behind: 1.9 shows. Launched as the forward starts, in the
    # forward's order, both have the whole iteration: nothing shows.
    assert exposed_s([0, 1], [1.0, 1.0], [0.5, 2.0], [0.1 + 0.5, 0.1]) == pytest.approx(1.9)
    assert exposed_s([0, 1], [0.0, 0.0], [2.0, 0.5], [2.5 + 0.1, 2.5 + 0.6]) == 0.0


def test_layer_plan_lands_one_messages_layers_together() -> None:
    # Launched together as the forward starts: layer 0, used first (slack 2), exchanged in 1;
    # layers 1 and 2, used later (slack 5), in 1.5 each; two iterations.
    zeros, comm, slack = [0.0] * 3, [1.0, 1.5, 1.5], [2.0, 5.0, 5.0]
    # One message per layer: layer 0 lands at 1 whatever follows it, and with layer 1 (or 2)
    # it makes the lightest heaviest iteration (2.5, against 3 for 1 and 2 together).
    assert exposed_s([0, 1], zeros, comm, slack) == 0.0
    each = plan_layers(zeros, comm, 2, slack)
    assert each[0] in (each[1], each[2]) and plan_key(each, zeros, comm, 2, slack)[:2] == (0, 2.5)
    # One message: layer 0 lands with layer 1 at 2.5, 0.5 late for its use; that plan, the
    # best for separate messages, stalls an iteration, and only layer 0 alone hides it all.
    assert exposed_s([0, 1], zeros, comm, slack, fused=True) == 0.5
    assert plan_key(each, zeros, comm, 2, slack, fused=True)[0] == 0.5
    plan = plan_layers(zeros, comm, 2, slack, fused=True)
    assert plan[0] != plan[1] == plan[2]
    assert plan_key(plan, zeros, comm, 2, slack, fused=True) == (0.0, 3.0, 0.0, -1.0)
    # Where every plan hides every exchange and the heaviest load ties, the layer with the
    # least slack goes alone (its message lands with the most time to spare), also when the
    # search stops at its first node (the greedy start gives it company: the last layer goes
    # to the iteration with the least time, layer 0's).
    comm, slack, load = [0.5, 1.0, 1.0, 1.0], [2.5, 9.0, 9.0, 9.0], [1.0] * 4
    for nodes in (200_000, 1):
        plan = plan_layers([0.0] * 4, comm, 3, slack, load=load, fused=True, max_nodes=nodes)
        assert plan.count(plan[0]) == 1, plan
        assert plan_key(plan, [0.0] * 4, comm, 3, slack, load, fused=True) == (0, 2, 0, -2.0)


@pytest.mark.slow
def test_split_layers_fill_every_step_to_within_a_slice_of_the_mean_bytes() -> None:
    # charlm's 28 layers (the largest 1.3x a step's mean share at H = 16), launched together
    # as the forward starts, every exchange hidden (2 ms per message, then the bytes).
    numels = [25088, 16384, *[512, 197376, 65792, 512, 263168, 262400] * 4, 512, 25186]
    layers = [[i] for i in range(len(numels))]
    period, mean = 16, sum(numels) / 16

    def heaviest(split: int, by_bytes: bool = True) -> float:
        parts = cut_layers(layers, numels, period, split)
        # Each timed alone: a fixed cost of 20 ms (the ranks' threads on shared cores), then
        # the bytes; an iteration's one message pays the fixed cost once.
        comm = [0.02 + part.numel * 4 / 12.5e6 for part in parts]
        zeros, slack = [0.0] * len(parts), [0.6] * len(parts)
        load = [float(part.numel) for part in parts] if by_bytes else None
        plan = plan_layers(zeros, comm, period, slack, load=load)
        loads = [
            sum(p.numel for p, h in zip(parts, plan, strict=True) if h == it) for it in range(16)
        ]
        return max(loads) / mean

    assert heaviest(0) == pytest.approx(263168 / mean)  # the largest layer's step: 1.3x
    assert heaviest(4) <= 1.1  # slices of a quarter of the mean: within a slice of it
    assert heaviest(4, by_bytes=False) > 1.1  # by their times: the fixed costs balanced
    # The slices cover each layer exactly, in order, none larger than the limit.
    parts = cut_layers([[0, 1], [2]], [10, 7, 3], 2, 2)  # limit ceil(20 / 4) = 5
    assert [p.layer for p in parts] == [0, 0, 0, 0, 1]
    assert [p.segments for p in parts] == [
        ((0, 0, 4),),
        ((0, 4, 8),),
        ((0, 8, 10), (1, 0, 2)),
        ((1, 2, 7),),
        ((2, 0, 3),),
    ]
    assert cut_layers([[0, 1], [2]], [10, 7, 3], 2, 0)[0].segments == ((0, 0, 10), (1, 0, 7))
    with pytest.raises(ValueError, match="split must be >= 0"):
        DreamDDPConfig(H=2, split=-1)


def dreamddp_periods(
    period: int, steps: int, split: int = 0
) -> tuple[list[list[int]], list[int], int, int, int]:
    """Per step after the profile, the parts averaged; the plan; bytes and control bytes; the
    parts (the layers without ``split``)."""
    comm = Communicator()
    config = DreamDDPConfig(H=period, algo="native", final_sync=False, split=split)
    _, opt, sent = train(config, steps)
    assert hasattr(opt, "plan") and hasattr(opt, "parts")
    by_step: list[list[int]] = [[] for _ in range(steps)]
    for record in opt.syncs:
        by_step[record.step - 1].append(record.fragment)
    plans = everyone(comm, list(opt.plan))
    assert all(row == plans[0] for row in plans)  # one plan on every rank
    # Every exchange after the profile was launched from the backward pass.
    assert hasattr(opt, "hook_launches") and opt.hook_launches == len(opt.syncs) - len(opt.parts)
    # What the plan expects of each iteration adds up to the profile's exchanges.
    assert isinstance(opt, DreamDDPOptimizer) and opt.plan is not None
    planned = opt.planned_iterations()
    assert len(planned) == period and all(
        0 <= it["exposed_s"] <= it["comm_s"] + 1e-12 for it in planned
    )
    assert sum(it["comm_s"] for it in planned) == pytest.approx(sum(opt.profile["comm_s"]))
    # The plan is the planner's for the agreed profile, an iteration's layers sent as one
    # message (launched together as the forward starts), balanced by their bytes with split.
    load = [float(opt.parts[part].numel) for part in opt.launch_order] if split else None
    profile = opt.profile
    expected = plan_layers(
        profile["backward_s"], profile["comm_s"], period, profile["slack_s"], load=load, fused=True
    )
    assert [opt.plan[part] for part in opt.launch_order] == expected
    return by_step, list(opt.plan), sent, opt.control_bytes, len(opt.parts)


@pytest.mark.parametrize("split", [0, 1])
def test_dreamddp_averages_every_layer_once_per_period(pool: PoolFn, split: int) -> None:
    period, periods = 3, 2
    # split=1 at H = 3: no part above 75 / 3 = 25 elements; the layers of 40 and 27 in two.
    parts = 5 if split else 3
    for by_step, plan, sent, control, units in pool(2).run(
        dreamddp_periods, period, 1 + period * periods, split, timeout_s=DEADLINE_S
    ):
        assert units == parts and len(plan) == parts
        assert sorted(by_step[0]) == list(range(parts))  # the profile step: every part
        for start in range(1, len(by_step), period):
            window = [part for step in by_step[start : start + period] for part in step]
            assert sorted(window) == list(range(parts))  # each exactly once per period
            for offset, step in enumerate(by_step[start : start + period]):
                assert sorted(step) == [part for part in range(parts) if plan[part] == offset]
        assert control == parts * 32  # the profile's times (3 float64) and order per part
        assert sent == (1 + periods) * 4 * NUMEL + control


def dreamddp_vs_replay(split: int) -> float:
    """H = 1: every layer averaged at every step, before this replica's own update (each in
    slices of at most a ``split``-th of the model with ``split``)."""
    comm = Communicator()
    got, _, _ = train(DreamDDPConfig(H=1, algo="native", split=split), 4)
    replicas = [tiny_model() for _ in range(comm.world_size)]
    for step in range(4):
        for rank, model in enumerate(replicas):
            loss_of(model, rank, step).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        mean = torch.stack([flat(m) for m in replicas]).mean(0)
        for model in replicas:
            with torch.no_grad():
                nn.utils.vector_to_parameters(mean.clone(), model.parameters())
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    final = torch.stack([flat(m) for m in replicas]).mean(0)
    return float((got - final).abs().max())


@pytest.mark.parametrize("split", [0, 4])
def test_dreamddp_period_one_averages_every_step(pool: PoolFn, split: int) -> None:
    for err in pool(2).run(dreamddp_vs_replay, split, timeout_s=DEADLINE_S):
        assert err < 1e-6


def dreamddp_lands_at_use() -> tuple[list[int], list[int], bool, int]:
    """Steps of the exchanges landed after a step and after the next forward; whether that
    forward launched its step's due layers (before any backward); the exchanges in flight
    after the last step."""
    comm = Communicator()
    model = tiny_model()
    opt = build(DreamDDPConfig(H=2, algo="native", final_sync=False), model, comm, "sgd")
    run_steps(opt, model, comm.rank, range(2))  # the profile step, then the period's first
    assert isinstance(opt, DreamDDPOptimizer) and opt.plan is not None
    after_step = sorted({record.step for record in opt.syncs})
    due = [layer for layer in range(len(opt.layers)) if opt.due(layer)]
    nothing_before = not opt._launched
    loss = loss_of(model, comm.rank, 2)  # step 3's forward
    forward_launched = sorted(item.layer for item in opt._launched)
    launched_by_forward = nothing_before and bool(due) and forward_launched == due
    after_forward = sorted({record.step for record in opt.syncs})
    loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
    opt.step()
    opt.zero_grad()
    run_steps(opt, model, comm.rank, range(3, 7))
    in_flight = len(opt._in_flight)
    assert len(opt.wait_s) == 6  # one per step after the profile
    opt.finish()
    return after_step, after_forward, launched_by_forward, in_flight


def test_dreamddp_launches_from_the_forward_and_waits_at_the_layers_next_use(
    pool: PoolFn,
) -> None:
    # (The values it lands, mean(x) - lr g: the replay of
    # test_dreamddp_lands_an_exchange_one_step_later_in_one_message_per_step.)
    for after_step, after_forward, launched_by_forward, in_flight in pool(2).run(
        dreamddp_lands_at_use, timeout_s=DEADLINE_S
    ):
        assert after_step == [1]  # step 2's exchanges are still in flight after its step
        assert after_forward == [1, 2]  # and landed by the forward that uses their layers
        assert launched_by_forward  # step 3's due layers, launched as its forward starts
        assert in_flight > 0


def dreamddp_lands_later(
    period: int,
) -> tuple[float, list[tuple[int, int, int, float]], int, int, dict[str, Any]]:
    """SGD at H = ``period`` (three layers: at H = 2 a step sends two), each exchange landed
    at its layer's use one step after its launch, against a replay of the replicas from the
    run's plan: the largest difference; per exchange after the profile (the trace), its
    layer, launch step, landing step and when its message went on the wire; the layers; the
    period; the trace as a run record carries it."""
    comm = Communicator()
    steps = 9
    config = DreamDDPConfig(H=period, algo="native", trace=True)
    got, opt, _ = train(config, steps)
    assert isinstance(opt, DreamDDPOptimizer) and opt.plan is not None
    plan = opt.plan
    replicas = [tiny_model() for _ in range(comm.world_size)]
    layers = [[m for m in model.modules() if isinstance(m, nn.Linear)] for model in replicas]
    # Per layer in flight: the step that lands it and each replica's parameters as sent.
    flying: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for step in range(1, steps + 1):
        for layer, (land, sent) in list(flying.items()):
            if land <= step:  # landed as the forward reaches it, before any update
                mean = torch.stack(sent).mean(0)
                for rank, model_layers in enumerate(layers):
                    vector = nn.utils.parameters_to_vector(model_layers[layer].parameters())
                    nn.utils.vector_to_parameters(
                        vector + mean - sent[rank], model_layers[layer].parameters()
                    )
                del flying[layer]
        for layer in range(len(plan)):
            if step > 1 and plan[layer] == (step - 2) % period:
                sent = [
                    nn.utils.parameters_to_vector(m[layer].parameters()).detach().clone()
                    for m in layers
                ]
                flying[layer] = (step + 1, sent)
        for rank, model in enumerate(replicas):
            loss_of(model, rank, step - 1).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        if step == 1:  # the profile: every layer averaged before the update
            mean = torch.stack([flat(m) for m in replicas]).mean(0)
            for model in replicas:
                nn.utils.vector_to_parameters(mean.clone(), model.parameters())
        with torch.no_grad():
            for model in replicas:
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    # ``finish()``: what is in flight lands, then the replicas are averaged.
    for layer, (_, sent) in flying.items():
        mean = torch.stack(sent).mean(0)
        for rank, model_layers in enumerate(layers):
            vector = nn.utils.parameters_to_vector(model_layers[layer].parameters())
            nn.utils.vector_to_parameters(
                vector + mean - sent[rank], model_layers[layer].parameters()
            )
    final = torch.stack([flat(m) for m in replicas]).mean(0)
    timeline = [
        (int(e["layer"]), int(e["step"]), int(e["landed_step"]), e["wire_start"]) for e in opt.trace
    ]
    trace = {
        "exchanges": opt.trace,
        "forward_s": opt.forward_s,
        "step_s": opt.step_s,
        "origin_s": opt.trace_origin_s,
    }
    return float((got - final).abs().max()), timeline, len(opt.layers), period, trace


@pytest.mark.parametrize("period", [2, 3])
def test_dreamddp_lands_an_exchange_one_step_later_in_one_message_per_step(
    pool: PoolFn, period: int
) -> None:
    results = pool(2).run(dreamddp_lands_later, period, timeout_s=DEADLINE_S)
    for err, timeline, layers, _, _ in results:
        assert err < 1e-6  # the replay's replicas, exchanges landed where it lands them
        # Each exchange landed one step after its launch (in finish(), step 10, for those
        # still in flight at the end); every layer once in each period.
        assert timeline and all(landed == min(launch + 1, 10) for _, launch, landed, _ in timeline)
        for start in range(2, 10 - period + 1, period):
            window = sorted(
                layer for layer, launch, _, _ in timeline if start <= launch < start + period
            )
            assert window == list(range(layers))
        # The layers a step launches go as one message (one time on the wire).
        for step in range(2, 10):
            wires = [wire for _, launch, _, wire in timeline if launch == step]
            assert len(set(wires)) == min(1, len(wires))
        if period == 2:
            launches = [
                sum(launch == step for _, launch, _, _ in timeline) for step in range(2, 10)
            ]
            assert max(launches) > 1
    # The trace read back as a run record carries it: every iteration, its layers and messages.
    record = {"period_steps": period, "exchange_trace": [trace for *_, trace in results]}
    rows = iteration_timeline(record)
    assert [row["iteration"] for row in rows] == list(range(period))
    assert sorted(layer for row in rows for layer in row["layers"]) == list(range(layers))
    for row in rows:
        assert row["messages"] == 1
        assert row["measured_s"] >= 0 and row["waited_s"] >= 0 and row["planned_s"] is None
    wire = message_wire_s(record)
    assert wire["first"] is not None and wire["later_small"] is None
    assert len(forward_skew_s(record)) == period
    with pytest.raises(ValueError, match="run with trace=1"):
        iteration_timeline({"strategy": "dreamddp", "period_steps": period})


# -- every method: a resume in the middle of a period continues bit for bit -----------------
METHODS: list[tuple[SyncMethod, str]] = [
    # Windows of 4: the resume at step 5 falls inside the second, after the first synchronised;
    # the signal's averages over 3 steps carry across it.
    (SelSyncConfig(threshold=0.05, smoothing_steps=3, window_steps=4, total_steps=12), "sgd"),
    (ADPSGDConfig(total_steps=12, num_syncs=3), "sgd"),
    (PALSGDConfig(H=3, p=0.3), "adamw"),
    (DreamDDPConfig(H=3), "adamw"),
    (DreamDDPConfig(H=3, split=2), "adamw"),  # the plan of slices, a slice in flight
    (LocalSGDClipConfig(H=4, max_norm=0.05), "sgd"),
]


def resume_mid_period(config: SyncMethod, inner: str) -> bool:
    comm = Communicator()
    model = tiny_model()
    opt = build(config, model, comm, inner)
    run_steps(opt, model, comm.rank, range(5))
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    run_steps(opt, model, comm.rank, range(5, 9))
    opt.finish()
    straight = flat(model)

    # As ``commfuse train --resume``: the model loaded first, then the optimizer built (its
    # broadcast from rank 0 must not erase this replica) and its state loaded.
    model2 = tiny_model()
    model2.load_state_dict(saved[0])
    opt2 = build(config, model2, comm, inner)
    opt2.load_state_dict(saved[1])
    run_steps(opt2, model2, comm.rank, range(5, 9))
    opt2.finish()
    for o in (opt, opt2):
        close = getattr(o, "close", None)
        if close is not None:
            close()
    return torch.equal(straight, flat(model2))


@pytest.mark.parametrize(("config", "inner"), METHODS, ids=lambda x: getattr(x, "name", x))
def test_resume_mid_period_is_bit_exact(pool: PoolFn, config: SyncMethod, inner: str) -> None:
    assert pool(2).run(resume_mid_period, config, inner, timeout_s=DEADLINE_S) == [True, True]


# -- the command line --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        "selsync:threshold=0.1,compressor=fp16",
        "selsync:threshold=0.1,outer=nesterov",
        "adpsgd:num_syncs=3,outer=nesterov",
        "selsync:threshold=0.06,min_period_steps=25,window_steps=50",
        "adpsgd:total_steps=200,num_syncs=8",
        "palsgd:H=50,p=0.1",
        "dreamddp:H=4",
        "localsgd-clip:H=4,max_norm=0.5",
    ],
)
def test_specs_round_trip(spec: str) -> None:
    config = strategy_from_spec(spec)
    assert isinstance(config, SyncMethod)
    assert strategy_from_spec(describe_strategy(config)) == config


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        SelSyncConfig(threshold=-1)
    with pytest.raises(ValueError, match="smoothing_steps must be >= 1"):
        SelSyncConfig(smoothing_steps=0)
    with pytest.raises(ValueError, match=r"smoothing_decay must be in \[0, 1\)"):
        strategy_from_spec("selsync:smoothing_decay=1")
    with pytest.raises(ValueError, match="num_syncs must be in"):
        ADPSGDConfig(total_steps=5, num_syncs=6)
    with pytest.raises(ValueError, match="p must be in"):
        strategy_from_spec("palsgd:p=2")
    with pytest.raises(ValueError, match="unknown key 'I'"):
        strategy_from_spec("localsgd-clip:I=3")
    for h in itertools.islice(itertools.count(-1), 2):
        with pytest.raises(ValueError, match="H must be >= 1"):
            DreamDDPConfig(H=h)


# -- through the training loop: checkpoint files, the strategy's hooks and compute-only steps --
def run_rank(config: TrainConfig) -> dict[str, Any]:
    return train_rank(config)


def _config(strategy: str, steps: int, **kw: Any) -> TrainConfig:
    return TrainConfig(
        workload=workload_from_spec("digits:hidden=32,batch=16"),
        strategy=strategy_from_spec(strategy),
        label=strategy,
        steps=steps,
        seed=1,
        **kw,
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "strategy", ["dreamddp:H=3", "selsync:threshold=0.05", "adpsgd:total_steps=7,num_syncs=3"]
)
def test_train_resume_from_checkpoint_is_exact(pool: PoolFn, tmp_path: Path, strategy: str) -> None:
    """``commfuse train``'s checkpoint at step 3 of 7 (mid-period), resumed: the same model, bit
    for bit, through the strategy (DreamDDP's hooks, its compute-only steps); its metrics and
    the run's record give the bytes per synchronisation."""
    p = pool(2)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = p.run(
        run_rank,
        _config(strategy, 7, checkpoint_dir=str(full_dir), checkpoint_every=3, compute_steps=2),
        timeout_s=DEADLINE_S,
    )
    shutil.copytree(ckpt.step_dir(full_dir, 3), ckpt.step_dir(resumed_dir, 3))
    ckpt.mark_latest(resumed_dir, 3)
    resumed = p.run(
        run_rank,
        _config(strategy, 7, checkpoint_dir=str(resumed_dir), resume=True),
        timeout_s=DEADLINE_S,
    )
    assert resumed[0]["start_step"] == 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert full[0]["digest"] == full[1]["digest"]  # one model at the end (final sync)
    assert len(full[0]["compute_step_time_s"]) == 2
    metrics = full[0]["strategy_metrics"]
    # Whole-model exchanges in fp32 (DreamDDP's layers add up to models), the decisions apart.
    digits_numel = (64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10)
    assert metrics["syncs"] > 0 and metrics["bytes_per_sync"] == 4 * digits_numel
    record = summarize(full, strategy=strategy, workload="digits", warmup=1)
    assert record["bytes_total"] == sum(full[0]["history"]["bytes"])
    assert record["bytes_per_sync"] == metrics["bytes_per_sync"]
    if strategy.startswith("dreamddp"):  # a wait per step after the profile, by position
        assert len(metrics["exchange_wait_s"]) == 6 and min(metrics["exchange_wait_s"]) >= 0
        assert len(record["phase_exchange_wait_s"]) == 3 and record["mean_exchange_wait_s"] >= 0


def test_simulator_prices_the_fixed_period_ones_and_names_the_others() -> None:
    from commfuse.train.sim_plan import plan_for

    assert plan_for(PALSGDConfig(H=30, p=0.1)) == plan_for(diloco(H=30))
    assert plan_for(LocalSGDClipConfig(H=6)) == plan_for(local_sgd(H=6))
    dream = plan_for(DreamDDPConfig(H=4))
    assert dream.local_sgd_period == 1 and dream.outer_fraction == 0.25  # 1/H of it every step
    with pytest.raises(ValueError, match="does not model selsync"):
        plan_for(SelSyncConfig())
