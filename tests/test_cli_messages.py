"""What the command and the library tell a user who got something wrong, in process (no ranks).

* a script that builds a ``Communicator`` without ``init_process_group`` is told what to call
  (``commfuse launch`` does not call it);
* ``--resume`` and ``--init-from`` errors name the flags, not ``TrainConfig``'s fields;
* a ``--json`` path that cannot be written at the end of a run (its directory went away, the
  path became a directory; a read-only mount as root looks the same) keeps the record: it is
  written elsewhere, stderr says where, and the command exits 1.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from commfuse.cli import main
from commfuse.comm import Communicator
from commfuse.train import checkpoint as ckpt

TRAIN = ["train", "--workload", "digits", "--nproc", "1"]
COMPARE = ["compare", "--workload", "digits", "--nproc", "1", "--hosts", "1"]


def test_a_communicator_without_a_process_group_says_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as info:
        Communicator()
    message = str(info.value)
    assert 'init_process_group("gloo")' in message, message
    assert "launch does it" not in message and "set only the variables" in message, message


def _checkpoint(root: Path, step: int, identity: dict[str, Any]) -> Path:
    """A checkpoint of ``step`` whose rank 0 file holds only the run's ``identity``."""
    ckpt.save_rank(root, step, 0, {"identity": identity})
    ckpt.mark_latest(root, step)
    return root


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a command refused ``argv`` with (exit 2, no traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_resume_and_init_from_errors_name_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = str(_checkpoint(tmp_path / "done", 3, {"seed": 0}))
    (tmp_path / "empty").mkdir()
    refused = {
        "resume alone": _refusal([*TRAIN, "--resume"], capsys),
        "no checkpoint": _refusal([*TRAIN, "--init-from", str(tmp_path / "empty")], capsys),
        "init past": _refusal([*TRAIN, "--steps", "3", "--init-from", done], capsys),
        "ft init past": _refusal(
            [*TRAIN, "--steps", "2", "--init-from", done, "--fault-tolerant"], capsys
        ),
        "compare init past": _refusal(
            [*COMPARE, "--steps", "2", "--strategy", "ddp", "--init-from", done],
            capsys,
        ),
        "resume past": _refusal(
            [*TRAIN, "--steps", "2", "--checkpoint-dir", done, "--resume"], capsys
        ),
        "another run": _refusal(
            [*TRAIN, "--steps", "5", "--checkpoint-dir", done, "--resume", "--seed", "3"], capsys
        ),
    }
    assert refused["resume alone"].endswith("--resume needs --checkpoint-dir (the run to continue)")
    assert refused["no checkpoint"].endswith(f"--init-from {tmp_path / 'empty'}: no complete checkpoint there")  # fmt: skip
    for key in ("init past", "ft init past", "compare init past"):
        assert (
            f"--init-from {done} is at step 3: --steps (the total) must be larger" in refused[key]
        )
    assert f"--checkpoint-dir {done} is at step 3, past --steps 2" in refused["resume past"]
    assert "give --steps 3 or more" in refused["resume past"]
    assert "--seed: 0 there, 3 now" in refused["another run"]
    assert "--bucket-cap-mb: None there" in refused["another run"]
    for line in (line.replace(str(tmp_path), "DIR") for line in refused.values()):
        # No TrainConfig field names: init_from, checkpoint_dir, "resume:", bare "steps".
        assert "init_from" not in line and "checkpoint_dir" not in line, line
        assert " resume" not in line and " steps" not in line.replace("--steps", ""), line


RECORD = {
    "strategy": "ddp",
    "steps": 2,
    "wall_s": 1.0,
    "step_time_s": 0.01,
    "compute_step_time_s": None,
    "bytes_per_step": 0,
    "final_loss": 2.0,
    "eval_loss": 2.0,
    "eval_accuracy": 0.5,
    "ranks_agree": True,
}


@pytest.mark.parametrize("turn", ["its directory goes away", "it becomes a directory"])
def test_a_record_that_cannot_be_written_at_the_end_goes_elsewhere(
    turn: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    path = out / "metrics.json"
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback))

    def run_training(*args: object, **kwargs: object) -> dict[str, Any]:
        # The path passed the up-front check; during the run, the file system changes.
        if turn == "its directory goes away":
            shutil.rmtree(out)
        else:
            path.mkdir()
        return dict(RECORD)

    monkeypatch.setattr("commfuse.train.runner.run_training", run_training)
    assert main([*TRAIN, "--steps", "2", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    [written] = list(fallback.iterdir())
    assert json.loads(written.read_text()) == {"kind": "train", **RECORD}
    assert f"cannot write {path}" in captured.err and f"wrote it to {written}" in captured.err
    assert f"metrics written to {written}" in captured.out
    assert written.name.startswith("metrics-") and written.suffix == ".json"
    # Nothing half-written is left beside the path.
    assert not out.exists() or [p.name for p in out.iterdir()] == ["metrics.json"]


def test_a_record_replaces_the_file_in_one_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.json"
    path.write_text("an older run's record\n")
    monkeypatch.setattr("commfuse.train.runner.run_training", lambda *args, **kwargs: dict(RECORD))
    assert main([*TRAIN, "--steps", "2", "--json", str(path)]) == 0
    assert json.loads(path.read_text()) == {"kind": "train", **RECORD}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    assert f"metrics written to {path}" in capsys.readouterr().out


COMPARE_RESULT = (
    Path(__file__).resolve().parents[1] / "benchmarks/compare_netlab-4x100mbit-2core.json"
)
DDP_RESULT = COMPARE_RESULT.parent / "ddp-engine_netlab-4x1gbit-2core.json"
PNG = b"\x89PNG"


def _vanishing(target: Any, out: Path) -> Any:
    """``target`` (a function) that first removes the directory ``out``: the file system
    changes during the run, after the command line's checks."""

    def vanish_then(*args: Any, **kwargs: Any) -> Any:
        shutil.rmtree(out, ignore_errors=True)
        return target(*args, **kwargs)

    return vanish_then


def _validation(out: Path) -> Any:
    """``sim_validate._one_run`` without ranks: the preset cluster, made-up timings."""
    import dataclasses

    from commfuse.bench import sim_validate
    from commfuse.sim.cluster import PRESETS

    def one_run(topology: Any, hosts: int, *args: Any) -> Any:
        shutil.rmtree(out)
        cluster = dataclasses.replace(PRESETS["netlab-1gbit"], num_hosts=hosts)
        validation = sim_validate.validation_configs(cluster, quick=True)
        measured = [1.1 * sim_validate.predict(cluster, cfg, compression_gbps=1.0) for cfg in validation]  # fmt: skip
        return cluster, 1.0, validation, measured, []

    return one_run


def _profile(out: Path) -> Any:
    """``tune``'s ranks: a profile of default link costs."""
    from commfuse.collectives.cost import LinkCost
    from commfuse.collectives.profile import Profile

    def run_on_ranks(*args: Any, **kwargs: Any) -> list[str]:
        shutil.rmtree(out)
        return [Profile(intra=LinkCost(), inter=LinkCost()).to_json()]

    return run_on_ranks


#: Every file a command writes besides ``train --json``: the command (its output paths under
#: DIR), what to stub so that DIR goes away during the run, and the files it writes.
OUTPUTS: dict[str, tuple[list[str], Any, list[str]]] = {
    "simulate --validate": (
        ["simulate", "--validate", "--quick", "--json", "DIR/v.json", "--save-cluster", "DIR/c.json"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.bench.sim_validate._one_run", _validation(out)
        ),
        ["v.json", "c.json"],
    ),
    "simulate --scale --plot": (
        ["simulate", "--op", "all_reduce", "--sizes", "1M", "--algo", "ring", "--scale", "2:8",
         "--plot", "DIR/curve.png", "--json", "DIR/curve.json"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.sim.scale.plot_curve", _vanishing(scale_plot_curve(), out)
        ),
        ["curve.png", "curve.json"],
    ),
    "simulate --trace": (
        ["simulate", "--workload", "transformer", "--trace", "DIR/trace.json"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.sim.step.simulate_step", _vanishing(simulate_step(), out)
        ),
        ["trace.json"],
    ),
    "tune --save-profile": (
        ["tune", "--hosts", "2", "--no-emulate", "--calibrate-sizes", "none", "--save-profile", "DIR/p.json"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.cli.tune.run_on_ranks", _profile(out)
        ),
        ["p.json"],
    ),
    "compare --plot": (
        [*COMPARE, "--strategy", "ddp", "--plot", "DIR/loss.png"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.bench.compare.compare_strategies",
            _vanishing(lambda *a, **k: json.loads(COMPARE_RESULT.read_text()), out),
        ),
        ["loss.png"],
    ),
    "bench ddp --plot": (
        ["bench", "ddp", "--hosts", "2", "--no-emulate", "--plot", "DIR/steps.png",
         "--json", "DIR/steps.json", "--markdown", "DIR/steps.md"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.cli.bench.report.run_on_ranks",
            _vanishing(lambda *a, **k: [json.loads(DDP_RESULT.read_text())], out),
        ),
        ["steps.png", "steps.json", "steps.md"],
    ),
    "report --plot-bytes": (
        ["report", str(COMPARE_RESULT), "--plot-bytes", "DIR/bytes.png"],
        lambda out, monkeypatch: monkeypatch.setattr(
            "commfuse.bench.compare.plot_loss_vs_bytes", _vanishing(plot_loss_vs_bytes(), out)
        ),
        ["bytes.png"],
    ),
}  # fmt: skip


def scale_plot_curve() -> Any:
    from commfuse.sim import scale

    return scale.plot_curve


def simulate_step() -> Any:
    from commfuse.sim import step

    return step.simulate_step


def plot_loss_vs_bytes() -> Any:
    from commfuse.bench import compare

    return compare.plot_loss_vs_bytes


@pytest.mark.parametrize("command", sorted(OUTPUTS))
def test_every_file_a_command_writes_goes_elsewhere_when_its_path_cannot_be_written(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv, stub, names = OUTPUTS[command]
    out = tmp_path / "out"
    out.mkdir()
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback))
    stub(out, monkeypatch)
    assert main([arg.replace("DIR", str(out)) for arg in argv]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    # Each under its own name: the path's stem, a unique part, the path's suffix.
    written = {p.name.split("-")[0] + p.suffix: p for p in fallback.iterdir() if p.is_file()}
    assert sorted(written) == sorted(names), captured.err
    for name in names:
        path = written[name]
        assert path.stat().st_size > 0
        assert (
            f"cannot write {out / name}" in captured.err and f"wrote it to {path}" in captured.err
        )
        if path.suffix == ".png":
            assert path.read_bytes().startswith(PNG)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        # What the command prints says where the file went, not where it was asked.
        assert f"written to {out / name}" not in captured.out, captured.out
