"""Pipeline schedules as data, without a process group: the generators against hand-written
grids and against torch's own schedule code, the validator's errors, the lowering's sends and
receives, the replay's step time and bubble against the schedules' formulas, and the CSV files
torch reads."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from commfuse.collectives.cost import LinkCost
from commfuse.comm.trace import write_chrome_trace
from commfuse.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    StageTimes,
    bubble_of_events,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    read_csv,
    replay,
    schedule_by_name,
    schedule_from_actions,
    schedule_from_csv,
    sequential,
    validate,
    write_csv,
    zb_h1,
)
from commfuse.pipeline.generators import SCHEDULES


def grid(text: str) -> list[list[Action | None]]:
    """A schedule written as a table, one line per step, one column per rank, ``.`` for idle."""
    lines = [line.split() for line in text.strip().splitlines()]
    ranks = len(lines[0])
    return [
        [None if line[r] == "." else Action.parse(line[r]) for line in lines] for r in range(ranks)
    ]


def names(row: tuple[Action | None, ...] | list[Action]) -> list[str]:
    return [str(a) for a in row if a is not None]


# -- the grammar ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("0F1", Action(0, "F", 1)),
        ("1B2", Action(1, "B", 2)),
        ("0I3", Action(0, "I", 3)),
        ("0W3", Action(0, "W", 3)),
        ("2SEND_F1", Action(2, "SEND_F", 1)),
        ("1RECV_B0", Action(1, "RECV_B", 0)),
        ("12F104", Action(12, "F", 104)),
        ("1REDUCE_GRAD", Action(1, "REDUCE_GRAD")),
    ],
)
def test_actions_read_and_write_as_torch_does(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text
    ours = torch_schedules._Action.from_str(text)
    assert str(ours) == text  # torch reads what we write, and writes it back the same


@pytest.mark.parametrize("bad", ["F1", "0X1", "0F", "0SEND_F", "a0F1", "0F1x"])
def test_a_bad_action_says_how_to_write_one(bad: str) -> None:
    with pytest.raises(ValueError, match=r"bad action|needs a micro-batch"):
        Action.parse(bad)


# -- the generators against hand-written grids and torch ------------------------------------

GOLDEN_1F1B_4X8 = """
0F0 .   .   .
0F1 1F0 .   .
0F2 1F1 2F0 .
0F3 1F2 2F1 3F0
.   .   .   3B0
.   .   2B0 3F1
.   1B0 2F2 3B1
0B0 1F3 2B1 3F2
0F4 1B1 2F3 3B2
0B1 1F4 2B2 3F3
0F5 1B2 2F4 3B3
0B2 1F5 2B3 3F4
0F6 1B3 2F5 3B4
0B3 1F6 2B4 3F5
0F7 1B4 2F6 3B5
0B4 1F7 2B5 3F6
.   1B5 2F7 3B6
0B5 .   2B6 3F7
.   1B6 .   3B7
0B6 .   2B7 .
.   1B7 .   .
0B7 .   .   .
"""


def trimmed(rows: list[list[Action | None]]) -> tuple[tuple[Action | None, ...], ...]:
    out = []
    for row in rows:
        while row and row[-1] is None:
            row = row[:-1]
        out.append(tuple(row))
    return tuple(out)


def test_golden_1f1b_on_four_ranks() -> None:
    """Warm-up of p - 1 - r forwards, one forward and one backward in turn, then the drain:
    the textbook picture (Narayanan et al. 2021, figure 4 top), one unit per action."""
    assert one_f_one_b(num_stages=4, num_microbatches=8).actions == trimmed(grid(GOLDEN_1F1B_4X8))


def test_zb_h1_defers_rank_r_first_r_weight_gradients() -> None:
    s = zb_h1(num_stages=2, num_microbatches=3)
    assert names(s.actions[0]) == ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"]
    assert names(s.actions[1]) == ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"]


def test_interleaved_places_stage_s_on_rank_s_mod_p() -> None:
    s = interleaved_1f1b(num_ranks=2, stages_per_rank=2, num_microbatches=4)
    assert s.stage_to_rank == (0, 1, 0, 1)
    assert names(s.compute_actions(0))[:6] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0"]


def torch_orders(name: str, p: int, v: int, m: int) -> list[list[Action | None]]:
    """torch's own action lists (its schedule classes' order code, called without stages)."""
    if name == "gpipe":
        ns = SimpleNamespace(_num_stages=p, _n_microbatches=m)
        order: Any = torch_schedules.ScheduleGPipe._get_pipeline_order(ns)  # type: ignore[arg-type]
        rows = [order[r] for r in range(p)]
    else:
        cls: Any = {
            "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
            "zb_h1": torch_schedules.ScheduleInterleavedZeroBubble,
        }[name]
        rounds = max(1, m // p)
        ns = SimpleNamespace(
            n_local_stages=v, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds
        )
        rows = [cls._calculate_single_rank_operations(ns, r) for r in range(p)]
    return [[None if a is None else Action.parse(str(a)) for a in row] for row in rows]


@pytest.mark.parametrize(
    ("name", "v"), [("gpipe", 1), ("interleaved_1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]
)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8])
def test_each_rank_computes_in_torchs_order(name: str, v: int, p: int, m: int) -> None:
    """The same compute order per rank as torch 2.x's schedule classes (interleaved with one
    stage per rank is 1F1B). torch's lists are orders, not time grids (its single-stage lists
    drop idle steps), so they validate as orders and lower to the same sends and receives."""
    if m % max(1, m // p):
        pytest.skip("torch's rounds do not divide this micro-batch count")
    ours = schedule_by_name(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
    theirs = schedule_from_actions(
        torch_orders(name, p, v, m), num_stages=p * v, num_microbatches=m
    )
    for rank in range(p):
        assert ours.compute_actions(rank) == theirs.compute_actions(rank), rank
    validate(theirs)
    assert lower(theirs).actions == lower(ours).actions


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward has not (activations held)."""
    most = held = 0
    for a in actions:
        held += {"F": 1, "B": -1, "I": -1}.get(a.kind, 0)
        most = max(most, held)
    return most


@pytest.mark.parametrize(("p", "m"), [(2, 1), (3, 5), (4, 8), (5, 2), (4, 16)])
def test_1f1b_and_zb_h1_hold_p_minus_r_micro_batches_gpipe_all(p: int, m: int) -> None:
    for r in range(p):
        assert in_flight(one_f_one_b(num_stages=p, num_microbatches=m).compute_actions(r)) == min(
            p - r, m
        )
        assert in_flight(zb_h1(num_stages=p, num_microbatches=m).compute_actions(r)) == min(
            p - r, m
        )
        assert in_flight(gpipe(num_stages=p, num_microbatches=m).compute_actions(r)) == m


# -- the validator --------------------------------------------------------------------------


def bad(text: str) -> Schedule:
    return schedule_from_actions(grid(text), grid=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 .\n0B0 1F0\n. 1B0", r"rank 0, step 1, 0B0: needs 1B0, which rank 1 runs at step 2"),
        ("0F0 .\n. 1B0\n. 1F0\n0B0 .", r"rank 1, step 1, 1B0: runs before 1F0"),
        ("0F0 .\n. 1F0\n. 1I0\n0B0 .", r"stage 1, micro-batch 0: no W"),
        ("0F0 .\n. 1F0\n. 1B0\n0I0 .\n0W0 .\n0B0 .", r"both a full backward and a split one"),
        ("0F0 .\n. 1F0\n. 1B0\n0W0 .\n0I0 .", r"rank 0, step 3, 0W0: runs before 0I0"),
        ("0F0 .\n. 1F0\n. 1B0", r"stage 0, micro-batch 0: no B \(or I and W\)"),
        ("0F0 .\n0F0 1F0\n. 1B0\n0B0 .", r"actions run more than once: \['0F0'\]"),
        ("0F0 .\n. 1F0\n. 1B0\n0B0 .\n. 1F1", r"stage 0, micro-batch 1: no forward"),
    ],
)
def test_the_validator_names_rank_step_and_action(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(bad(text))


def test_a_stage_on_two_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stage 0 computes on rank 0 and on rank 1"):
        bad("0F0 .\n. 0B0")


def test_an_order_that_deadlocks_is_named() -> None:
    """Orders (no grid) where rank 0 waits for rank 1's backward before its second forward,
    which rank 1 needs first: neither can move."""
    rows = [
        [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
        [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)],
    ]
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 waits at 0B0.*for 1B0 \(rank 1\)"):
        validate(schedule_from_actions(rows))


def test_a_lowered_schedule_without_its_receive_is_refused() -> None:
    lowered = lower(gpipe(num_stages=2, num_microbatches=1))
    rows = [
        list(lowered.actions[0]),
        [a for a in lowered.actions[1] if a != Action(1, "RECV_F", 0)],
    ]
    with pytest.raises(ScheduleError, match=r"1F0: no 1RECV_F0 before it"):
        validate(schedule_from_actions(rows))
    rows = [[*lowered.actions[0], Action(0, "SEND_F", 0)], list(lowered.actions[1])]
    with pytest.raises(ScheduleError, match=r"no match: \['0SEND_F0'\]"):
        validate(schedule_from_actions(rows))


# -- the lowering ---------------------------------------------------------------------------


def test_lowering_gpipe_two_ranks_by_hand() -> None:
    lowered = lower(gpipe(num_stages=2, num_microbatches=2))
    assert names(lowered.actions[0]) == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1",
    ]  # fmt: skip
    assert names(lowered.actions[1]) == [
        "1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1",
    ]  # fmt: skip


def test_lowering_1f1b_posts_each_receive_when_its_sender_computes() -> None:
    lowered = lower(one_f_one_b(num_stages=2, num_microbatches=3))
    assert names(lowered.actions[0]) == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0",
        "0F2", "0SEND_F2", "0RECV_B1", "0B1", "0RECV_B2", "0B2",
    ]  # fmt: skip
    assert names(lowered.actions[1]) == [
        "1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1",
        "1B1", "1SEND_B1", "1RECV_F2", "1F2", "1B2", "1SEND_B2",
    ]  # fmt: skip


def test_lowering_zb_h1_sends_after_i_and_never_after_w() -> None:
    lowered = lower(zb_h1(num_stages=2, num_microbatches=2))
    row = names(lowered.actions[1])
    assert row.index("1SEND_B0") == row.index("1I0") + 1
    assert not any(a.startswith("1SEND") and row[i - 1][1] == "W" for i, a in enumerate(row))


def test_a_stage_handing_to_a_stage_on_the_same_rank_sends_nothing() -> None:
    lowered = lower(interleaved_1f1b(num_ranks=1, stages_per_rank=3, num_microbatches=2))
    assert not lowered.is_lowered  # nothing crosses ranks: no send, no receive
    lowered = lower(interleaved_1f1b(num_ranks=2, stages_per_rank=2, num_microbatches=2))
    sends = [str(a) for row in lowered.actions for a in row if a is not None and "SEND" in a.kind]
    # each of 3 boundaries crosses ranks, twice per micro-batch (activation and gradient)
    assert len(sends) == 3 * 2 * 2


# -- the grid of cases ----------------------------------------------------------------------


def cases() -> list[tuple[str, int, int, int]]:
    out = []
    for name in SCHEDULES:
        for v in (1, 2, 3) if name == "interleaved_1f1b" else (1,):
            for p in (1, 2, 3, 4, 5):
                for m in (1, 2, 3, 5, 7, 8, 9):
                    if name == "interleaved_1f1b" and m % max(1, m // p):
                        continue
                    out.append((name, v, p, m))
    return out


@pytest.mark.parametrize(("name", "v", "p", "m"), cases())
def test_every_schedule_validates_lowers_and_replays(name: str, v: int, p: int, m: int) -> None:
    s = schedule_by_name(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
    validate(s)
    lowered = lower(s)
    assert lowered.is_lowered == (p > 1)
    for rank in range(p):
        assert lowered.compute_actions(rank) == s.compute_actions(rank)
    per_rank = [len(s.compute_actions(r)) for r in range(p)]
    assert per_rank == [v * m * (3 if name == "zb_h1" else 2)] * p
    times = StageTimes(forward_s=1.0, backward_input_s=1.5, backward_weight_s=0.5)
    link = LinkCost(alpha_s=0.25, beta_s_per_byte=1e-3)
    assert replay(lowered, times=times, link=link, boundary_bytes=100).step_s == pytest.approx(
        replay(s, times=times, link=link, boundary_bytes=100).step_s
    )


def test_interleaved_refuses_rounds_of_unequal_size() -> None:
    with pytest.raises(ValueError, match=r"num_microbatches=5 is not a multiple of its 2 rounds"):
        interleaved_1f1b(num_ranks=2, stages_per_rank=2, num_microbatches=5)


# -- the replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
def test_bubble_of_1f1b_and_gpipe_is_the_formula(p: int, m: int) -> None:
    """(p - 1) / (m + p - 1) with equal stages and free links, whatever F and B cost."""
    for times in (None, StageTimes(forward_s=1.0, backward_input_s=2.0, backward_weight_s=0.0)):
        for s in (
            one_f_one_b(num_stages=p, num_microbatches=m),
            gpipe(num_stages=p, num_microbatches=m),
        ):
            r = replay(s, times=times)
            assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 9), (5, 4, 10)])
def test_bubble_of_interleaved_is_divided_by_its_stages_per_rank(p: int, v: int, m: int) -> None:
    """Bubble time (p - 1)(F + B) / v against m (F + B) of work: (p - 1) / (v m + p - 1) with
    each stage 1/v of a rank's share."""
    r = replay(interleaved_1f1b(num_ranks=p, stages_per_rank=v, num_microbatches=m))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [5, 8, 9])
def test_zb_h1_bubble_is_a_third_of_1f1b_with_equal_f_i_w(p: int, m: int) -> None:
    """Qi et al.: (p - 1)(F + I - W) units of bubble against 1F1B's (p - 1)(F + I + W)."""
    zb = replay(zb_h1(num_stages=p, num_microbatches=m))
    ofob = replay(one_f_one_b(num_stages=p, num_microbatches=m))
    assert zb.step_s == 3 * m + (p - 1)
    assert ofob.step_s == 3 * m + 3 * (p - 1)


def test_the_link_adds_alpha_plus_n_beta_per_hop() -> None:
    """One micro-batch through two stages: F, hop, F, B, hop, B."""
    link = LinkCost(alpha_s=0.5, beta_s_per_byte=0.01)
    times = StageTimes(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.0)
    r = replay(gpipe(num_stages=2, num_microbatches=1), times=times, link=link, boundary_bytes=100)
    hop = 0.5 + 100 * 0.01
    assert r.step_s == pytest.approx(1 + hop + 1 + 3 + hop + 3)
    assert r.busy_s == (4.0, 4.0)
    sized = replay(
        gpipe(num_stages=2, num_microbatches=1),
        times=times,
        link=link,
        boundary_bytes=lambda a: 100 if a.kind == "F" else 0,
    )
    assert sized.step_s == pytest.approx(1 + hop + 1 + 3 + 0.5 + 3)


# -- CSV ------------------------------------------------------------------------------------


def test_csv_round_trip_and_torchs_reader(tmp_path: Path) -> None:
    s = zb_h1(num_stages=3, num_microbatches=4)
    path = tmp_path / "zb.csv"
    s.to_csv(path)
    back = schedule_from_csv(path, name="zb_h1", grid=True)
    assert back == s
    with open(path, newline="") as file:  # what torch's _load_csv does with each cell
        rows = [[torch_schedules._Action.from_str(c) for c in row] for row in csv.reader(file)]
    assert [[("" if a is None else str(a)) for a in row] for row in rows] == [
        ["" if a is None else str(a) for a in row] for row in s.actions
    ]
    lowered = lower(s)
    write_csv(lowered.actions, tmp_path / "lowered.csv")
    assert read_csv(tmp_path / "lowered.csv") == lowered.actions


def test_a_csv_written_by_torch_loads(tmp_path: Path) -> None:
    """torch's _dump_csv: csv.writer over its _Action objects and None."""
    order: Any = torch_schedules.ScheduleGPipe._get_pipeline_order(
        SimpleNamespace(_num_stages=3, _n_microbatches=2)  # type: ignore[arg-type]
    )
    path = tmp_path / "torch.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        for rank in order:
            writer.writerow(order[rank])
    s = schedule_from_csv(path)
    validate(s)
    assert Action(0, "REDUCE_GRAD") in s.actions[0]
    assert lower(s).actions == lower(gpipe(num_stages=3, num_microbatches=2)).actions


def test_a_bad_cell_names_its_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1X0\n")
    with pytest.raises(ValueError, match=r"rank 1 \(row 2\).*bad action '1X0'"):
        read_csv(path)


def test_the_replay_draws_as_a_chrome_trace(tmp_path: Path) -> None:
    s = zb_h1(num_stages=3, num_microbatches=4)
    r = replay(s)
    events = r.chrome_events(s)
    assert len(events) == sum(len(s.compute_actions(rank)) for rank in range(3))
    for e in events:
        a = Action.parse(e["name"])
        assert e["pid"] == s.stage_to_rank[a.stage] and e["ph"] == "X"
        assert (e["ts"], e["dur"]) == (r.start_s[a] * 1e6, (r.finish_s[a] - r.start_s[a]) * 1e6)
    write_chrome_trace(events, tmp_path / "zb.json")
    loaded = json.loads((tmp_path / "zb.json").read_text())["traceEvents"]
    assert len([e for e in loaded if e["ph"] == "X"]) == len(events)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 4])
def test_sequential_runs_one_micro_batch_at_a_time(p: int, m: int) -> None:
    s = sequential(num_stages=p, num_microbatches=m)
    r = replay(s)
    assert r.bubble_fraction == pytest.approx((p - 1) / p, abs=1e-12)
    assert r.step_s == 3 * p * m  # F, then B (two units), on every stage in turn


@pytest.mark.parametrize("name", ["sequential", "gpipe", "1f1b", "zb_h1"])
def test_the_bubble_measured_on_the_replays_trace_is_the_replays(name: str) -> None:
    s = schedule_by_name(name, num_ranks=4, num_microbatches=6)
    times = StageTimes(forward_s=1.0, backward_input_s=1.5, backward_weight_s=0.5)
    r = replay(s, times=times, link=LinkCost(alpha_s=0.1, beta_s_per_byte=0.0))
    events = r.chrome_events(s)
    assert bubble_of_events(events) == pytest.approx(r.bubble_fraction, abs=1e-12)
    renamed = [{**e, "name": f"pipeline {e['name']}"} for e in events]  # the runtime's names
    noise = [{"name": "pipeline.activation", "ph": "X", "ts": 0.0, "dur": 1e9, "pid": 0}]
    assert bubble_of_events(renamed + noise) == pytest.approx(r.bubble_fraction, abs=1e-12)
    with pytest.raises(ValueError, match="no compute action"):
        bubble_of_events(noise)
