"""``tests/scripts/cli_latency.py``, the developers' tool: whole ``commfuse`` commands timed in
fresh interpreters, across source trees, in balanced rounds with the A/A control; each record
says what the command imported, and ``commfuse report`` renders the records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import commfuse
from commfuse.cli.report import kind_of, render_result

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from cli_latency import (  # a script beside the tests, not a module of commfuse
    CliLatencyConfig,
    argv_of,
    bench_cli_latency,
    main,
)

SRC = str(Path(commfuse.__file__).resolve().parents[1])


@pytest.mark.e2e
def test_records_per_command_and_tree_with_the_control() -> None:
    config = CliLatencyConfig(
        commands=("--version", "import commfuse.cli"),
        trees=(("a", SRC), ("b", SRC)),
        rounds=2,
        control=True,
    )
    records = bench_cli_latency(config)
    assert [(r["command"], r["tree"]) for r in records] == [
        (c, t) for c in config.commands for t in ("a", "b", "a'")
    ]
    for r in records:
        assert 0 < r["wall_s_min"] <= r["wall_s"] <= r["wall_s_max"], r
        assert r["ratio_min"] <= r["ratio_to_first"] <= r["ratio_max"], r
        # The child's own CPU time: some, and never more than two cores' worth of its wall time.
        assert 0 < r["cpu_s"] <= 2 * r["wall_s_max"], r
        assert r["control_ratio"] is not None and r["rounds"] == 2
        # Neither command needs torch, and the profile saw the command's own imports.
        assert r["imports_torch"] is False and r["torch_import_us"] == 0, r
        assert any(m["module"].startswith("commfuse") for m in r["importtime_top"]), r
    assert all(r["ratio_to_first"] == 1.0 for r in records if r["tree"] == "a")
    assert kind_of(records) == "bench cli"
    assert "import commfuse.cli" in render_result(records, markdown=True)


@pytest.mark.e2e
def test_commands_run_as_the_user_runs_them() -> None:
    assert argv_of("simulate --ranks 8", "py") == [
        "py",
        "-m",
        "commfuse.cli",
        "simulate",
        "--ranks",
        "8",
    ]
    assert argv_of("import commfuse.sim", "py", importtime=True) == [
        "py",
        "-X",
        "importtime",
        "-c",
        "import commfuse.sim",
    ]


@pytest.mark.e2e
def test_a_failing_command_names_itself() -> None:
    config = CliLatencyConfig(commands=("no-such-command",), trees=(("a", SRC),), rounds=1)
    with pytest.raises(RuntimeError, match=r"'no-such-command' on .* exited with 2"):
        bench_cli_latency(config)


@pytest.mark.parametrize(
    ("trees", "message"),
    [
        ((), "at least one"),
        ((("a", "/nonexistent"),), "holds no commfuse"),
        ((("a", SRC), ("a", SRC)), "twice"),
    ],
)
def test_bad_trees_are_refused(trees: tuple[tuple[str, str], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CliLatencyConfig(commands=("--help",), trees=trees)


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tree", "nosrc"]) == 2
    assert "use NAME=SRC" in capsys.readouterr().err
    assert main(["--repeats", "0"]) == 2
    assert "rounds must be >= 1" in capsys.readouterr().err
