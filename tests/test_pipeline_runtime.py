"""The pipeline runtime against the unsplit model: loss and gradients equal in fp64 for every
schedule, micro-batches of different sizes and lengths, on real gloo ranks (2 and 4) and in one
process; each boundary's bytes per micro-batch against the activation's size; a stage that dies
and a deadline that passes are named by stage, micro-batch and action."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from commfuse.cluster.errors import RankError
from commfuse.comm import CommConfig, CommError, Communicator
from commfuse.pipeline import (
    Action,
    bubble_of_events,
    interleaved_1f1b,
    one_f_one_b,
    schedule_by_name,
    schedule_from_actions,
    zb_h1,
)
from commfuse.pipeline.cut import cut
from commfuse.pipeline.runtime import HEADER_SLOTS, LABELS, PipelineError, PipelineRuntime
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
WIDTH = 3
LAYERS = 8


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    ).double()


def batches(sizes: list[int], lengths: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Micro-batch m: ``sizes[m]`` sequences of ``lengths[m]`` positions of WIDTH features."""
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(n, t, WIDTH, generator=gen, dtype=torch.float64)
        for n, t in zip(sizes, lengths, strict=True)
    ]
    ys = [
        torch.randn(n, t, WIDTH, generator=gen, dtype=torch.float64)
        for n, t in zip(sizes, lengths, strict=True)
    ]
    return xs, ys


def reference(sizes: list[int], lengths: list[int]) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model on the same micro-batches, each loss weighted by its share."""
    model = make_model()
    xs, ys = batches(sizes, lengths)
    total = sum(sizes)
    loss = sum(
        nn.functional.mse_loss(model(x), y) * (x.shape[0] / total)
        for x, y in zip(xs, ys, strict=True)
    )
    assert isinstance(loss, torch.Tensor)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach()), {
        n: p.grad for n, p in model.named_parameters() if p.grad is not None
    }


def boundaries(num_stages: int) -> list[int]:
    return [i * LAYERS // num_stages for i in range(1, num_stages)]


class Jitter(nn.Module):
    """Sleeps a random while (seeded per rank) before passing its input on: ranks reach each
    message in a different order from run to run of the schedule."""

    def __init__(self, seed: int, most_s: float) -> None:
        super().__init__()
        self.rng, self.most_s = random.Random(seed), most_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.rng.uniform(0, self.most_s) if self.rng.random() < 0.5 else 0.0)
        return x


def run_case(
    comm: Communicator | None,
    name: str,
    v: int,
    sizes: list[int],
    lengths: list[int],
    jitter_s: float = 0.0,
) -> dict[str, Any]:
    """This rank's part of one step of schedule ``name``: its loss, gradients, bytes."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    schedule = schedule_by_name(
        name, num_ranks=world, num_microbatches=len(sizes), stages_per_rank=v
    )
    model = make_model()
    stages = cut(model, boundaries(schedule.num_stages))
    mine: dict[int, nn.Module] = {
        s: stages[s] for s in range(schedule.num_stages) if schedule.stage_to_rank[s] == rank
    }
    if jitter_s:
        mine = {s: nn.Sequential(Jitter(1000 * rank + s, jitter_s), m) for s, m in mine.items()}
    runtime = PipelineRuntime(schedule, mine, comm, loss_fn=nn.functional.mse_loss)
    xs, ys = batches(sizes, lengths)
    if comm is not None:
        comm.stats.reset()
    result = runtime.step(
        xs if 0 in mine else None, ys if schedule.num_stages - 1 in mine else None
    )
    stats = {}
    for label in LABELS.values():
        c = comm.stats[label] if comm is not None else None
        stats[label] = (
            (c.bytes_sent, c.messages_sent, c.bytes_recv, c.messages_recv) if c else (0,) * 4
        )
    return {
        "loss": result.loss,
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "stats": stats,
        "stage_to_rank": schedule.stage_to_rank,
    }


def run_cases(
    cases: list[tuple[str, int, list[int], list[int]]], jitter_s: float = 0.0
) -> list[dict[str, Any]]:
    comm = Communicator(config=CommConfig(deadline_s=60))
    return [run_case(comm, *case, jitter_s=jitter_s) for case in cases]


def check(per_rank: list[dict[str, Any]], sizes: list[int], lengths: list[int]) -> None:
    want_loss, want_grads = reference(sizes, lengths)
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1 and losses[0] == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    got: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert not set(got) & set(r["grads"]), "a parameter's gradient on two ranks"
        got.update(r["grads"])
    assert set(got) == set(want_grads)
    for n, g in got.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-12, atol=1e-14, msg=n)
    check_bytes(per_rank, sizes, lengths)


def check_bytes(per_rank: list[dict[str, Any]], sizes: list[int], lengths: list[int]) -> None:
    """Each boundary that crosses ranks carries, per micro-batch, one activation forward and
    one gradient back of n_m x L_m x WIDTH float64 elements, each after an 80-byte header."""
    owner = per_rank[0]["stage_to_rank"]
    per_mb = [n * t * WIDTH * 8 for n, t in zip(sizes, lengths, strict=True)]
    m = len(sizes)
    for rank, r in enumerate(per_rank):
        fwd = sum(1 for s in range(len(owner) - 1) if owner[s] == rank and owner[s + 1] != rank)
        bwd = sum(1 for s in range(1, len(owner)) if owner[s] == rank and owner[s - 1] != rank)
        into = sum(1 for s in range(1, len(owner)) if owner[s] == rank and owner[s - 1] != rank)
        back = sum(1 for s in range(len(owner) - 1) if owner[s] == rank and owner[s + 1] != rank)
        stats = r["stats"]
        assert stats[LABELS["F"]] == (fwd * sum(per_mb), fwd * m, into * sum(per_mb), into * m)
        assert stats[LABELS["B"]] == (bwd * sum(per_mb), bwd * m, back * sum(per_mb), back * m)
        sent, recv = (fwd + bwd) * m, (into + back) * m
        assert stats[LABELS["header"]] == (
            sent * HEADER_SLOTS * 8,
            sent,
            recv * HEADER_SLOTS * 8,
            recv,
        )


# -- one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("v", [1, 2, 4, 8])
def test_stages_on_one_rank_hand_over_locally_and_match(v: int) -> None:
    sizes, lengths = [3, 1, 2], [2, 5, 1]
    check([run_case(None, "interleaved_1f1b", v, sizes, lengths)], sizes, lengths)


def test_split_backward_on_one_rank_is_exact() -> None:
    """I then W for two stages on one rank, W long after: the same gradients as B."""
    order = ["0F0", "1F0", "0F1", "1F1", "1I0", "0I0", "1I1", "1W0", "0I1", "0W0", "1W1", "0W1"]
    schedule = schedule_from_actions([[Action.parse(a) for a in order]], name="split")
    model = make_model()
    stages = cut(model, [4])
    sizes, lengths = [2, 3], [3, 3]
    xs, ys = batches(sizes, lengths)
    runtime = PipelineRuntime(
        schedule, dict(enumerate(stages)), None, loss_fn=nn.functional.mse_loss
    )
    result = runtime.step(xs, ys)
    want_loss, want_grads = reference(sizes, lengths)
    assert result.loss == pytest.approx(want_loss, rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-12, atol=1e-14)
    # equal lengths: the whole batch at once gives the same, as with the unsplit model
    whole = make_model()
    nn.functional.mse_loss(whole(torch.cat(xs)), torch.cat(ys)).backward()  # type: ignore[no-untyped-call]
    for (n, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=n)


def test_a_stage_returning_a_tuple_is_refused() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    schedule = interleaved_1f1b(num_ranks=1, stages_per_rank=2, num_microbatches=1)
    stages = {0: nn.Sequential(nn.Linear(WIDTH, WIDTH).double(), Pair()), 1: nn.Identity()}
    runtime = PipelineRuntime(schedule, stages, None, loss_fn=nn.functional.mse_loss)
    xs, ys = batches([1], [1])
    with pytest.raises(TypeError, match=r"stage 0 returned tuple; a stage takes one tensor"):
        runtime.step(xs, ys)


def test_the_runtime_refuses_what_does_not_fit() -> None:
    stages = cut(make_model(), [4])
    schedule = interleaved_1f1b(num_ranks=1, stages_per_rank=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"rank 0 holds stages \[0, 1\].*got modules for \[0\]"):
        PipelineRuntime(schedule, {0: stages[0]}, None, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"for 2 ranks; the communicator has 1"):
        PipelineRuntime(
            one_f_one_b(num_stages=2, num_microbatches=2),
            {0: stages[0]},
            None,
            loss_fn=nn.functional.mse_loss,
        )
    runtime = PipelineRuntime(
        schedule, dict(enumerate(stages)), None, loss_fn=nn.functional.mse_loss
    )
    xs, ys = batches([1, 1], [1, 1])
    with pytest.raises(ValueError, match=r"needs 2 targets \(one per micro-batch\), got 1"):
        runtime.step(xs, ys[:1])
    with pytest.raises(ValueError, match=r"loss_weights has 3 weights for 2 micro-batches"):
        runtime.step(xs, ys, loss_weights=[1.0, 1.0, 1.0])
    halves = runtime.step(xs, ys, loss_weights=[0.5, 0.5])
    assert halves.loss == pytest.approx(sum(halves.microbatch_losses) / 2, rel=1e-12)


# -- real gloo ranks ------------------------------------------------------------------------

SCHEDULE_CASES = [
    ("sequential", 1),
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb_h1", 1),
    ("interleaved_1f1b", 2),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("world", "sizes", "lengths"),
    [(2, [3, 1, 2], [4, 2, 3]), (4, [2, 1, 3, 1, 2], [1, 3, 2, 2, 4]), (4, [2, 3], [3, 1])],
)
def test_every_schedule_matches_the_unsplit_model_on_gloo(
    pool: PoolFn, world: int, sizes: list[int], lengths: list[int]
) -> None:
    cases = [(name, v, sizes, lengths) for name, v in SCHEDULE_CASES]
    ranks = pool(world).run(run_cases, cases, timeout_s=180)
    for i, (name, _v) in enumerate(SCHEDULE_CASES):
        per_rank = [ranks[r][i] for r in range(world)]
        try:
            check(per_rank, sizes, lengths)
        except AssertionError as err:
            raise AssertionError(f"{name} on {world} ranks: {err}") from err


@pytest.mark.e2e
def test_random_delays_on_every_rank_change_nothing(pool: PoolFn) -> None:
    """Each stage sleeps up to 20 ms before half its forwards: messages arrive in another
    order, waits last longer, and every schedule still finishes (a hang would fail by the
    deadline) with the same loss, gradients and bytes."""
    sizes, lengths = [2, 1, 3, 1, 2, 2, 1, 3], [2, 1, 1, 3, 2, 1, 2, 2]
    cases = [(name, v, sizes, lengths) for name, v in SCHEDULE_CASES]
    ranks = pool(4).run(run_cases, cases, 0.02, timeout_s=240)
    for i, (name, _v) in enumerate(SCHEDULE_CASES):
        try:
            check([ranks[r][i] for r in range(4)], sizes, lengths)
        except AssertionError as err:
            raise AssertionError(f"{name} with delays: {err}") from err


def traced_step() -> list[tuple[str, str]]:
    """One ZB-H1 step with the communicator's trace on: (name, lane) of each event in order."""
    comm = Communicator(config=CommConfig(deadline_s=60, trace=True))
    schedule = zb_h1(num_stages=2, num_microbatches=3)
    stages = cut(make_model(), [4])
    runtime = PipelineRuntime(
        schedule, {comm.rank: stages[comm.rank]}, comm, loss_fn=nn.functional.mse_loss
    )
    xs, ys = batches([1, 2, 1], [2, 2, 2])
    runtime.step(xs if comm.rank == 0 else None, ys if comm.rank == 1 else None)
    events = comm.trace.chrome_events()
    assert 0.0 <= bubble_of_events(events) < 1.0
    return [(e["name"], str(e["tid"])) for e in events]


@pytest.mark.e2e
def test_the_trace_holds_each_compute_action_beside_its_messages(pool: PoolFn) -> None:
    schedule = zb_h1(num_stages=2, num_microbatches=3)
    for rank, events in enumerate(pool(2).run(traced_step, timeout_s=120)):
        compute = [
            name.removeprefix("pipeline ") for name, _ in events if name.startswith("pipeline ")
        ]
        assert compute == [str(a) for a in schedule.compute_actions(rank)]
        messages = [name for name, lane in events if lane.startswith("peer")]
        # per micro-batch: a header and a payload, one way (activation or gradient) each way
        assert sorted(set(messages)) == sorted(LABELS.values())
        assert len(messages) == 3 * 2 * 2


def die_in_forward(deadline_s: float) -> str:
    """Rank 1 (stage 1) exits in its forward of micro-batch 1; rank 0 reports what it saw."""
    comm = Communicator(config=CommConfig(deadline_s=deadline_s))
    schedule = one_f_one_b(num_stages=2, num_microbatches=4)
    stages = cut(make_model(), [4])
    calls = []

    class Dies(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 2:
                os._exit(17)
            return x

    if comm.rank == 1:
        stages[1].append(Dies())
    runtime = PipelineRuntime(
        schedule, {comm.rank: stages[comm.rank]}, comm, loss_fn=nn.functional.mse_loss
    )
    xs, ys = batches([1] * 4, [2] * 4)
    try:
        runtime.step(xs if comm.rank == 0 else None, ys if comm.rank == 1 else None)
    except PipelineError as err:
        cause = type(err.__cause__).__name__
        return f"{cause}|{err.stage}|{err.microbatch}|{err.action}|{err}"
    return "no error"


def never_join(deadline_s: float) -> str:
    """Rank 1 never runs its part: rank 0's first wait passes its deadline."""
    comm = Communicator(config=CommConfig(deadline_s=deadline_s))
    if comm.rank == 1:
        return "away"
    schedule = one_f_one_b(num_stages=2, num_microbatches=2)
    stages = cut(make_model(), [4])
    runtime = PipelineRuntime(schedule, {0: stages[0]}, comm, loss_fn=nn.functional.mse_loss)
    xs, _ = batches([1, 1], [2, 2])
    try:
        runtime.step(xs)
    except PipelineError as err:
        assert isinstance(err.__cause__, CommError)
        return f"{type(err.__cause__).__name__}|{err.stage}|{err.microbatch}|{err.action}|{err}"
    return "no error"


@pytest.mark.e2e
def test_a_stage_that_dies_is_named_by_its_neighbour(pool: PoolFn) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(die_in_forward, 60.0, timeout_s=120, failure_grace_s=90)
    assert info.value.rank == 1 and "died" in str(info.value)
    seen = str(info.value.partial_results[0])
    cause, stage, microbatch, action, message = seen.split("|", 4)
    assert cause in ("PeerFailureError", "CommTimeoutError", "CommError"), seen
    assert stage == "0" and action.startswith("0") and f"micro-batch {microbatch}" in message
    assert "rank 0, pipeline step 0, stage 0" in message


@pytest.mark.e2e
def test_a_deadline_that_passes_names_stage_micro_batch_and_action(pool: PoolFn) -> None:
    seen = pool(2).run(never_join, 2.0, timeout_s=120)[0]
    cause, stage, microbatch, action, message = seen.split("|", 4)
    # 1F1B on rank 0: 0F0, 0SEND_F0, 0F1, 0SEND_F1, 0RECV_B0, 0B0: the first wait is 0B0's
    assert (cause, stage, microbatch, action) == ("CommTimeoutError", "0", "0", "0B0"), seen
    assert "stage 0, micro-batch 0, action 0B0" in message and "deadline" in message
