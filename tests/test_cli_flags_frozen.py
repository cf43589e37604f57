"""The command line's flags are frozen: every flag of every ``commfuse`` sub-command is listed
here, as torchtitan's ``test_no_new_cli_options.py`` lists its options.

A flag is an interface users write into scripts and reports, and each one is a setting to
document, test and keep. So a new flag, a renamed one or a removed one changes this test on
purpose, in the same commit, where a reviewer sees it: update ``EXPECTED``. Where a flag goes
is in ``docs/design.md`` ("Where each kind of change goes").
"""

from __future__ import annotations

import argparse

from commfuse.cli import build_parser

#: ``command -> its flags, sorted`` (``""`` is ``commfuse`` itself; ``-h``/``--help`` left out).
EXPECTED: dict[str, list[str]] = {
    "": ["--version"],
    "launch": [
        "--backend",
        "--device",
        "--hosts",
        "--link",
        "--module",
        "--no-emulate",
        "--no-python",
        "--nproc",
        "--ranks-per-host",
        "--timeout",
        "-m",
    ],
    "net": [],
    "net up": ["--burst-kb", "--hosts", "--link", "--mtu", "--no-check", "--ranks-per-host"],
    "net down": ["--all"],
    "net status": ["--json"],
    "net check": ["--burst-kb", "--hosts", "--json", "--link", "--mtu", "--ranks-per-host"],
    "tune": [
        "--calibrate-sizes",
        "--hosts",
        "--json",
        "--link",
        "--no-emulate",
        "--ranks-per-host",
        "--repeats",
        "--save-profile",
        "--sizes",
        "--timeout",
    ],
    "bench": [],
    "bench collectives": [
        "--algo",
        "--backend",
        "--control",
        "--device",
        "--dtype",
        "--hosts",
        "--json",
        "--link",
        "--markdown",
        "--min-sample-ms",
        "--no-emulate",
        "--op",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--sizes",
        "--timeout",
        "--tuner-trial-calls",
        "--warmup",
    ],
    "bench fused": [
        "--backend",
        "--chunks",
        "--control",
        "--device",
        "--hosts",
        "--json",
        "--link",
        "--markdown",
        "--no-emulate",
        "--op",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--schedule",
        "--shape",
        "--step",
        "--timeout",
        "--warmup",
    ],
    "bench ddp": [
        "--algo",
        "--backend",
        "--batch-size",
        "--bucket-cap-mb",
        "--control",
        "--device",
        "--hosts",
        "--json",
        "--layers",
        "--link",
        "--markdown",
        "--model",
        "--no-emulate",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--steps",
        "--timeout",
        "--width",
    ],
    "bench pipeline": [
        "--backend",
        "--batch-size",
        "--control",
        "--device",
        "--hosts",
        "--json",
        "--layers",
        "--link",
        "--markdown",
        "--micro-batches",
        "--no-emulate",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--schedule",
        "--stages-per-rank",
        "--steps",
        "--timeout",
        "--width",
    ],
    "bench strategies": [
        "--backend",
        "--bucket-cap-mb",
        "--control",
        "--device",
        "--hosts",
        "--json",
        "--link",
        "--markdown",
        "--no-compute",
        "--no-emulate",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--seed",
        "--steps",
        "--strategy",
        "--timeout",
        "--warmup-steps",
        "--workload",
    ],
    "simulate": [
        "--algo",
        "--bucket-cap-mb",
        "--chunks",
        "--cluster",
        "--compression-gbps",
        "--compression-ratio",
        "--hosts",
        "--json",
        "--link",
        "--local-sgd-period",
        "--no-overlap",
        "--op",
        "--plot",
        "--profile",
        "--quick",
        "--ranks",
        "--repeats",
        "--runs",
        "--save-cluster",
        "--scale",
        "--sizes",
        "--straggler",
        "--strategy",
        "--trace",
        "--validate",
        "--workload",
    ],
    "train": [
        "--backend",
        "--bucket-cap-mb",
        "--chaos",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--compute-steps",
        "--device",
        "--digest-every-steps",
        "--fault-tolerant",
        "--ft-timeout",
        "--global-batch",
        "--hosts",
        "--init-from",
        "--json",
        "--link",
        "--list-strategies",
        "--lr-schedule",
        "--min-replicas",
        "--no-emulate",
        "--no-progress",
        "--nproc",
        "--ranks-per-host",
        "--replica-groups",
        "--resume",
        "--seed",
        "--steps",
        "--strategy",
        "--timeout",
        "--workload",
    ],
    "compare": [
        "--backend",
        "--bucket-cap-mb",
        "--chaos",
        "--compute-steps",
        "--control",
        "--device",
        "--digest-every-steps",
        "--fault-tolerant",
        "--ft-timeout",
        "--global-batch",
        "--hosts",
        "--init-from",
        "--json",
        "--link",
        "--lr-schedule",
        "--markdown",
        "--max-steps-factor",
        "--min-replicas",
        "--no-emulate",
        "--no-progress",
        "--nproc",
        "--plot",
        "--ranks-per-host",
        "--repeats",
        "--replica-groups",
        "--seed",
        "--steps",
        "--strategy",
        "--timeout",
        "--workload",
    ],
    "report": ["--json", "--markdown", "--plot-bytes", "--update"],
}


def flags_of(parser: argparse.ArgumentParser, command: str = "") -> dict[str, list[str]]:
    """``command -> sorted flags`` of ``parser`` and of each sub-command below it, at any depth
    (``commfuse net up``)."""
    found = {
        command: sorted(
            flag
            for action in parser._actions
            for flag in action.option_strings
            if flag not in ("-h", "--help")
        )
    }
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= flags_of(sub, f"{command} {name}".strip())
    return found


def test_no_new_cli_flags() -> None:
    found = flags_of(build_parser())
    changed = {
        command: {
            "added": sorted(set(found.get(command, [])) - set(EXPECTED.get(command, []))),
            "removed": sorted(set(EXPECTED.get(command, [])) - set(found.get(command, []))),
        }
        for command in sorted(set(found) | set(EXPECTED))
        if found.get(command) != EXPECTED.get(command)
    }
    assert not changed, (
        "the commfuse command's flags changed; a new flag changes this test on purpose: "
        f"update EXPECTED in tests/test_cli_flags_frozen.py ({changed})"
    )


def test_the_walk_finds_nested_sub_commands() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top")
    sub = parser.add_subparsers().add_parser("a").add_subparsers().add_parser("b")
    sub.add_argument("--deep", "-d")
    assert flags_of(parser) == {"": ["--top"], "a": [], "a b": ["--deep", "-d"]}
