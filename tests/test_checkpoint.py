"""Checkpoint files: weights-only loading (a file from elsewhere cannot run code), RNG streams."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from commfuse.train import checkpoint as ckpt


class RunsCodeWhenUnpickled:
    """Unpickling this calls ``Path.touch(marker)``: any function could stand there."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    payload = {"step": 3, "model": {"w": torch.zeros(2)}, "x": RunsCodeWhenUnpickled(marker)}
    path = ckpt.save_rank(tmp_path, 3, 0, payload)
    with pytest.raises(ValueError, match=r"refusing to load .*rank0\.pt.*must not run code"):
        ckpt.load_rank(tmp_path, 3, 0, device=torch.device("cpu"))
    assert not marker.exists()
    # The file is what it claims: a full unpickler runs its code.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    np.random.standard_normal()  # numpy caches a second Gaussian: part of its state
    ckpt.save_rank(tmp_path, 1, 0, {"rng": ckpt.rng_state()})
    expected = (torch.rand(3), random.random(), np.random.standard_normal(2))
    ckpt.set_rng_state(ckpt.load_rank(tmp_path, 1, 0, device=torch.device("cpu"))["rng"])
    again = (torch.rand(3), random.random(), np.random.standard_normal(2))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert np.array_equal(expected[2], again[2])


def test_a_file_that_is_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    ckpt.step_dir(tmp_path, 2).mkdir(parents=True)
    (ckpt.step_dir(tmp_path, 2) / "rank0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        ckpt.load_rank(tmp_path, 2, 0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="is missing"):
        ckpt.load_rank(tmp_path, 2, 1, device=torch.device("cpu"))


def test_a_checkpoint_loads_onto_the_ranks_device_and_its_rng_stays_on_the_host(
    tmp_path: Path,
) -> None:
    """The model's and the strategy's tensors move to the device ``load_rank`` is given (torch's
    ``meta`` device stands in for a GPU here); the optimizer's are left for its own
    ``load_state_dict`` to place, and the RNG states stay host memory, ready to restore."""
    torch.manual_seed(3)
    payload = {
        "model": {"w": torch.ones(2)},
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(2)}}},
        "strategy": {"engine": {"residuals": [torch.ones(3)], "layout": (torch.arange(2), 5)}},
        "rng": ckpt.rng_state(),
        "history": {"loss": [1.0]},
    }
    ckpt.save_rank(tmp_path, 1, 0, payload)
    expected = torch.rand(2)
    meta = torch.device("meta")
    loaded = ckpt.load_rank(tmp_path, 1, 0, device=meta)
    engine = loaded["strategy"]["engine"]
    assert loaded["model"]["w"].device == meta
    assert engine["residuals"][0].device == meta and engine["layout"][0].device == meta
    assert isinstance(engine["layout"], tuple) and engine["layout"][1] == 5
    assert loaded["optimizer"]["state"][0]["exp_avg"].device == torch.device("cpu")
    assert loaded["rng"]["torch"].device == torch.device("cpu")
    assert loaded["history"] == {"loss": [1.0]}
    ckpt.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_rng_stream_is_saved_and_restored(tmp_path: Path) -> None:
    torch.cuda.manual_seed(7)
    torch.rand(4, device="cuda")
    ckpt.save_rank(tmp_path, 1, 0, {"rng": ckpt.rng_state()})
    expected = torch.rand(4, device="cuda")
    torch.rand(4, device="cuda")  # move the stream on
    state = ckpt.load_rank(tmp_path, 1, 0, device=torch.device("cpu"))["rng"]
    assert "cuda" in state
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
