"""``commfuse launch``: run a torchrun-style script on local ranks, optionally on an emulated cluster.

commfuse launch --nproc 4 train.py --lr 0.1
commfuse launch --hosts 4 --ranks-per-host 2 --link 1gbit train.py
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from commfuse.cli.common import (
    Subparsers,
    UsageError,
    add_command,
    add_device_arguments,
    add_timeout_argument,
    add_topology_arguments,
    backend_from_args,
    emulate_arg,
    topology_from_args,
)
from commfuse.cluster.netlab import NetlabError


def register(sub: Subparsers) -> None:
    parser = add_command(
        sub,
        "launch",
        _run_launch,
        help="run a torchrun-style script on N local ranks (optionally on an emulated cluster)",
        doc=__doc__,
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="total ranks (default: hosts x ranks-per-host)",
    )
    add_topology_arguments(parser)
    add_device_arguments(parser)
    add_timeout_argument(parser, default_s=None)
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the target as a module (python -m)"
    )
    parser.add_argument(
        "--no-python", action="store_true", help="run the target as a program, not a Python script"
    )
    parser.add_argument("script", help="the script (or module, or program) every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_launch(args: argparse.Namespace) -> int:
    # The launcher imports torch: only a job that runs pays for it, not --help.
    from commfuse.cluster.launcher import launch, script_command

    # SIGTERM while the job is being set up (network, store) unwinds like Ctrl-C, so whatever was
    # built is removed; once the ranks run, the supervisor handles both signals itself.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if on_main else None
    try:
        topology = topology_from_args(args, nproc=args.nproc)
        # The script picks cuda:LOCAL_RANK itself (as under torchrun); refuse a machine that
        # has fewer GPUs than ranks per host before any rank starts.
        backend_from_args(args, topology)
        command = script_command(
            args.script, args.script_args, module=args.module, no_python=args.no_python
        )
        result = launch(command, topology, emulate=emulate_arg(args), timeout_s=args.timeout)
    except NetlabError as err:
        # The network is built before any rank starts: the job could not start (exit 2).
        raise UsageError(str(err)) from err
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    if result.interrupted:
        print("commfuse launch: interrupted; every rank was stopped", file=sys.stderr)
    elif result.failure is not None:
        # The first failure is the launcher's last word; how the others ended comes before it.
        if len(result.exit_codes) > 1:
            print(f"commfuse launch: the other ranks: {result.endings()}", file=sys.stderr)
        print(f"commfuse launch: {result.failure.describe()}", file=sys.stderr)
    return result.returncode
