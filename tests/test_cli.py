"""The ``commfuse`` command's surface: every sub-command answers ``--help``, flags agree."""

from __future__ import annotations

import argparse

import pytest

from commfuse.cli import build_parser, main


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
    for path in COMMANDS:
        flags = _flags(path)
        assert not retired & flags.keys(), (path, retired & flags.keys())
        for flag in ("--json", "--markdown", "--plot"):
            if flag in flags:
                assert flags[flag].metavar == "PATH", (path, flag)
