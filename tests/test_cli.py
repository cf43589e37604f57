"""The ``commfuse`` command's surface: every sub-command answers ``--help``, flags agree, and
the command (not the library under it) reads the environment."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import commfuse
from commfuse.cli import build_parser, main
from commfuse.cli.common import UsageError, run_command
from commfuse.cluster.errors import DeadlineExceeded, LaunchError, RankError
from commfuse.cluster.netlab import NetlabError


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under ``parser`` (``()`` is ``commfuse`` itself), depth first."""
    paths = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += _commands(sub, (*path, name))
    return paths


COMMANDS = _commands(build_parser())


def test_the_walk_finds_every_level() -> None:
    assert ("bench", "collectives") in COMMANDS and ("net", "check") in COMMANDS
    assert ("train",) in COMMANDS and () in COMMANDS


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "commfuse")
def test_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: " + " ".join(("commfuse", *path))), out


def _flags(path: tuple[str, ...]) -> dict[str, argparse.Action]:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_one_spelling_per_flag() -> None:
    """Repetitions are --repeats, the bucket cap --bucket-cap-mb, outputs take a PATH."""
    retired = {"--reps", "--iters", "--bucket-mb", "--bucket-cap"}
    # One name for an op, its sizes, a fused operator's chunks and a file a command writes.
    retired |= {"--collective", "--size", "--fused-chunks", "--out", "--nproc-per-node"}
    retired |= {"--workload-arg"}  # a workload's settings go in its spec, NAME:key=value
    for path in COMMANDS:
        flags = _flags(path)
        assert not retired & flags.keys(), (path, retired & flags.keys())
        for flag in ("--json", "--markdown", "--plot"):
            if flag in flags:
                assert flags[flag].metavar == "PATH", (path, flag)


@pytest.mark.parametrize("path", [p for p in COMMANDS if p[:1] == ("bench",) and len(p) == 2])
def test_every_bench_command_writes_json_markdown_and_a_plot(path: tuple[str, ...]) -> None:
    assert {"--json", "--markdown", "--plot"} <= _flags(path).keys()


#: Library layers that take every setting as an argument: the environment is read by the
#: command (``cli/``) and by a rank's start-up (``cluster/``), which pass it down explicitly.
_NO_ENVIRONMENT = ("bench", "compress", "ddp", "fused", "localsgd", "sim", "workloads")


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``os.environ`` / ``os.getenv`` (however imported)."""
    tree = ast.parse(path.read_text())
    names = {"environ", "getenv", "putenv", "unsetenv"}
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "os"
        for alias in node.names
        if alias.name in names
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Attribute)
            and node.attr in names
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )
        or (isinstance(node, ast.Name) and node.id in imported)
    ]


def test_library_layers_read_no_environment() -> None:
    root = Path(commfuse.__file__).parent
    found = {
        f"{path.relative_to(root)}:{line}"
        for layer in _NO_ENVIRONMENT
        for path in sorted((root / layer).rglob("*.py"))
        for line in _environment_reads(path)
    }
    assert not found, f"environment read outside cli/ and cluster/: {sorted(found)}"


def _raises(exc: BaseException) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        raise exc

    return command


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("bad value"), 2),
        (LaunchError("no such script"), 2),
        (UsageError("needs root"), 2),
        (RankError(1, "boom"), 1),
        (DeadlineExceeded("rank 1 still running", ranks=[1]), 1),
        (NetlabError("ip link add failed"), 1),
        (KeyboardInterrupt(), 130),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_error_handler_maps_each_failure_to_one_line_and_a_status(
    exc: BaseException, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(func=_raises(exc), prog="commfuse bench ddp")
    assert run_command(args) == code
    lines = capsys.readouterr().err.splitlines()
    prog = "commfuse" if code == 130 else "commfuse bench ddp"
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), lines


def test_an_unexpected_error_keeps_its_traceback() -> None:
    """Only the failures the handler knows become a status; a bug still raises."""
    with pytest.raises(TypeError):
        run_command(argparse.Namespace(func=_raises(TypeError("bug")), prog="commfuse"))


def test_only_the_cli_parses_command_lines() -> None:
    root = Path(commfuse.__file__).parent
    importers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "cli" not in path.relative_to(root).parts[:1]
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "argparse")
    )
    assert not importers, f"argparse outside commfuse/cli/: {importers}"


def _private_uses(path: Path) -> list[str]:
    """``from commfuse.x import _y`` and ``name._y`` where ``name`` came from commfuse, in
    ``path``: the command reaching into a library module past its public names."""
    tree = ast.parse(path.read_text())
    from_commfuse: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commfuse"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                from_commfuse.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("commfuse"):
                    from_commfuse.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in from_commfuse:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_command_uses_only_the_librarys_public_names() -> None:
    cli = Path(commfuse.__file__).parent / "cli"
    found = [
        f"{p.relative_to(cli)}:{use}" for p in sorted(cli.rglob("*.py")) for use in _private_uses(p)
    ]
    assert not found, "cli/ reads private names of library modules:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_forms(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from commfuse.train import strategy\n"
        "from commfuse.localsgd.diloco import _private\n"
        "import commfuse.train.strategy as s\n"
        "strategy._BUILDERS\ns._changed\nself._ok\n"
    )
    assert [use.split(": ")[1] for use in _private_uses(sample)] == [
        "from commfuse.localsgd.diloco import _private",
        "strategy._BUILDERS",
        "s._changed",
    ]


#: Bad flags of commands that run for minutes: each is refused as the command line is read,
#: naming the flag as typed, before any rank starts (exit 2, one line, no traceback).
BAD_RUN_FLAGS = (
    (["train", "--steps", "-1"], "--steps must be at least 1"),
    (["train", "--steps", "5", "--checkpoint-every", "-3"], "--checkpoint-every must be at"),
    (["train", "--bucket-cap-mb", "-1"], "--bucket-cap-mb must be more than 0"),
    (["train", "--timeout", "-5"], "--timeout: must be more than 0 seconds"),
    (["train", "--json", "/nonexistent/dir/m.json"], "no directory /nonexistent/dir"),
    (["compare", "--repeats", "0"], "--repeats must be at least 1"),
    (["compare", "--max-steps-factor", "0.5"], "--max-steps-factor must be at least 1"),
    (["compare", "--plot", "/nonexistent/c.png"], "no directory /nonexistent to write c.png"),
    (["simulate", "--ranks", "0"], "--ranks must be at least 1"),
    (["bench", "fused", "--warmup", "-1"], "--warmup must be at least 0"),
    (["report", "x.json", "--json", "/"], "/ is a directory"),
    (["simulate", "--scale", "3:2"], "a range runs from low to high (2:3)"),
    (["net", "down"], "give the LAB_ID to remove"),
    (["net", "down", "cfuse0000", "--all"], "give a LAB_ID or --all, not both"),
)


@pytest.mark.parametrize("argv, needle", BAD_RUN_FLAGS, ids=[" ".join(a) for a, _ in BAD_RUN_FLAGS])
def test_bad_run_flags_are_named_before_anything_runs(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert needle in lines[-1] and "Traceback" not in err, err


def test_the_strategy_list_gives_every_key_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--list-strategies"]) == 0
    out = capsys.readouterr().out
    # Each name's block: its line and the indented key lines under it.
    blocks = re.split(r"\n  (?=\S)", out)
    after = {block.split()[0]: block for block in blocks[1:]}
    assert "rank=2" in after["powersgd"] and "warmup=10" in after["powersgd"]
    assert "staleness=0" in after["powersgd"]  # the engine's keys too
    # A method's shared keys have the defaults of the config it builds.
    assert "H=50" in after["diloco"] and "compressor=none" in after["diloco"]


@pytest.mark.e2e
def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "commfuse.cli", "train", "--list-strategies"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does: the command's writes fail with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err
