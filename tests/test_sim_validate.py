"""End to end: ``commfuse simulate --validate --quick`` calibrates on real runs on a 2-host emulated
cluster, then predicts held-out collectives, a torch DDP step and a local-SGD step, and writes one
record per configuration, followed by the calibration fits' residuals (never scored)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from commfuse.bench.sim_validate import run_validation
from commfuse.sim.cluster import ClusterModel


def test_validate_quick_writes_one_record_per_held_out_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, saved = tmp_path / "validation.json", tmp_path / "cluster.json"
    assert (
        run_validation(
            hosts=2, link="1gbit", json_path=str(path), quick=True, reps=2, cluster_path=str(saved)
        )
        == 0
    )
    records = json.loads(path.read_text())
    held_out = [r for r in records if r["role"] == "validation"]
    assert [r["config"] for r in held_out] == [
        "all_reduce native 1M",
        "all_reduce ring 1M",
        "torch DDP step MLP bucket=25MB",
        "local SGD step H=4 MLP",
    ]
    # The command's kind names the record; the configuration's is config_kind.
    assert {r["kind"] for r in records} == {"simulate --validate"}
    assert [r["config_kind"] for r in held_out] == ["collective", "collective", "step", "step"]
    for r in records:
        assert r["measured_us"] > 0 and r["predicted_us"] > 0
        assert math.isclose(r["error"], r["predicted_us"] / r["measured_us"] - 1)
    fits = {r["config"].rsplit(" ", 1)[0] for r in records if r["role"] == "calibration"}
    assert fits == {"fit p2p", "fit all_reduce/native"}
    # Calibration sizes are not validation sizes: nothing scored was fitted.
    fitted_sizes = {r["config"].rsplit(" ", 1)[1] for r in records if r["role"] == "calibration"}
    assert "1M" not in fitted_sizes
    cluster = ClusterModel.from_json(saved.read_text())
    assert cluster.collective_link("all_reduce", "native") is not None
    out = capsys.readouterr().out
    assert "calibrated on" in out and "(not scored)" in out and "median |error|" in out


def test_small_messages_get_more_samples_per_round() -> None:
    from commfuse.bench.sim_measure import SMALL_MESSAGE_SAMPLES, samples_per_round

    assert samples_per_round({"kind": "collective", "bytes": 256 * 1024}) == SMALL_MESSAGE_SAMPLES
    assert samples_per_round({"kind": "p2p", "bytes": 512 * 1024}) == SMALL_MESSAGE_SAMPLES
    assert samples_per_round({"kind": "collective", "bytes": 1024 * 1024}) == 1
    assert samples_per_round({"kind": "step", "model": {}}) == 1
