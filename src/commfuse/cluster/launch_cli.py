"""``commfuse launch``: run a torchrun-style script on local ranks, optionally on an emulated cluster.

commfuse launch --nproc 4 train.py --lr 0.1
commfuse launch --hosts 4 --ranks-per-host 2 --link 1gbit train.py
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

from commfuse.cluster.errors import LaunchError
from commfuse.cluster.launcher import launch, script_command
from commfuse.cluster.netlab import NetlabError, netlab_unavailable_reason
from commfuse.cluster.topology import Topology


def add_topology_arguments(
    parser: argparse.ArgumentParser, *, default_hosts: int = 1, default_link: str | None = None
) -> None:
    """--hosts / --ranks-per-host / --link / --no-emulate, shared by every command that runs ranks."""
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--hosts", type=int, default=default_hosts, help="emulated hosts (network namespaces)"
    )
    group.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="ranks on each host (they share its loopback)",
    )
    group.add_argument(
        "--link",
        default=default_link,
        help=f"each host's link rate, e.g. 100mbit, 1gbit (default: {default_link or 'unshaped'})",
    )
    group.add_argument(
        "--no-emulate",
        action="store_true",
        help="run on plain loopback even where namespaces could be built",
    )


def topology_from_args(args: argparse.Namespace, *, nproc: int | None = None) -> Topology:
    """Resolve --nproc / --hosts / --ranks-per-host / --link into a Topology (ValueError if bad)."""
    ranks_per_host = args.ranks_per_host
    if nproc is not None:
        if nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {nproc}")
        if ranks_per_host is None:
            if nproc % args.hosts:
                raise ValueError(
                    f"--nproc {nproc} does not divide evenly over --hosts {args.hosts}"
                )
            ranks_per_host = nproc // args.hosts
        elif ranks_per_host * args.hosts != nproc:
            raise ValueError(
                f"--nproc {nproc} != --hosts {args.hosts} x --ranks-per-host {ranks_per_host}"
            )
    topology = Topology.from_spec(
        hosts=args.hosts, ranks_per_host=ranks_per_host or 1, link=args.link
    )
    if topology.link_mbit is not None and not _will_shape(args):
        # On plain loopback nothing caps the links: say so in every table and record (and
        # give the ranks' cost models no rate that is not there).
        topology = dataclasses.replace(topology, link_mbit=None)
    return topology


def _will_shape(args: argparse.Namespace) -> bool:
    """Whether a job started with these arguments runs on an emulated (shaped) network."""
    if getattr(args, "no_emulate", False):
        return False
    return netlab_unavailable_reason() is None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "launch",
        help="run a torchrun-style script on N local ranks (optionally on an emulated cluster)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        type=int,
        default=None,
        help="total ranks (default: hosts x ranks-per-host)",
    )
    add_topology_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop every rank after this many seconds"
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the target as a module (python -m)"
    )
    parser.add_argument(
        "--no-python", action="store_true", help="run the target as a program, not a Python script"
    )
    parser.add_argument("script", help="the script (or module, or program) every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=run_launch)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_launch(args: argparse.Namespace) -> int:
    # SIGTERM while the job is being set up (network, store) unwinds like Ctrl-C, so whatever was
    # built is removed; once the ranks run, the supervisor handles both signals itself.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if on_main else None
    try:
        topology = topology_from_args(args, nproc=args.nproc)
        command = script_command(
            args.script, args.script_args, module=args.module, no_python=args.no_python
        )
        result = launch(
            command, topology, emulate=False if args.no_emulate else None, timeout_s=args.timeout
        )
    except (ValueError, LaunchError, NetlabError) as err:
        print(f"commfuse launch: {err}", file=sys.stderr)
        return 2
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    if result.interrupted:
        print("commfuse launch: interrupted; every rank was stopped", file=sys.stderr)
    elif result.failure is not None:
        print(f"commfuse launch: {result.failure.describe()}", file=sys.stderr)
    return result.returncode
