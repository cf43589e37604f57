"""Training runs on real ranks: strategies agree with torch DDP, count their bytes, resume exactly."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.cli import main
from commfuse.cli.report import render_result
from commfuse.cli.spec import strategy_from_spec, workload_from_spec
from commfuse.train import CommfuseDPConfig, TrainConfig, describe_strategy, train_rank
from commfuse.train import checkpoint as ckpt
from commfuse.train.metrics import summarize

DIGITS = "digits:hidden=32,batch=16"
#: digits:hidden=32 has (64*32+32) + (32*32+32) + (32*10+10) fp32 parameters.
DIGITS_GRAD_BYTES = 4 * ((64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10))


def run_rank(config: TrainConfig) -> dict[str, Any]:
    return train_rank(config)


def _config(strategy: str, steps: int, **kw: Any) -> TrainConfig:
    return TrainConfig(
        workload=workload_from_spec(DIGITS),
        strategy=strategy_from_spec(strategy),
        label=strategy,
        steps=steps,
        seed=1,
        **kw,
    )


@pytest.mark.e2e
def test_commfuse_matches_torch_ddp_and_bytes_are_counted(pool: Any) -> None:
    """Same data and seeds: commfuse's engine gives torch DDP's parameters (2 ranks: a sum of
    two is order-free, so bitwise); bytes per step are each strategy's message."""
    p = pool(2)
    ddp = p.run(run_rank, _config("ddp", 5, compute_steps=2), timeout_s=60)
    ours = p.run(run_rank, _config("commfuse", 5), timeout_s=60)
    fp16 = p.run(run_rank, _config("ddp-fp16", 5), timeout_s=60)
    copies = p.run(run_rank, _config("ddp:bucket_view=0", 5), timeout_s=60)
    assert ddp[0]["digest"] == ddp[1]["digest"] == ours[0]["digest"] == ours[1]["digest"]
    # gradient_as_bucket_view (the default) changes where gradients live, not their values.
    assert copies[0]["digest"] == ddp[0]["digest"]
    assert fp16[0]["digest"] != ddp[0]["digest"]  # fp16 rounding changes the update
    # torch DDP: every bucket (all gradients) once per step; its fp16 hook: half of that.
    assert ddp[0]["history"]["bytes"] == [DIGITS_GRAD_BYTES] * 5
    assert fp16[0]["history"]["bytes"] == [DIGITS_GRAD_BYTES / 2] * 5
    # commfuse (native allreduce payload at this size): at least the gradients, per step.
    assert all(b >= DIGITS_GRAD_BYTES for b in ours[0]["history"]["bytes"])
    assert len(ddp[0]["compute_step_time_s"]) == 2 and "eval" in ddp[0] and "eval" not in ddp[1]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "topk:ratio=0.05",
        "ddp-fp16",
        "powersgd:rank=2,warmup=1",
        "powersgd:rank=2,warmup=1,staleness=1",
        "powersgd:rank=2,warmup=4,warmup_rank=4,wire=bf16",
        # Every other compressor that keeps state or draws random numbers.
        "dgc:ratio=0.1,warmup=1",
        "ef-sign",
        "qsgd",
        "terngrad",
        "randomk:ratio=0.25",
        "randblock:ratio=0.25",
        "int8",
        "acpsgd:rank=2,warmup=1",
        # torch's own hook: its state keyed by bucket, its buckets rebuilt after a first step.
        "ddp-powersgd:rank=2,warmup=2",
        "ddp-powersgd:rank=2,warmup=2,wire=fp16",
    ],
)
def test_resume_from_checkpoint_is_exact(pool: Any, tmp_path: Path, strategy: str) -> None:
    """Checkpoint at step 3 of 7, resume to 7: the same parameters, bit for bit, as 7 straight
    (topk carries error-feedback residuals in its checkpointed state; PowerSGD its Q and
    residuals, with staleness=1 also a gradient still in flight, and in the last case a
    rank-4 warm-up that is still running at the checkpoint). Every file is loaded weights-only,
    so this also holds each strategy's state to tensors and plain data."""
    p = pool(2)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = p.run(
        run_rank,
        _config(strategy, 7, checkpoint_dir=str(full_dir), checkpoint_every=3),
        timeout_s=60,
    )
    assert ckpt.latest_step(full_dir) == 7
    # A run interrupted after step 3 would have left exactly this behind.
    shutil.copytree(ckpt.step_dir(full_dir, 3), ckpt.step_dir(resumed_dir, 3))
    ckpt.mark_latest(resumed_dir, 3)
    resumed = p.run(
        run_rank, _config(strategy, 7, checkpoint_dir=str(resumed_dir), resume=True), timeout_s=60
    )
    assert resumed[0]["start_step"] == 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert resumed[0]["history"]["loss"] == full[0]["history"]["loss"]
    if strategy.startswith("topk"):
        state = ckpt.load_rank(full_dir, 3, 1, device=torch.device("cpu"))["strategy"]["engine"][
            "compressor"
        ]
        assert state, "error-feedback state must be in the checkpoint"


@pytest.mark.e2e
def test_extra_steps_extend_only_the_curves(pool: Any) -> None:
    """compare --max-steps-factor: 3 extra steps past 4 change nothing that is read at step 4
    (parameters' digest, evaluation, bytes, final loss); only the curves go on."""

    p = pool(2)
    plain = p.run(run_rank, _config("topk:ratio=0.05", 4), timeout_s=60)
    longer = p.run(run_rank, _config("topk:ratio=0.05", 4, extra_steps=3), timeout_s=60)
    assert [r["digest"] for r in longer] == [r["digest"] for r in plain]
    assert longer[0]["eval"] == plain[0]["eval"]
    assert longer[0]["history"]["loss"][:4] == plain[0]["history"]["loss"]
    assert len(longer[0]["history"]["loss"]) == 7 and longer[0]["extra_steps"] == 3
    short = summarize(plain, strategy="topk", workload=DIGITS, warmup=1)
    long_ = summarize(longer, strategy="topk", workload=DIGITS, warmup=1)
    for key in ("steps", "final_loss", "bytes_total", "bytes_per_step", "eval_loss"):
        assert long_[key] == short[key], key
    assert len(long_["loss_curve"]) == len(long_["wall_curve_s"]) == 7
    assert long_["loss_curve"][:4] == short["loss_curve"]


@pytest.mark.e2e
def test_init_from_continues_another_strategys_model(pool: Any, tmp_path: Path) -> None:
    """--init-from: a DDP run's step-3 model and optimizer, continued by another strategy to 6,
    equals that strategy resumed from the same state; a total not past the checkpoint is refused."""
    p = pool(2)
    p.run(run_rank, _config("ddp", 3, checkpoint_dir=str(tmp_path)), timeout_s=60)
    ddp_rest = p.run(run_rank, _config("ddp", 6, init_from=str(tmp_path)), timeout_s=60)
    straight = p.run(run_rank, _config("ddp", 6), timeout_s=60)
    # The optimizer state came along, so DDP continued is DDP straight through.
    assert [r["digest"] for r in ddp_rest] == [r["digest"] for r in straight]
    assert ddp_rest[0]["start_step"] == 3 and len(ddp_rest[0]["history"]["loss"]) == 3
    local = p.run(run_rank, _config("local-sgd:H=3", 6, init_from=str(tmp_path)), timeout_s=60)
    # Its period counts from the start of this run: 3 local steps, then the average.
    assert local[0]["digest"] == local[1]["digest"]
    assert local[0]["digest"] != ddp_rest[0]["digest"]
    assert local[0]["history"]["loss"][0] == ddp_rest[0]["history"]["loss"][0]
    with pytest.raises(Exception, match="must be larger"):
        p.run(run_rank, _config("ddp", 3, init_from=str(tmp_path)), timeout_s=60)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        _config("ddp", 6, init_from=str(tmp_path / "nothing"))


@pytest.mark.e2e
def test_torchs_powersgd_hook_checkpoints_plain_data_and_resumes_without_a_warning(
    pool: Any, tmp_path: Path
) -> None:
    """torch's hook state is saved as plain data (its numpy RNG as tensors) with the order DDP
    rebuilt its buckets in (a permutation of the parameters: the digits MLP has 6), and
    ``--resume`` of ddp-powersgd, exact (``test_resume_from_checkpoint_is_exact``), warns of
    nothing."""
    spec = "ddp-powersgd:rank=2,warmup=2,wire=fp16"
    p = pool(2)
    p.run(run_rank, _config(spec, 4, checkpoint_dir=str(tmp_path), checkpoint_every=3))
    saved = ckpt.load_rank(tmp_path, 3, 0, device=torch.device("cpu"))["strategy"]
    hook = saved["powersgd"]
    assert hook["iter"] == 3 and hook["error_dict"] and hook["q_memory_dict"]
    assert hook["rng"]["keys"].dtype == torch.int64
    assert sorted(saved["bucket_order"]) == list(range(6))
    assert saved["bucket_order"] != sorted(saved["bucket_order"])  # not the model's order
    ckpt.mark_latest(tmp_path, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config(spec, 5, checkpoint_dir=str(tmp_path), resume=True)


@pytest.mark.e2e
def test_resume_refuses_a_different_run(pool: Any, tmp_path: Path) -> None:
    p = pool(2)
    p.run(run_rank, _config("ddp", 2, checkpoint_dir=str(tmp_path)), timeout_s=60)
    with pytest.raises(
        Exception, match=r"a different run.*strategy: checkpoint 'ddp', now 'commfuse'"
    ):
        p.run(
            run_rank,
            _config("commfuse", 4, checkpoint_dir=str(tmp_path), resume=True),
            timeout_s=60,
        )
    # A launcher refuses it before it starts any rank: a ValueError, not a rank's failure.
    from commfuse.cluster import Topology
    from commfuse.train.runner import run_training

    with pytest.raises(ValueError, match=r"a different run.*world_size: checkpoint 2, now 3"):
        run_training(
            _config("ddp", 4, checkpoint_dir=str(tmp_path), resume=True),
            Topology(num_hosts=1, ranks_per_host=3),
            emulate=False,
            progress=False,
        )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ddpp", "unknown strategy 'ddpp'; known: ddp, ddp-fp16, ddp-bf16, ddp-powersgd, commfuse"),
        (
            "ddp-powersgd:rnak=4",
            "unknown key.*rnak.*known keys: batch_same_shape, bucket_view, epsilon, error_feedback",
        ),
        ("ddp-powersgd:wire=fp8", r"wire='fp8' is not one of the choices \(accepted: fp32, fp16"),
        ("ddp-powersgd:warmup=1", "warmup must be at least 2 with error feedback or warm start"),
        ("ddp-powersgd:rank=0", "rank must be at least 1"),
        ("ddp-powersgd:rank=four", "rank='four' is not a valid int"),
        ("commfuse:merge_buckets_by_cost=maybe", "is not a boolean"),
        ("topk:ratioo=0.1", "unknown key 'ratioo'"),
        ("powersgd:algo=nope", "algo='nope' is not an all_reduce algorithm"),
        ("topk:gather_algo=doubling,algo=ringg", "algo='ringg' is not an all_reduce"),
        ("", "empty strategy"),
    ],
)
def test_bad_strategy_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strategy_from_spec(spec)


def test_known_strategy_labels() -> None:
    assert strategy_from_spec(" ddp-powersgd:rank=4") == strategy_from_spec("ddp-powersgd:rank=4")
    assert describe_strategy(strategy_from_spec("ddp-powersgd:rank=4")) == "ddp-powersgd"
    assert describe_strategy(strategy_from_spec("ddp-powersgd:rank=8")) == "ddp-powersgd:rank=8"
    assert describe_strategy(strategy_from_spec("powersgd:rank=4")) == "powersgd:rank=4"
    config = strategy_from_spec("topk:ratio=0.1,gather_algo=ring,staleness=1")
    assert isinstance(config, CommfuseDPConfig)
    compressor = config.compressor
    assert compressor is not None
    assert (compressor.gather_algo, compressor.algo, config.staleness) == ("ring", "auto", 1)


@pytest.mark.e2e
def test_train_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.json"
    argv = ["train", "--workload", DIGITS, "--nproc", "2", "--steps", "6", "--no-progress"]
    assert main([*argv, "--strategy", "ddp-powersgd:rank=2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["steps"] == 6 and record["world_size"] == 2 and record["ranks_agree"]
    assert (record["device"], record["backend"]) == ("cpu", "gloo")
    assert 0 < record["bytes_per_step"] < DIGITS_GRAD_BYTES  # PowerSGD after its 2-step warm-up
    assert record["eval_accuracy"] > 0.2 and record["final_loss"] < 2.3
    assert main([*argv, "--strategy", "nope"]) == 2
    assert "unknown strategy 'nope'" in capsys.readouterr().err
    # train's default is one rank, which communicates nothing: it says so.
    one = ["train", "--workload", DIGITS, "--steps", "2", "--no-progress", "--no-emulate"]
    assert main([*one, "--strategy", "powersgd:rank=2"]) == 0
    assert "one rank: nothing to communicate" in capsys.readouterr().out


@pytest.mark.e2e
def test_train_cli_on_an_explicit_device_checkpoints_and_resumes_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device cpu --backend gloo, spelled out, takes the path --device cuda --backend nccl
    takes (the backend decides Communicator.device, the loop builds the workload there and
    loads its checkpoints onto it): a run to step 3, resumed to 6, ends as 6 straight. Each
    run says where it starts; a start past the run's total is refused before any rank runs."""
    argv = ["train", "--workload", DIGITS, "--nproc", "2", "--no-progress", "--strategy", "ddp"]
    argv += ["--device", "cpu", "--backend", "gloo", "--no-emulate", "--seed", "1"]
    straight, resumed, ckpts = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ckpt"
    assert main([*argv, "--steps", "6", "--json", str(straight)]) == 0
    # --resume where no checkpoint is yet (a job requeued before its first one) starts over,
    # and says so: a mistyped directory does not restart a run unnoticed.
    assert main([*argv, "--steps", "3", "--checkpoint-dir", str(ckpts), "--resume"]) == 0
    assert f"no checkpoint in {ckpts} yet: starting at step 0" in capsys.readouterr().out
    more = ["--steps", "6", "--checkpoint-dir", str(ckpts), "--resume", "--json", str(resumed)]
    assert main([*argv, *more]) == 0
    assert f"resuming at step 3 from {ckpts}" in capsys.readouterr().out
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    assert b["start_step"] == 3 and b["device"] == a["device"] == "cpu"
    assert b["digest"] == a["digest"] and b["loss_curve"] == a["loss_curve"]
    # The checkpoint is at step 6 now: a shorter run is refused, one line, exit 2, no rank.
    assert main([*argv, "--steps", "4", "--checkpoint-dir", str(ckpts), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "at step 6, past --steps 4 (the total)" in err and "Traceback" not in err
    assert main([*argv, "--steps", "6", "--init-from", str(ckpts)]) == 2
    assert f"--init-from {ckpts} is at step 6" in capsys.readouterr().err
    assert main([*argv, "--steps", "8", "--init-from", str(ckpts)]) == 0
    assert f"starting at step 6 from the model and optimizer in {ckpts}" in capsys.readouterr().out


@pytest.mark.e2e
def test_compare_cli_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    argv = ["compare", "--workload", DIGITS, "--nproc", "2", "--hosts", "1", "--no-emulate"]
    argv += ["--steps", "8", "--no-progress", "--strategy", "ddp", "--strategy", "sign"]
    assert main([*argv, "--json", str(js), "--plot", str(png)]) == 0
    records = json.loads(js.read_text())
    keys = {
        "strategy", "steps", "step_time_s", "compute_step_time_s", "bytes_per_step",
        "final_loss", "wall_s", "time_to_baseline_loss_s", "speedup_vs_ddp", "eval_loss",
        "final_sync_bytes",
    }  # fmt: skip
    assert [r["strategy"] for r in records] == ["ddp", "sign"]
    assert all(keys <= set(r) and r["steps"] == 8 for r in records)
    assert records[0]["speedup_vs_ddp"] == 1.0 and records[0]["time_to_baseline_loss_s"] is not None
    assert records[1]["bytes_reduction_vs_baseline"] > 4  # 1 bit per gradient, on an allgather
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "speedup" in out and "held_loss" in out
    assert all(r["eval_loss"] > 0 and r["final_sync_bytes"] == 0 for r in records)
    # Steps of a few ms fall between the machine's 10 ms ticks: known, but not meaningful here.
    assert all(r["machine_busy"] is not None and r["machine_busy"] >= 0 for r in records)
    assert "busy" in out
    # The machine's bound is read from the run itself (rank 0 reads the machine): never below
    # the compute-only step; a step of a strategy that exchanges every step is its period.
    assert all(r["machine_bound_s"] >= r["compute_step_time_s"] > 0 for r in records)
    # The compute-only steps' CPU share is measured (its arithmetic is checked on fixed
    # numbers below; its value here depends on what else the machine ran meanwhile).
    assert all(math.isfinite(r["compute_machine_busy"]) for r in records)
    assert all(r["worst_phase_over_bound"] > 0 for r in records) and "worst/bound" in out


def test_cpu_bound_note_names_the_strategies_that_kept_the_cores_busy() -> None:
    from commfuse.bench.compare import cpu_bound_note

    records: list[dict[str, Any]] = [
        {"strategy": "ddp", "machine_busy": 0.23},
        {"strategy": "powersgd:rank=8", "machine_busy": 0.94},
        {"strategy": "old", "machine_busy": None},
    ]
    note = cpu_bound_note(records)
    assert note is not None and "powersgd:rank=8 (94%)" in note and "ddp" not in note
    assert cpu_bound_note(records[::2]) is None


def test_machine_busy_is_the_busy_share_of_the_cores_over_the_timed_steps() -> None:
    history = {
        "loss": [2.0, 1.5, 1.0, 0.5],
        "step_time_s": [0.5, 0.3, 0.2, 0.4],
        "bytes": [0.0] * 4,
        "skipped": [0.0] * 4,
        # step 1 is warm-up; step 4's busy time is unknown (-1) and left out
        "busy_cpu_s": [0.9, 0.6, 0.4, -1.0],
    }
    ranks = [{"history": history, "digest": "d", "cores": 2}]
    record = summarize(ranks, strategy="ddp", workload=DIGITS, warmup=1)
    # (0.6 + 0.4) s of busy CPU on 2 cores over 0.3 + 0.2 s of steps: the machine was full.
    assert record["cpu_floor_s"] == pytest.approx(0.25)
    assert record["machine_busy"] == pytest.approx(1.0)
    older = {k: v for k, v in history.items() if k != "busy_cpu_s"}  # a pre-recording checkpoint
    record = summarize([{"history": older, "digest": "d"}], strategy="x", workload=DIGITS, warmup=1)
    assert record["cpu_floor_s"] is None and record["machine_busy"] is None


def test_the_machine_bound_adds_the_exchanges_cpu_over_the_cores_left_to_the_compute_step() -> None:
    history = {
        "loss": [2.0, 1.5, 1.0, 0.5],
        "step_time_s": [0.5, 0.4, 0.4, 0.6],
        "bytes": [0.0] * 4,
        "skipped": [0.0] * 4,
        # step 1 is warm-up; the machine's busy core time of each step (all programs)
        "machine_busy_s": [5.0, 0.9, 0.8, 1.0],
    }
    rank = {
        "history": history,
        "digest": "d",
        "cores": 2,
        "compute_step_time_s": [0.3, 0.35, 0.4, 0.35],
        # other programs took 0.1 cores over the run, and 0.05 s per compute-only step
        "others_over_run": {"wall_s": 10.0, "busy_s": 9.0, "others_s": 1.0},
        "compute_machine": {"wall_s": 1.4, "busy_s": 2.6, "others_s": 0.2},
    }
    record = summarize([rank], strategy="x", workload=DIGITS, warmup=1)
    # The ranks and kernel: 0.9 - 0.04, 0.8 - 0.04, 1.0 - 0.06 per step (0.8533), against
    # (2.6 - 0.2) / 4 = 0.6 per compute-only step; spread over the 1.9 cores left.
    assert record["exchange_cpu_s"] == pytest.approx(0.8533333 - 0.6)
    assert record["compute_machine_busy"] == pytest.approx(0.6 / (2 * 0.35))
    assert record["machine_bound_s"] == pytest.approx(0.35 + 0.2533333 / 1.9)
    for missing in ("others_over_run", "compute_machine", "compute_step_time_s"):
        older = {k: v for k, v in rank.items() if k != missing}
        record = summarize([older], strategy="x", workload=DIGITS, warmup=1)
        assert record["machine_bound_s"] is None and record["exchange_cpu_s"] is None
    # An exchange that costs less than nothing (tick noise) leaves the compute-only step.
    cheap = {**rank, "compute_machine": {"wall_s": 1.4, "busy_s": 4.0, "others_s": 0.2}}
    record = summarize([cheap], strategy="x", workload=DIGITS, warmup=1)
    assert record["exchange_cpu_s"] < 0 and record["machine_bound_s"] == pytest.approx(0.35)


def test_worst_over_bound_is_a_column_only_where_a_record_has_it() -> None:
    from commfuse.bench.compare import add_comparisons, render_table

    base = {
        "strategy": "local-sgd:H=2", "final_loss": 2.0, "loss_curve": [2.0],
        "wall_curve_s": [1.0], "step_time_s": 0.5, "compute_step_time_s": 0.4,
        "bytes_per_step": 10.0, "mean_step_time_s": 0.5, "worst_phase_step_s": 1.2,
        "peak_bytes_per_step": 20.0, "eval_loss": 2.0, "eval_accuracy": 0.5, "wall_s": 1.0,
    }  # fmt: skip
    older = dict(base)
    add_comparisons([older])
    assert older["worst_phase_over_bound"] is None
    assert "worst/bound" not in render_table([older], markdown=True)
    bounded = {**base, "machine_bound_s": 0.48}
    add_comparisons([bounded])
    assert bounded["worst_phase_over_bound"] == pytest.approx(2.5)
    table = render_table([bounded], markdown=True)
    assert "| worst/compute | worst/bound |" in table and "|        2.50 |" in table


def test_the_worst_phase_is_the_slowest_position_of_the_period_by_its_median() -> None:
    from commfuse.train.metrics import worst_phase_step_s

    # Period 3 from step 1 on: position 0 (steps 3, 6, 9) holds the syncs; position 1 one
    # noisy step of three, which its median ignores (its mean, 0.73, and the max would not).
    times = [0.1, 0.1, 0.5, 0.1, 0.1, 0.5, 2.0, 0.1, 0.5]
    assert worst_phase_step_s(times, 3, offset=1) == pytest.approx(0.5)
    assert worst_phase_step_s(times, 1) == pytest.approx(0.1)  # one position: the median
    assert worst_phase_step_s(times, None) is None and worst_phase_step_s([], 2) is None
    history = {"loss": [1.0] * 10, "step_time_s": [5.0, *times], "bytes": [0.0] * 10}
    history["skipped"] = [0.0] * 10
    ranks = [{"history": history, "digest": "d", "strategy_metrics": {"period_steps": 3}}]
    record = summarize(ranks, strategy="local-sgd:H=3", workload=DIGITS, warmup=1)
    assert record["period_steps"] == 3 and record["worst_phase_step_s"] == pytest.approx(0.5)
    assert record["phase_step_s"] == pytest.approx([0.5, 0.1, 0.1])
    ranks[0]["strategy_metrics"] = {"period_steps": None}  # SelSync, ADPSGD: no clock
    assert summarize(ranks, strategy="x", workload=DIGITS, warmup=1)["worst_phase_step_s"] is None


def test_a_position_and_the_compute_only_step_are_the_ranks_mean() -> None:
    # Two ranks on shared cores: at position 1 rank 0 got less of the cores and rank 1 more,
    # by as much; the steps cost the machine the same at both positions (0.3 s).
    def rank(times: list[float], compute: list[float]) -> dict[str, Any]:
        history = {"loss": [1.0] * 7, "step_time_s": [5.0, *times], "bytes": [0.0] * 7}
        history["skipped"] = [0.0] * 7
        metrics = {"period_steps": 2}
        return {"history": history, "digest": "d", "strategy_metrics": metrics,
                "compute_step_time_s": compute}  # fmt: skip

    ranks = [
        rank([0.4, 0.3, 0.4, 0.3, 0.4, 0.3], [0.2, 0.4, 0.2]),
        rank([0.2, 0.3, 0.2, 0.3, 0.2, 0.3], [0.4, 0.2, 0.4]),
    ]
    record = summarize(ranks, strategy="dreamddp:H=2", workload=DIGITS, warmup=1)
    assert record["phase_step_s"] == pytest.approx([0.3, 0.3])  # rank 0 alone: 0.3 and 0.4
    assert record["worst_phase_step_s"] == pytest.approx(0.3)
    assert record["compute_step_time_s"] == pytest.approx(0.3)  # rank 0 alone: 0.2
    assert record["step_time_s"] == pytest.approx(0.35)  # rank 0's median, as before
    # Ranks whose histories differ in length: rank 0's alone.
    ranks[1]["history"]["step_time_s"] = ranks[1]["history"]["step_time_s"][:-1]
    record = summarize(ranks, strategy="dreamddp:H=2", workload=DIGITS, warmup=1)
    assert record["worst_phase_step_s"] == pytest.approx(0.4)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "strategy",
    [
        "local-sgd:H=2",
        "post-local-sgd:H=2,warmup_steps=2",
        "slowmo:H=2",
        "diloco:H=3",
        "streaming-diloco:H=4,num_fragments=2,overlap_steps=1",
        # The outer-gradient compressors, their residuals checkpointed.
        "diloco:H=2,compressor=sparseloco",
        "local-sgd:H=2,compressor=demo",
        "streaming-diloco:H=4,num_fragments=2,overlap_steps=1,compressor=int4",
    ],
)
def test_local_sgd_family_trains_and_resumes_exactly(
    pool: Any, tmp_path: Path, strategy: str
) -> None:
    """Each local-SGD strategy through the training loop: fewer bytes than DDP, drift recorded
    at each synchronisation, and a resume in the middle of a period is bit-exact."""
    p = pool(2)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = p.run(
        run_rank,
        _config(strategy, 7, checkpoint_dir=str(full_dir), checkpoint_every=3),
        timeout_s=60,
    )
    assert full[0]["history"]["loss"][-1] < full[0]["history"]["loss"][0]
    sent = sum(full[0]["history"]["bytes"])
    assert 0 < sent < 7 * DIGITS_GRAD_BYTES  # communicates less often than every step
    metrics = full[0]["strategy_metrics"]
    assert metrics["syncs"] >= 1 and all(d > 0 for d in metrics["drift"])
    assert metrics["period_steps"] == int(strategy.split("H=")[1].split(",")[0])
    # 7 steps end mid-period for every one of them: the final synchronisation sent something
    # and left one model on both ranks.
    assert metrics["final_sync_bytes"] > 0
    assert full[0]["digest"] == full[1]["digest"]
    if strategy == "local-sgd:H=2":
        # Exchanges after steps 2, 4, 6, then the final one: the whole model each time.
        assert metrics["final_sync_bytes"] == full[0]["history"]["bytes"][1]
        summary = summarize(full, strategy=strategy, workload=DIGITS, warmup=1)
        assert summary["final_sync_bytes"] == metrics["final_sync_bytes"]
        assert summary["peak_bytes_per_step"] == full[0]["history"]["bytes"][1]
        assert summary["bytes_total"] == 4 * full[0]["history"]["bytes"][1]
    shutil.copytree(ckpt.step_dir(full_dir, 3), ckpt.step_dir(resumed_dir, 3))
    ckpt.mark_latest(resumed_dir, 3)
    resumed = p.run(
        run_rank, _config(strategy, 7, checkpoint_dir=str(resumed_dir), resume=True), timeout_s=60
    )
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]


@pytest.mark.e2e
def test_bench_strategies_interleaves_and_counts_each_strategys_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Several torch-DDP strategies in one process: each counts only its own steps' bytes
    (torch DDP: every gradient; its fp16 hook: half; PowerSGD after warm-up: fewer)."""
    js = tmp_path / "s.json"
    argv = ["bench", "strategies", "--workload", DIGITS, "--hosts", "2", "--no-emulate"]
    argv += ["--steps", "2", "--repeats", "2", "--warmup-steps", "2", "--json", str(js)]
    md, png = tmp_path / "s.md", tmp_path / "s.png"
    argv += ["--markdown", str(md), "--plot", str(png)]
    for spec in ("ddp", "ddp-fp16", "ddp-powersgd:rank=2,warmup=2", "powersgd:rank=2,warmup=2"):
        argv += ["--strategy", spec]
    assert main(argv) == 0
    records = {r["strategy"]: r for r in json.loads(js.read_text())}
    assert list(records)[-1] == "compute" and len(records) == 5
    assert records["ddp"]["ratio_to_first"] == 1.0
    assert records["ddp"]["bytes_per_step"] == DIGITS_GRAD_BYTES
    assert records["ddp-fp16"]["bytes_per_step"] == DIGITS_GRAD_BYTES / 2
    hook, ours = records["ddp-powersgd:rank=2,warmup=2"], records["powersgd:rank=2,warmup=2"]
    assert 0 < hook["bytes_per_step"] < DIGITS_GRAD_BYTES / 4
    assert 0 < ours["bytes_per_step"] < DIGITS_GRAD_BYTES / 4
    assert (
        records["compute"]["bytes_per_step"] == 0 and records["compute"]["step_over_compute"] == 1
    )
    assert all(
        r["step_s"] > 0 and r["forward_s"] > 0 and r["cpu_s_per_step"] > 0 for r in records.values()
    )
    # Blocks this short can fall between two 10 ms clock ticks: a floor, but maybe of 0.
    assert all(r["cpu_floor_s"] is not None and r["cpu_floor_s"] >= 0 for r in records.values())
    printed = capsys.readouterr().out
    assert "time/first" in printed
    # The Markdown report's table is `commfuse report`'s, as the printed one; the plot is drawn.
    assert render_result(list(records.values()), markdown=True) in md.read_text()
    assert png.stat().st_size > 1000
    assert main(["bench", "strategies", "--strategy", "ddp", "--strategy", "ddp"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_compare_time_to_loss_is_the_median_over_rounds() -> None:
    """--repeats: each round's time to the baseline's loss from its own curves; the median is
    the headline, a round that never got there counts as the slowest."""
    from commfuse.bench.compare import add_comparisons

    def record(
        name: str, final: float, rounds: list[tuple[list[float], list[float]]]
    ) -> dict[str, Any]:
        loss, wall = rounds[0]
        return {
            "strategy": name, "strategy_name": name, "final_loss": final, "loss_curve": loss,
            "wall_curve_s": wall, "step_time_s": 1.0, "compute_step_time_s": 0.5,
            "bytes_per_step": 10.0, "mean_step_time_s": 1.0, "curves_rounds": rounds,
        }  # fmt: skip

    ddp = record("ddp", 2.0, [([3.0, 2.0], [1.0, 2.0]), ([3.0, 2.0], [1.5, 3.0])])
    ours = record(
        "powersgd",
        2.1,
        [([2.5, 1.9], [0.5, 1.0]), ([2.5, 2.05], [0.6, 1.2]), ([1.99, 2.5], [0.7, 1.4])],
    )
    add_comparisons([ddp, ours])
    assert ddp["time_to_baseline_loss_s_rounds"] == [2.0, 3.0]
    assert ddp["time_to_baseline_loss_s"] == 2.5
    assert ours["time_to_baseline_loss_s_rounds"] == [1.0, None, 0.7]
    assert ours["time_to_baseline_loss_s"] == 1.0
    assert ours["time_to_loss_speedup_vs_ddp"] == 2.5
    assert "curves_rounds" not in ours


@pytest.mark.e2e
def test_compare_rounds_are_balanced_and_the_control_runs_the_baseline_again() -> None:
    """--repeats 2 --control: round 1 in the given order, round 2 reversed; the baseline's
    second run is a strategy of its own whose speedup is the noise floor."""
    from commfuse.bench.compare import compare_strategies
    from commfuse.cluster import Topology

    log: list[str] = []
    base = TrainConfig(workload=workload_from_spec(DIGITS), steps=4, compute_steps=1)
    specs = ["ddp"]
    records = compare_strategies(
        [strategy_from_spec(spec) for spec in specs],
        base,
        Topology(num_hosts=1, ranks_per_host=2),
        repeats=2,
        control=True,
        emulate=False,
        progress=False,
        log=log.append,
        labels=specs,
    )
    assert [line.split()[1] for line in log] == ["ddp", "ddp'", "ddp'", "ddp"]
    assert [r["strategy"] for r in records] == ["ddp", "ddp'"]
    ddp, twin = records
    assert twin["control_of"] == "ddp" and ddp["speedup_vs_ddp"] == 1.0
    assert twin["control_ratio"] == pytest.approx(1 / twin["speedup_vs_ddp"])
    assert ddp["control_ratio"] == twin["control_ratio"]
    assert twin["tie"] is True and ddp["tie"] is None
    assert len(twin["mean_step_time_s_rounds"]) == 2


@pytest.mark.e2e
@pytest.mark.parametrize(
    "strategy",
    [
        "onebit-adam:freeze_step=2",
        "zeroone-adam:var_freeze_step=2,var_update_scaler=2,local_step_scaler=1",
    ],
)
def test_compressed_adam_trains_counts_its_bytes_and_resumes_exactly(
    pool: Any, tmp_path: Path, strategy: str
) -> None:
    """1-bit Adam and 0/1 Adam through the training loop: the warm-up's steps hand the whole
    gradient to the allreduce, the compressed ones the 1-bit allreduce's messages (0/1 Adam:
    nothing on a skipped round, and a synchronisation of the last local steps at the end), one
    model on both ranks, and a checkpoint in the compressed phase (0/1 Adam: inside a local
    interval) resumes bit for bit."""
    from commfuse.optim import handed_bytes_per_rank

    p = pool(2)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = p.run(
        run_rank,
        _config(strategy, 7, checkpoint_dir=str(full_dir), checkpoint_every=4),
        timeout_s=60,
    )
    assert full[0]["digest"] == full[1]["digest"]
    numel = DIGITS_GRAD_BYTES // 4
    one = handed_bytes_per_rank(numel, 2)
    sent = full[0]["history"]["bytes"]
    if strategy.startswith("onebit"):
        assert sent == [DIGITS_GRAD_BYTES] * 2 + [one] * 5
    else:  # variance at steps 1, 2; syncs at 3, 5 (intervals 1, 2), then the final one
        assert sent == [DIGITS_GRAD_BYTES] * 2 + [one, 0, one, 0, one]
    assert full[0]["strategy_metrics"]["variance_updates"] == 2
    shutil.copytree(ckpt.step_dir(full_dir, 4), ckpt.step_dir(resumed_dir, 4))
    ckpt.mark_latest(resumed_dir, 4)
    resumed = p.run(
        run_rank, _config(strategy, 7, checkpoint_dir=str(resumed_dir), resume=True), timeout_s=60
    )
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert resumed[0]["history"]["loss"] == full[0]["history"]["loss"]
