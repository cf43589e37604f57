"""The suite's own rules: a ``netlab`` test skips with its reason where the emulated network
cannot be built, and FAILS under ``CI=true``, so CI cannot pass without running it; and
``.ci/run`` runs the README's test command, exactly, with ``CI=true``.

The marker rule is checked on ``tests/conftest.py`` itself: it is copied next to a small
``netlab`` test, and pytest runs them in a subprocess without the capabilities the network needs
(``setpriv`` drops CAP_NET_ADMIN and CAP_SYS_ADMIN from a root process; any other user lacks
them already).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_TEST_COMMAND = ".venv/bin/python -m pytest -q"

NETLAB_TEST = """
import pytest

@pytest.mark.netlab
def test_needs_the_network():
    pass

def test_plain():
    pass
"""


def run_pytest(folder: Path, *, ci: bool, network: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(folder)]
    if not network and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip(
                "setpriv (util-linux) is needed to run a root process without CAP_NET_ADMIN"
            )
        command = [setpriv, "--bounding-set=-net_admin,-sys_admin", "--", *command]
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_marked.py").write_text(NETLAB_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    netlab: needs the network\n")
    return tmp_path


@pytest.mark.e2e
def test_netlab_tests_skip_with_the_reason_outside_ci(suite: Path) -> None:
    result = run_pytest(suite, ci=False, network=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout, result.stdout
    assert "netlab unavailable: " in result.stdout, result.stdout


@pytest.mark.e2e
def test_netlab_tests_fail_under_ci_when_the_network_cannot_be_built(suite: Path) -> None:
    result = run_pytest(suite, ci=True, network=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed, 1 error" in result.stdout, result.stdout  # failed in its set-up
    assert "CI=true, but the emulated network cannot be built" in result.stdout


@pytest.mark.e2e
def test_netlab_tests_run_where_the_network_can_be_built(suite: Path) -> None:
    from commfuse.cluster.netlab import netlab_unavailable_reason

    reason = netlab_unavailable_reason()
    if reason is not None:  # under CI=true, conftest's rule has failed the network tests already
        pytest.skip(f"netlab unavailable: {reason}")
    result = run_pytest(suite, ci=True, network=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout, result.stdout


def test_ci_runs_the_readme_test_command_with_ci_true() -> None:
    """The README's install-and-test line (the one ending in the test command) is a line of
    ``.ci/run``, verbatim, and ``.ci/run`` exports ``CI=true`` before it."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = (ROOT / "README.md").read_text().splitlines()
    wanted = [line for line in readme if line.rstrip().endswith(README_TEST_COMMAND)]
    assert len(wanted) == 1, wanted
    assert wanted[0] in ci, (wanted[0], ci)
    assert "export CI=true" in ci[: ci.index(wanted[0])], ci
