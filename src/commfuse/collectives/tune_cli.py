"""``commfuse tune``: measure alpha, beta, gamma on a cluster, save the profile, show the choices.

commfuse tune --hosts 4 --ranks-per-host 2 --link 1gbit --out profile.json
COMMFUSE_TUNER_PROFILE=profile.json commfuse launch ...   # algo="auto" then uses it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commfuse.units import format_size, parse_sizes

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from commfuse.cluster.launch_cli import add_topology_arguments

    parser = sub.add_parser(
        "tune",
        help="calibrate alpha/beta/gamma, write a profile, print the algorithm algo='auto' picks per size",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(parser, default_hosts=4)
    parser.set_defaults(link="1gbit")
    parser.add_argument(
        "--out", default="commfuse-profile.json", help="where to write the profile JSON"
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"sizes to show choices for (default {DEFAULT_SIZES})",
    )
    parser.set_defaults(func=run_tune)


def _calibrate_on_rank() -> str:
    from commfuse.collectives.tuner import calibrate
    from commfuse.comm import Communicator

    return calibrate(Communicator()).to_json()


def run_tune(args: argparse.Namespace) -> int:
    from commfuse.cluster import DeadlineExceeded, RankError, run
    from commfuse.cluster.launch_cli import topology_from_args
    from commfuse.cluster.netlab import NetlabError
    from commfuse.collectives.registry import COLLECTIVES
    from commfuse.collectives.tuner import Profile, rank_algorithms

    try:
        topology = topology_from_args(args)
        sizes = parse_sizes(args.sizes)
    except ValueError as err:
        print(f"commfuse tune: {err}", file=sys.stderr)
        return 2
    try:
        profile_json = run(
            _calibrate_on_rank,
            net=topology,
            emulate=False if args.no_emulate else None,
            timeout_s=300,
        )[0]
    except (RankError, DeadlineExceeded, NetlabError) as err:
        print(f"commfuse tune: {err}", file=sys.stderr)
        return 1
    Path(args.out).write_text(profile_json + "\n")
    profile = Profile.from_json(profile_json)
    for name, link in (("intra-host", profile.intra), ("inter-host", profile.inter)):
        print(
            f"{name}: alpha {link.alpha_s * 1e6:.1f} us, bandwidth {1 / link.beta_s_per_byte / 1e9:.3f} GB/s, "
            f"reduction {1 / link.gamma_s_per_byte / 1e9:.2f} GB/s"
        )
    print(f"profile written to {args.out}")
    print(f"{'collective':>15} {'size':>6}  choice        predicted_us  (runner-up)")
    for collective in COLLECTIVES:
        for size in sizes:
            ranked = [
                pair
                for pair in rank_algorithms(collective, size, topology.world_size, profile)
                if pair[0] != float("inf")
            ]
            best_t, best = ranked[0]
            runner = f"{ranked[1][1]} {ranked[1][0] * 1e6:.0f}" if len(ranked) > 1 else "-"
            print(
                f"{collective:>15} {format_size(size):>6}  {best:<12} {best_t * 1e6:>12.0f}  ({runner})"
            )
    return 0
