"""Where a communicator's settings come from: explicit ``CommConfig`` fields, which a rank
started by commfuse fills from its launcher's environment once, at start-up; and the one
handle type of asynchronous work."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.cluster.rank_runtime import CommSettings
from commfuse.collectives import all_reduce, broadcast
from commfuse.collectives.profile import TunerState, profile_of
from commfuse.comm import CommConfig, Communicator, Handle
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]


def test_settings_read_the_launchers_variables() -> None:
    env = {
        "COMMFUSE_DEADLINE_S": "12.5",
        "COMMFUSE_LINK_MBIT": "1000",
        "LOCAL_WORLD_SIZE": "2",
        "COMMFUSE_TUNER_PROFILE": "/tmp/p.json",
        "COMMFUSE_TUNER_TRIAL_CALLS": "0",
    }
    assert CommSettings.from_env(env) == CommSettings(
        deadline_s=12.5,
        link_mbit=1000.0,
        ranks_per_host=2,
        tuner_profile_path="/tmp/p.json",
        tuner_trial_calls=0,
    )
    assert CommSettings.from_env({}) == CommSettings()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"COMMFUSE_DEADLINE_S": "soon"}, "COMMFUSE_DEADLINE_S='soon' is not a number"),
        ({"LOCAL_WORLD_SIZE": "2.5"}, "LOCAL_WORLD_SIZE='2.5' is not an integer"),
        ({"COMMFUSE_LINK_MBIT": "0"}, "COMMFUSE_LINK_MBIT='0' must be > 0"),
        ({"COMMFUSE_TUNER_TRIAL_CALLS": "-1"}, "COMMFUSE_TUNER_TRIAL_CALLS='-1' must be >= 0"),
        (
            {"COMMFUSE_TUNER_TRIAL_CALLS": "5.0"},
            "COMMFUSE_TUNER_TRIAL_CALLS='5.0' is not an integer",
        ),
    ],
)
def test_a_bad_variable_is_named(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CommSettings.from_env(env)


@pytest.mark.parametrize(
    ("field", "value"), [("deadline_s", 0.0), ("link_mbit", -1.0), ("ranks_per_host", 0)]
)
def test_a_bad_field_is_named(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"CommConfig.{field} must be"):
        CommConfig(**{field: value})


def config_in_rank() -> dict[str, Any]:
    comm = Communicator()
    handle = all_reduce(comm, torch.ones(4), async_op=True)
    empty = broadcast(comm, torch.ones(0), async_op=True)
    assert handle is not None and empty is not None
    handle.wait()
    return {
        "config": dataclasses.asdict(comm.config),
        "handles": (type(handle) is Handle, type(empty) is Handle, empty.is_completed()),
        "profile": (profile_of(comm).num_hosts, profile_of(comm).ranks_per_host),
        "own_state": comm.owned(TunerState) is comm.owned(TunerState),
        "fresh_state": Communicator().owned(TunerState) is not comm.owned(TunerState),
    }


def test_a_started_rank_fills_the_config_from_its_environment(pool: PoolFn) -> None:
    """The pool's ranks get LOCAL_WORLD_SIZE = the world (one host) and no link rate; the
    communicator built without a config carries them, and the tuner's profile follows."""
    for result in pool(2).run(config_in_rank):
        assert result["config"]["ranks_per_host"] == 2
        assert result["config"]["link_mbit"] is None
        assert result["config"]["deadline_s"] == CommConfig().deadline_s
        assert result["handles"] == (True, True, True)
        assert result["profile"] == (1, 2)
        assert result["own_state"] and result["fresh_state"]


def unreadable_profile(path: str) -> str:
    comm = Communicator(config=CommConfig(tuner_profile_path=path))
    try:
        all_reduce(comm, torch.ones(4), algo="auto")
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_missing_tuner_profile_names_the_field(pool: PoolFn, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.json")
    for message in pool(2).run(unreadable_profile, missing):
        assert message.startswith(f"CommConfig.tuner_profile_path={missing!r} cannot be read")


REPORT_CONFIG = Path(__file__).parent / "scripts" / "report_config.py"
LAUNCHERS = {
    "commfuse launch": [sys.executable, "-m", "commfuse.cli", "launch", "--nproc", "2"],
    "torchrun": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ],
}


@pytest.mark.e2e
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_script_started_by_a_launcher_honours_the_environment(launcher: str) -> None:
    """A user's script (``init_process_group``, then ``Communicator()``) under ``commfuse
    launch`` or torchrun: its communicator's config carries the deadline, the tuner profile and
    the ranks per host of its environment, read once by the rank's start-up. The link rate is
    the launcher's to set: torchrun passes the caller's through, ``commfuse launch`` sets its
    own (none on plain loopback)."""
    env = {
        **os.environ,
        "COMMFUSE_DEADLINE_S": "7.5",
        "COMMFUSE_TUNER_PROFILE": "/nonexistent/profile.json",
        "COMMFUSE_TUNER_TRIAL_CALLS": "3",
        "COMMFUSE_LINK_MBIT": "100",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [*LAUNCHERS[launcher], str(REPORT_CONFIG)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    configs = [
        json.loads(line.split("CONFIG ", 1)[1])
        for line in proc.stdout.splitlines()
        if "CONFIG " in line
    ]
    assert sorted(c["rank"] for c in configs) == [0, 1], proc.stdout
    for config in configs:
        assert config["deadline_s"] == 7.5
        assert config["tuner_profile_path"] == "/nonexistent/profile.json"
        assert config["tuner_trial_calls"] == 3
        assert config["ranks_per_host"] == 2
        assert config["link_mbit"] == (100.0 if launcher == "torchrun" else None)
