"""``commfuse tune``: measure alpha, beta, gamma and every algorithm on a cluster, save the
profile, show how well the models predict and what ``algo="auto"`` picks.

commfuse tune --hosts 4 --ranks-per-host 2 --link 1gbit --save-profile profile.json
COMMFUSE_TUNER_PROFILE=profile.json commfuse launch ...   # algo="auto" then uses it

The calibration table has one row per collective, calibration size and algorithm, fastest
first: the measured time (median of the slowest rank), the pure alpha-beta-gamma model's time
and its error, and ``loo_err``, the corrected prediction's error at that size when that size is
left out of the fit (how far off the tuner is between calibration sizes). ``*`` marks the
algorithm ``algo="auto"`` picks there.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from commfuse.bench.records import to_text
from commfuse.cli.common import (
    Subparsers,
    add_job_command,
    output_path,
    require_at_least,
    run_on_ranks,
    topology_from_args,
)
from commfuse.cli.output import write_output
from commfuse.units import format_size, parse_sizes

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def register(sub: Subparsers) -> None:
    add_job_command(
        sub,
        "tune",
        _run_tune,
        help="calibrate alpha/beta/gamma and every algorithm, write a profile, print the algorithm algo='auto' picks per size",
        doc=__doc__,
        arguments=_arguments,
        device=False,
        json="the calibration table",
        markdown=None,
        timeout_s=600.0,
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    from commfuse.collectives.profile import CALIBRATION_SIZES

    calibration = ",".join(format_size(s) for s in CALIBRATION_SIZES)
    parser.add_argument(
        "--save-profile",
        metavar="PATH",
        type=output_path,
        default="commfuse-profile.json",
        help="where to write the profile JSON (then `commfuse simulate --profile PATH`, "
        "COMMFUSE_TUNER_PROFILE=PATH for algo='auto'; default commfuse-profile.json)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"sizes to show choices for (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--calibrate-sizes",
        default=calibration,
        help=f"sizes every algorithm is timed at to correct the models; 'none' skips that "
        f"(default {calibration})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per algorithm and size (3x that up to 512K); the median is used",
    )


def _calibrate_on_rank(sizes: list[int], reps: int) -> str:
    from commfuse.collectives.calibration import calibrate
    from commfuse.comm import Communicator

    return calibrate(Communicator(), sizes_bytes=sizes, reps=reps).to_json()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < float("inf") else "-"


def _print_calibration(records: list[dict[str, Any]]) -> None:
    """The calibration table (see the module docstring)."""
    print(
        f"{'collective':>15} {'size':>6}   {'algo':<18} {'measured_ms':>11} {'model_ms':>9} "
        f"{'model_err':>9} {'loo_err':>8}"
    )
    previous: tuple[str, int] | None = None
    for row in records:
        key = (row["collective"], row["bytes"])
        head = (
            f"{row['collective']:>15} {format_size(row['bytes']):>6}"
            if key != previous
            else " " * 22
        )
        previous = key
        mark = "*" if row["chosen"] else " "
        block = row.get("block_bytes")
        algo = row["algo"] + (f" b={format_size(block)}" if block else "")
        print(
            f"{head} {mark} {algo:<18} {_ms(row['measured_s']):>11} "
            f"{_ms(row['model_s']):>9} {row['model_err'] * 100:>+8.0f}% {row['loo_err'] * 100:>+7.0f}%"
        )


def _print_picks(summary: list[dict[str, Any]]) -> None:
    """What ``algo="auto"`` picks over the calibration sizes and what it costs against the
    fastest algorithm measured at each (regret: the pick's time over the fastest's, less 1)."""
    print(
        f"{'collective':>15}  {'auto picks (sizes)':<36} {'fastest':>7} {'regret median':>13} {'max':>6}"
    )
    for row in summary:
        picks = ", ".join(f"{name} {count}" for name, count in row["picks"].items())
        print(
            f"{row['collective']:>15}  {picks:<36} {row['best_picked']:>3}/{row['sizes']:<3} "
            f"{row['median_regret'] * 100:>12.1f}% {row['max_regret'] * 100:>5.1f}%"
        )


def _run_tune(args: argparse.Namespace) -> int:
    from commfuse.bench.tuner_report import describe, pick_summary
    from commfuse.collectives.profile import Profile
    from commfuse.collectives.registry import COLLECTIVES
    from commfuse.collectives.tuner import choose_for, options_for, predict

    topology = topology_from_args(args)
    sizes = parse_sizes(args.sizes)
    text = args.calibrate_sizes.strip().lower()
    calibrate_sizes = [] if text in ("", "none") else parse_sizes(args.calibrate_sizes)
    require_at_least("--repeats", args.repeats, 1)
    profile_json = run_on_ranks(
        _calibrate_on_rank, calibrate_sizes, args.repeats, topology=topology, args=args
    )[0]
    saved = write_output(args, args.save_profile, to_text("tune", json.loads(profile_json)))
    profile = Profile.from_json(profile_json)
    for name, link in (("intra-host", profile.intra), ("inter-host", profile.inter)):
        print(
            f"{name}: alpha {link.alpha_s * 1e6:.1f} us, bandwidth {1 / link.beta_s_per_byte / 1e9:.3f} GB/s, "
            f"reduction {1 / link.gamma_s_per_byte / 1e9:.2f} GB/s"
        )
    if profile.pipeline_alpha_s:
        fitted = ", ".join(f"{c} {a * 1e3:.2f} ms" for c, a in profile.pipeline_alpha_s.items())
        print(f"pipelines, fitted cost per block (sets their block size): {fitted}")
    elif profile.corrections and not profile.tuned_blocks:
        print(
            "pipelines: timed with their default block (algo='auto' does not pass "
            "choose_options' block_bytes on)"
        )
    print(f"profile written to {saved}")
    records = describe(profile)
    if records:
        print()
        _print_calibration(records)
        print()
        _print_picks(pick_summary(records))
        print()
    if args.json:
        written = write_output(args, args.json, to_text("tune calibration", records))
        print(f"calibration table written to {written}")
    world = topology.world_size
    print(
        f"{'collective':>15} {'size':>6}  {'choice':<13} {'predicted_ms':>12}  runner-up, options"
    )
    for collective in COLLECTIVES:
        for size in sizes:
            best = choose_for(collective, size, world, profile)
            opts = options_for(collective, best, size, world, profile)
            detail = "".join(f", {k}={format_size(v)}" for k, v in opts.items())
            others = sorted(
                (predict(collective, name, size, world, profile), name)
                for name in _algorithms(collective)
                if name != best
            )
            runner = f"{others[0][1]} {_ms(others[0][0])}" if others else "-"
            print(
                f"{collective:>15} {format_size(size):>6}  {best:<13} "
                f"{_ms(predict(collective, best, size, world, profile)):>12}  {runner}{detail}"
            )
    return 0


def _algorithms(collective: str) -> list[str]:
    from commfuse.collectives.registry import algorithms_for

    return list(algorithms_for(collective))
