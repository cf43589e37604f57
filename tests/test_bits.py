"""``commfuse.testing.bits``: two runs' records say where they part, and the train loop's
fingerprints name each parameter's bits.

Built from hand-made records (no run): the first step and the parameters whose bits differ,
the first differing loss, a fault-tolerant run's steps committed by a partial quorum, and the
choices that differ; nothing is reported for equal digests.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.testing.bits import RunBits, parting
from commfuse.train.loop import param_fingerprints


def _plain(
    fingerprints: dict[int, dict[str, str]], losses: list[float], digest: str
) -> dict[str, Any]:
    return {
        "digest": digest,
        "start_step": 0,
        "rank_losses": [losses],
        "param_fingerprints": [fingerprints],
        "choices": [{"bucket_layout": [["b", "w"]], "compressor": {"layouts": {0: ["b", "w"]}}}],
    }


def _ft(
    fingerprints: dict[int, dict[str, str]], losses: list[float], quorums: list[int]
) -> dict[str, Any]:
    records = [
        {
            "replica": replica,
            "life": 0,
            "step": step,
            "committed": True,
            "participants": quorums[step],
            "loss": losses[step],
            "fingerprints": fingerprints[step],
        }
        for replica in (0, 1)
        for step in range(len(losses))
    ]
    return {
        "digest": "ft-digest",
        "records": records,
        "per_replica": [{}, {}],
        "choices": [{"replica": 0, "compressor": {"layouts": {0: ["w", "b"]}}}],
    }


def test_parting_names_the_first_step_parameter_loss_quorum_and_choices() -> None:
    same = {"w": "1", "b": "2"}
    plain = _plain({0: same, 1: same, 2: {"w": "3", "b": "2"}}, [4.0, 3.0, 2.0], "plain-digest")
    ft = _ft({0: same, 1: same, 2: {"w": "9", "b": "2"}}, [4.0, 3.0, 2.5], [2, 1, 2])
    report = parting(RunBits.of_ft(ft), RunBits.of_plain(plain))
    assert report is not None
    assert "first step whose parameters differ: 2 (1 of 2: w); steps 0-1 agree" in report
    assert "first loss that differs: step 2 (2.5 != 2.0)" in report
    assert "fewer than its 2 replica groups (step: quorum): {1: 1}" in report
    assert 'compressor.layouts.0: ["w", "b"] != ["b", "w"]' in report


def test_equal_digests_part_nowhere() -> None:
    plain = _plain({}, [1.0], "d")
    assert parting(RunBits.of_plain(plain), RunBits.of_plain(plain, name="other")) is None


def test_fingerprints_follow_every_bit_of_each_parameter() -> None:
    module = torch.nn.Linear(3, 2)
    before = param_fingerprints(module)
    assert sorted(before) == ["bias", "weight"]
    with torch.no_grad():
        # The smallest change of one element's bits: its next float up.
        module.weight[1, 2] = torch.nextafter(module.weight[1, 2], torch.tensor(1.0))
    after = param_fingerprints(module)
    assert after["weight"] != before["weight"] and after["bias"] == before["bias"]
