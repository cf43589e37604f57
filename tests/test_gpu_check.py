"""benchmarks/device/gpu_check.sh: its dry mode runs every check on the CPU, and without CUDA
its GPU mode stops with a clear error instead of a report of nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commfuse.cli.report import render_result
from commfuse.collectives import algorithms_for

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        [str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=480
    )


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_without_cuda_the_gpu_mode_refuses(tmp_path: Path) -> None:
    done = _run(str(tmp_path))
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_dry_mode_runs_every_check_on_the_cpu(tmp_path: Path) -> None:
    done = _run(
        str(tmp_path), "--device", "cpu", "--backend", "gloo",
        "--size-mb", "0.25", "--width", "64", "--repeats", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["backend"] == "gloo"
    assert report["failed"] == []
    names = {c["name"] for c in report["checks"]}
    ops = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all")
    assert {f"collective {op} {algo}" for op in ops for algo in algorithms_for(op)} <= names
    every = "NoCompression FP16 BF16 Int8 QSGD TernGrad Sign EFSign TopK RandomK RandomBlock DGC"
    assert {f"compressor {c}" for c in [*every.split(), "PowerSGD", "ACPSGD"]} <= names
    assert "torch powerSGD_hook" in names
    modules = (
        "ColumnParallelLinear",
        "RowParallelLinear",
        "ShardedEmbeddingBag",
        "ExpertParallelMoE",
    )
    assert {f"module {m}" for m in modules} <= names
    # The training loop as a user runs it, on the same device and backend.
    runs = {c["name"]: c for c in report["checks"]}
    resumed = runs["train charlm powersgd resume"]
    assert (resumed["device"], resumed["resumed_at"], resumed["steps"]) == ("cpu", 3, 6)
    assert set(runs["bench strategies"]["step_ms"]) >= {"ddp", "commfuse", "local-sgd:H=2"}
    compressed = [c for c in report["checks"] if "ms_per_mb" in c]
    assert all(c["ms_per_mb"] > 0 for c in compressed)
    assert all(c.get("device", "cpu") == "cpu" for c in compressed)
    # One row per check, as `commfuse report` renders the file.
    table = render_result(report, markdown=True).splitlines()
    assert len(table) == 2 + len(report["checks"]) and "rel_error" in table[0]


@pytest.mark.slow
def test_a_check_stopped_at_its_deadline_keeps_what_it_finished(tmp_path: Path) -> None:
    # 170 s of budget leaves the rank's checks 20 s: enough for the collectives (a fraction of a
    # second each), not for a compressor timed over 1000 steps of an 8 MB gradient. The
    # training checks still run in the 150 s kept for them.
    done = _run(str(tmp_path), "--device", "cpu", "--backend", "gloo", "--size-mb", "0.25",
                "--width", "1024", "--repeats", "1000", "--budget-s", "170")  # fmt: skip
    assert done.returncode == 1, done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [c["name"] for c in report["checks"]]
    finished = (tmp_path / "gpu_check_progress.jsonl").read_text().splitlines()
    stopped = names.index("rank checks")
    assert stopped >= 1 and names[:stopped] == [json.loads(line)["name"] for line in finished]
    assert "DeadlineExceeded" in report["checks"][stopped]["error"]
    assert report["failed"] == ["rank checks"]
    assert names[stopped + 1 :] == ["train charlm powersgd resume", "bench strategies"]
