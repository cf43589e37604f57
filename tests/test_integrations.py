"""``commfuse.integrations``: imported only when used, and each adapter refuses what it cannot
run with a message that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import commfuse

_SRC = str(Path(commfuse.__file__).resolve().parents[1])
TRAINERS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def test_commfuse_imports_no_trainer() -> None:
    """``import commfuse`` and its engines, and the integrations package itself, leave every
    trainer unimported (a fresh interpreter: the test runner's own imports prove nothing)."""
    probe = (
        "import commfuse, commfuse.hooks, commfuse.localsgd, commfuse.integrations, sys\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({TRAINERS!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": _SRC}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_lightning_strategy_refuses_a_second_hook() -> None:
    pytest.importorskip("lightning")
    from commfuse.compress import PowerSGD
    from commfuse.hooks import compressed_allreduce_hook
    from commfuse.integrations.lightning import CommfuseDDPStrategy

    with pytest.raises(ValueError, match="registers its own hook"):
        CommfuseDDPStrategy(PowerSGD(rank=4), ddp_comm_hook=compressed_allreduce_hook)
    with pytest.raises(ValueError, match="needs a commfuse compressor"):
        CommfuseDDPStrategy("powersgd:rank=4")  # type: ignore[arg-type]
