"""End to end: ``commfuse simulate --validate --quick`` runs real collectives and a torch DDP step
on a 2-host emulated cluster, predicts them from the calibrated model and writes the records."""

from __future__ import annotations

import json
import math

from commfuse.sim.validate import run_validation


def test_validate_quick_writes_one_record_per_held_out_configuration(tmp_path, capsys) -> None:
    path = tmp_path / "validation.json"
    assert run_validation(hosts=2, link="1gbit", json_path=str(path), quick=True, reps=2) == 0
    records = json.loads(path.read_text())
    assert [r["config"] for r in records] == ["allreduce native 1M", "DDP step MLP bucket=25MB"]
    for r in records:
        assert r["measured_us"] > 0 and r["predicted_us"] > 0
        assert math.isclose(r["error"], r["predicted_us"] / r["measured_us"] - 1)
    out = capsys.readouterr().out
    assert "calibrated on 3 configurations (not scored)" in out and "median |error|" in out
