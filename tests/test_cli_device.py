"""--device / --backend: a machine that cannot run the request hears why before a rank starts."""

from __future__ import annotations

import pytest
import torch

from commfuse.cli import main

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="the machine has CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "collectives", "--device", "cuda", "--hosts", "2", "--no-emulate"],
        ["bench", "fused", "--device", "cuda", "--hosts", "1", "--no-emulate"],
        ["bench", "ddp", "--device", "cuda", "--hosts", "1", "--no-emulate"],
        ["train", "--device", "cuda", "--backend", "nccl", "--steps", "1"],
        ["compare", "--device", "cuda", "--hosts", "1", "--no-emulate", "--steps", "1"],
        ["bench", "strategies", "--device", "cuda", "--hosts", "1", "--strategy", "ddp"],
        ["launch", "--device", "cuda", "--nproc", "1", "--no-python", "true"],
    ],
)
def test_cuda_without_cuda_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and ("without CUDA" in err or "no CUDA device" in err), err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "collectives", "--backend", "nccl", "--hosts", "2"], "needs --device cuda"),
        (["bench", "collectives", "--device", "cuda", "--backend", "gloo"], "needs --backend nccl"),
    ],
)
def test_device_and_backend_must_agree(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--no-emulate"]) == 2
    assert needle in capsys.readouterr().err
