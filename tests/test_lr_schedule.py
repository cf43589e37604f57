"""Learning-rate schedules: their factors against torch's schedulers, each strategy's update at
the scheduled rate on real ranks, and a resume that needs no scheduler state."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.cli import main
from commfuse.cli.spec import lr_schedule_from_spec, strategy_from_spec, workload_from_spec
from commfuse.train import TrainConfig, train_rank
from commfuse.train import checkpoint as ckpt
from commfuse.train.lr_schedule import (
    ConstantSchedule,
    CosineSchedule,
    LRSchedule,
    ScheduledRates,
    StepSchedule,
    describe_schedule,
)
from commfuse.workloads import make_workload

DIGITS = "digits:hidden=32,batch=16"


def run_rank(config: TrainConfig) -> dict[str, Any]:
    return train_rank(config)


def _config(strategy: str, steps: int, schedule: LRSchedule | None, **kw: Any) -> TrainConfig:
    return TrainConfig(
        workload=workload_from_spec(DIGITS),
        strategy=strategy_from_spec(strategy),
        label=strategy,
        steps=steps,
        seed=1,
        lr_schedule=schedule,
        **kw,
    )


def _torch_rates(scheduler_of: Any, steps: int) -> list[float]:
    """The rates torch's scheduler gives steps 0..steps-1 (an optimizer with rate 1)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = scheduler_of(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def test_cosine_and_step_factors_are_torchs_schedulers_after_the_warm_up() -> None:
    steps = 11
    cosine = CosineSchedule(min_ratio=0.2)
    expected = _torch_rates(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps - 1, eta_min=0.2),
        steps,
    )
    assert [cosine.factor(s, steps) for s in range(steps)] == pytest.approx(expected, abs=1e-12)
    drops = StepSchedule(every_steps=3, gamma=0.5)
    expected = _torch_rates(
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), steps
    )
    assert [drops.factor(s, steps) for s in range(steps)] == pytest.approx(expected, abs=1e-12)


def test_the_warm_up_rises_linearly_and_the_schedule_starts_after_it() -> None:
    warm = CosineSchedule(warmup_steps=4, min_ratio=0.0)
    # 1/4, 2/4, 3/4 of the rate, then the cosine from the full rate to 0 at the last step.
    assert [warm.factor(s, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warm.factor(9, 10) == pytest.approx(0.0, abs=1e-12)
    assert warm.factor(25, 10) == warm.factor(9, 10)  # past the total: the last factor
    drops = StepSchedule(warmup_steps=2, every_steps=3, gamma=0.1)
    assert [drops.factor(s, 20) for s in range(9)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 0.1, 0.1, 0.1, 0.01]
    )
    assert [ConstantSchedule(warmup_steps=2).factor(s, 5) for s in range(4)] == [0.5, 1, 1, 1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("linear", "unknown learning-rate schedule 'linear'; known: constant, cosine, step"),
        ("step", "every_steps"),
        ("step:every_steps=0", "every_steps must be >= 1"),
        ("step:every_steps=5,gamma=1.5", r"gamma must be in \(0, 1\]"),
        ("cosine:min_ratio=2", r"min_ratio must be in \[0, 1\]"),
        ("cosine:warmup=5", "unknown key 'warmup'; known keys: min_ratio, warmup_steps"),
        ("constant:warmup_steps=-1", "warmup_steps must be >= 0"),
    ],
)
def test_bad_schedules_are_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lr_schedule_from_spec(spec)


def test_a_spec_and_its_description_are_the_same_schedule() -> None:
    for spec in ("cosine:warmup_steps=20,min_ratio=0.1", "step:every_steps=50,gamma=0.3"):
        schedule = lr_schedule_from_spec(spec)
        assert lr_schedule_from_spec(describe_schedule(schedule)) == schedule
    assert describe_schedule(StepSchedule(every_steps=5)) == (
        "step:warmup_steps=0,every_steps=5,gamma=0.1"
    )


def test_rates_refuse_an_optimizer_with_other_groups() -> None:
    params = [torch.zeros(1, requires_grad=True) for _ in range(2)]
    two_groups = torch.optim.SGD([{"params": [p]} for p in params], lr=1e-3)
    rates = ScheduledRates(ConstantSchedule(), two_groups, total_steps=5)
    with pytest.raises(ValueError, match="2 base rates, the optimizer 1 parameter groups"):
        rates.apply([{"lr": 1e-3}], 0)


def _reference(schedule: LRSchedule | None, steps: int) -> dict[str, torch.Tensor]:
    """Two ranks' DDP run, done by hand in one process: each step the mean of the two ranks'
    gradients, AdamW at the workload's rate times the schedule's factor."""
    workload = make_workload(workload_from_spec(DIGITS), device=torch.device("cpu"))
    model = workload.build_model(1)
    optimizer = workload.make_optimizer(model)
    base = optimizer.param_groups[0]["lr"]
    for step in range(steps):
        grads = []
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            workload.loss(model, workload.batch(step, rank, 2, seed=1)).backward()  # type: ignore[no-untyped-call]
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        factor = 1.0 if schedule is None else schedule.factor(step, steps)
        optimizer.param_groups[0]["lr"] = base * factor
        optimizer.step()
    return model.state_dict()


def _largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "schedule",
    [StepSchedule(every_steps=2, gamma=0.5), CosineSchedule(warmup_steps=2, min_ratio=0.0)],
)
def test_a_scheduled_ddp_run_is_the_update_by_hand_at_each_steps_rate(
    pool: Any, tmp_path: Path, schedule: LRSchedule
) -> None:
    """torch DDP on 2 real ranks, 5 steps: the parameters are those of the hand-made update at
    the scheduled rates (to the rounding of the allreduce's sums), far from the unscheduled
    update, and every step sent the whole gradient once."""
    runs = pool(2).run(
        run_rank, _config("ddp", 5, schedule, checkpoint_dir=str(tmp_path)), timeout_s=60
    )
    assert runs[0]["digest"] == runs[1]["digest"]
    trained = ckpt.load_rank(tmp_path, 5, 0, device=torch.device("cpu"))["model"]
    assert _largest_gap(trained, _reference(schedule, 5)) < 1e-6
    assert _largest_gap(trained, _reference(None, 5)) > 1e-3
    assert len(set(runs[0]["history"]["bytes"])) == 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "commfuse",
        "powersgd:rank=2,warmup=1",
        "diloco:H=2",
        "selsync:threshold=0.1",
        "adpsgd:total_steps=7,num_syncs=3",
        "onebit-adam:freeze_step=2",
        "zeroone-adam:var_freeze_step=2,var_update_scaler=2,local_step_scaler=1",
    ],
)
def test_every_strategy_steps_at_the_scheduled_rate_and_resumes_exactly(
    pool: Any, tmp_path: Path, strategy: str
) -> None:
    """A schedule of factor 1 changes nothing; one that halves the rate each step changes the
    model (the rate reaches the optimizer that takes the step: 1-bit Adam's own, not the
    workload's AdamW it replaces); a scheduled run resumed at step 3 of 7 is the run straight
    through, bit for bit, with no scheduler in the checkpoint."""
    p = pool(2)
    plain = p.run(run_rank, _config(strategy, 4, None), timeout_s=60)
    flat = p.run(run_rank, _config(strategy, 4, ConstantSchedule()), timeout_s=60)
    halving = p.run(
        run_rank, _config(strategy, 4, StepSchedule(every_steps=1, gamma=0.5)), timeout_s=60
    )
    assert [r["digest"] for r in flat] == [r["digest"] for r in plain]
    assert halving[0]["digest"] != plain[0]["digest"]
    assert halving[0]["history"]["bytes"] == plain[0]["history"]["bytes"]
    schedule = CosineSchedule(warmup_steps=2)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = p.run(
        run_rank,
        _config(strategy, 7, schedule, checkpoint_dir=str(full_dir), checkpoint_every=3),
        timeout_s=60,
    )
    shutil.copytree(ckpt.step_dir(full_dir, 3), ckpt.step_dir(resumed_dir, 3))
    ckpt.mark_latest(resumed_dir, 3)
    resumed = p.run(
        run_rank,
        _config(strategy, 7, schedule, checkpoint_dir=str(resumed_dir), resume=True),
        timeout_s=60,
    )
    assert resumed[0]["start_step"] == 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]


@pytest.mark.e2e
def test_a_resume_under_another_schedule_is_refused(pool: Any, tmp_path: Path) -> None:
    p = pool(2)
    p.run(run_rank, _config("ddp", 2, CosineSchedule(), checkpoint_dir=str(tmp_path)), timeout_s=60)
    other = dataclasses.replace(
        _config("ddp", 4, StepSchedule(every_steps=2), checkpoint_dir=str(tmp_path)), resume=True
    )
    with pytest.raises(Exception, match="lr_schedule: checkpoint 'cosine:"):
        p.run(run_rank, other, timeout_s=60)


@pytest.mark.e2e
def test_train_cli_takes_a_schedule_and_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    code = main(
        [
            "train", "--workload", DIGITS, "--nproc", "2", "--no-emulate", "--steps", "3",
            "--strategy", "ddp", "--no-progress", "--lr-schedule", "step:every_steps=1,gamma=0.5",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["lr_schedule"] == "step:warmup_steps=0,every_steps=1,gamma=0.5"
    assert math.isfinite(record["final_loss"])
    capsys.readouterr()
    assert main(["train", "--nproc", "2", "--lr-schedule", "linear"]) == 2
    assert "unknown learning-rate schedule 'linear'" in capsys.readouterr().err


@pytest.mark.e2e
def test_compare_runs_every_strategy_on_the_schedule(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    code = main(
        [
            "compare", "--workload", DIGITS, "--nproc", "2", "--hosts", "1", "--no-emulate",
            "--steps", "3",
            "--compute-steps", "1", "--no-progress", "--strategy", "ddp", "--strategy",
            "local-sgd:H=2", "--lr-schedule", "cosine:warmup_steps=1", "--json", str(out),
            "--plot", str(tmp_path / "loss.png"),
        ]
    )  # fmt: skip
    assert code == 0
    records = json.loads(out.read_text())
    assert [r["lr_schedule"] for r in records] == ["cosine:warmup_steps=1,min_ratio=0.1"] * 2
