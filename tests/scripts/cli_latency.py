"""Wall time of ``commfuse`` commands end to end, each run in a fresh interpreter, across
source trees: a tool for commfuse's own developers (is a change to the command line's imports
faster?), not part of the library.

    python tests/scripts/cli_latency.py --tree old=../old/src --tree new=src --control \
        --json latency.json
    commfuse report latency.json --markdown latency.md   # the table as Markdown

What a user waits for is the whole command: the interpreter's start, every import, the work and
the exit. So each sample is one ``python -m commfuse.cli ARGS`` (or ``python -c "import X"``
for a command written ``import X``) in a new process, timed from before the spawn to after the
exit, with ``PYTHONPATH`` set to the tree's ``src``: two checkouts of commfuse (a commit and
its parent) compare like for like, on the same interpreter and packages.

1. Per command, the trees are timed in balanced rounds (``commfuse.bench.schedule``: each round
   an order and the next its reverse, Williams's carry-over balance); the first tree is the
   baseline of the ratios, each the median over rounds of the same round's ratio.
2. With ``--control`` the baseline tree is timed twice (A/A): the ratio of the two copies is
   the noise floor of this machine at this moment, and a ratio as close to 1 is marked a tie.
3. Each sample also records the CPU time (user + system) the process used: on a shared machine
   the wall time includes waits for a core, the CPU time only the work.
4. Once per command and tree, ``python -X importtime`` lists what the command imported: the
   records keep whether torch was among them and the slowest imports by cumulative time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from commfuse.bench.schedule import Schedule, run_rounds, summarize

#: Imports listed per record (``importtime_top``), slowest first by cumulative time.
IMPORTTIME_TOP = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class CliLatencyConfig:
    """What ``bench_cli_latency`` times."""

    commands: tuple[str, ...]
    """Each a ``commfuse`` argument string (``"simulate --ranks 1024"``, ``"--help"``), or
    ``"import X"`` for ``python -c "import X"``."""
    trees: tuple[tuple[str, str], ...]
    """``(name, path to a src folder)`` per source tree; the first is the baseline."""
    rounds: int = 10
    """Timed rounds per command (balanced orders)."""
    control: bool = False
    """Time the baseline tree twice (A/A)."""
    python: str = sys.executable
    """The interpreter every sample runs on."""
    timeout_s: float = 120.0
    """Limit of one sample, seconds."""
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The variables every sample starts with (the command passes its own environment);
    ``PYTHONPATH`` is the tree's ``src``, whatever this says."""

    def __post_init__(self) -> None:
        if not self.commands:
            raise ValueError("commands: give at least one command")
        if not self.trees:
            raise ValueError("trees: give at least one (name, src) tree")
        names = [name for name, _ in self.trees]
        if len(set(names)) != len(names):
            raise ValueError(f"trees: a name is given twice: {', '.join(names)}")
        for name, src in self.trees:
            if not os.path.isdir(os.path.join(src, "commfuse")):
                raise ValueError(f"trees: {name}={src} holds no commfuse package")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


def argv_of(command: str, python: str, *, importtime: bool = False) -> list[str]:
    """The process that runs ``command`` (see ``CliLatencyConfig.commands``)."""
    flags = ["-X", "importtime"] if importtime else []
    if command.startswith("import "):
        return [python, *flags, "-c", command]
    return [python, *flags, "-m", "commfuse.cli", *command.split()]


def _run(command: str, src: str, config: CliLatencyConfig, *, importtime: bool = False) -> Any:
    env = {**config.environment, "PYTHONPATH": src}
    proc = subprocess.run(
        argv_of(command, config.python, importtime=importtime),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=config.timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{command!r} on {src} exited with {proc.returncode}: {tail[0]}")
    return proc


def time_once(command: str, src: str, config: CliLatencyConfig) -> tuple[float, float]:
    """(wall, CPU) seconds of ``command`` on the tree ``src``: from spawning it to its exit, and
    the user plus system time the process used. On a shared machine the wall time also holds
    the waits for a core; the CPU time is the work alone."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    _run(command, src, config)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # samples run one at a time
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_profile(command: str, src: str, config: CliLatencyConfig) -> dict[str, Any]:
    """What ``command`` imports (``python -X importtime``): whether torch is among them, the
    microseconds its import took, and the ``IMPORTTIME_TOP`` slowest imports by cumulative
    microseconds (a module's own time plus its imports')."""
    proc = _run(command, src, config, importtime=True)
    rows: list[tuple[int, str]] = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (
            part.strip() for part in line.removeprefix("import time:").split("|")
        )
        if cumulative.isdigit():
            rows.append((int(cumulative), name))
    torch_us = next((us for us, name in rows if name == "torch"), None)
    rows.sort(reverse=True)
    return {
        "imports_torch": torch_us is not None,
        "torch_import_us": torch_us or 0,
        "num_imports": len(rows),
        "importtime_top": [{"module": n, "cumulative_us": us} for us, n in rows[:IMPORTTIME_TOP]],
    }


def _timer(
    command: str,
    schedule: Schedule,
    tree_src: dict[str, str],
    config: CliLatencyConfig,
    cpu: dict[str, list[float]],
) -> Callable[[str, int], float]:
    """``run_rounds``' function: one sample of ``command`` on the tree a name runs; its wall
    time is the sample, its CPU time goes to ``cpu[name]`` (in round order too)."""

    def sample(name: str, _round: int) -> float:
        wall, used = time_once(command, tree_src[schedule.code_of(name)], config)
        cpu.setdefault(name, []).append(used)
        return wall

    return sample


def bench_cli_latency(config: CliLatencyConfig) -> list[dict[str, Any]]:
    """One record per command and tree (and the control's copy): median wall seconds, their
    range, the paired ratio to the baseline tree, the control, the median CPU seconds and their
    paired ratio, and the import profile."""
    tree_src = dict(config.trees)
    baseline = config.trees[0][0]
    records: list[dict[str, Any]] = []
    for command in config.commands:
        schedule = Schedule(
            tuple(tree_src), rounds=config.rounds, baseline=baseline, control=config.control
        )
        cpu: dict[str, list[float]] = {}
        samples = run_rounds(schedule, _timer(command, schedule, tree_src, config, cpu))
        summary = summarize(samples, baseline=baseline, control=schedule.control_variant)
        cpu_summary = summarize(cpu, baseline=baseline, control=schedule.control_variant)
        for name in schedule.names:
            src = tree_src[schedule.code_of(name)]
            low, high = summary.ratio_ranges[name]
            ratio = summary.ratios[name]
            records.append(
                {
                    "kind": "bench cli",  # commfuse report's table (cli/report.py, KINDS)
                    "command": command,
                    "tree": name,
                    "src": src,
                    "wall_s": summary.medians[name],
                    "wall_s_min": min(samples[name]),
                    "wall_s_max": max(samples[name]),
                    "ratio_to_first": ratio,
                    "ratio_min": low,
                    "ratio_max": high,
                    "cpu_s": cpu_summary.medians[name],
                    "cpu_ratio_to_first": cpu_summary.ratios[name],
                    "tie": name != baseline and bool(summary.is_tie(ratio, variant=name)),
                    "ratio_ci": list(summary.ratio_intervals[name]),
                    "rounds": config.rounds,
                    **summary.as_dict(),
                    **import_profile(command, src, config),
                }
            )
    return records


#: Commands timed when no --command is given.
DEFAULT_COMMANDS = (
    "--help",
    "simulate --ranks 1024",
    "simulate --ranks 16384",
    "import commfuse.sim",
)


def parse_trees(texts: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=SRC`` per tree (default: ``this``, the src this commfuse runs from).

    Raises:
        ValueError: a text is not ``NAME=SRC``.
    """
    if not texts:
        import commfuse

        return (("this", str(Path(commfuse.__file__).resolve().parents[1])),)
    trees = []
    for text in texts:
        name, eq, src = text.partition("=")
        if not eq or not name.strip() or not src.strip():
            raise ValueError(f"bad --tree {text!r}: use NAME=SRC, e.g. old=../old/src")
        trees.append((name.strip(), str(Path(src.strip()).resolve())))
    return tuple(trees)


def main(argv: Sequence[str] | None = None) -> int:
    """Time the commands, print the table (``commfuse report``'s) and write ``--json``; the
    exit status (2 for a bad argument)."""
    parser = argparse.ArgumentParser(
        prog="cli_latency.py",
        description="wall time of commfuse commands end to end (fresh interpreters), "
        "across source trees",
    )
    parser.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="ARGS",
        help="commfuse arguments to time, or 'import X'; repeat (default: "
        + "; ".join(DEFAULT_COMMANDS)
        + ")",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="a source tree (the src folder of a checkout); repeat, the first is the baseline",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--control", action="store_true", help="time the first tree twice")
    parser.add_argument("--json", metavar="PATH", help="one record per command and tree")
    args = parser.parse_args(argv)
    try:
        config = CliLatencyConfig(
            commands=tuple(args.command or DEFAULT_COMMANDS),
            trees=parse_trees(args.tree),
            rounds=args.repeats,
            control=args.control,
            environment=dict(os.environ),
        )
    except ValueError as err:
        print(f"cli_latency.py: error: {err}", file=sys.stderr)
        return 2
    print(
        f"{len(config.commands)} command(s) x {len(config.trees)} tree(s), "
        f"{config.rounds} rounds (balanced orders), fresh interpreters",
        file=sys.stderr,
    )
    records = bench_cli_latency(config)
    from commfuse.cli.report import control_line, render_result

    print(render_result(records))
    note = control_line(records)
    if note:
        print(note)
    if args.json:
        from commfuse.bench.records import to_text

        Path(args.json).write_text(to_text("bench cli", records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
