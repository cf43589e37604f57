"""What every ``commfuse`` command shares: the cluster arguments, the runner, the error handler.

A command that runs ranks adds the one set of cluster flags (``add_topology_arguments``),
resolves them into a ``Topology`` (``topology_from_args``) and calls a function on every rank
with ``run_on_ranks``. Every command's function is wrapped by ``run_command``, the one place
that turns an exception into an exit status and a one-line message:

- 2: bad input (``ValueError``), a job that could not start (``LaunchError``) or a machine that
  cannot run the command (``UsageError``: no privileges for the emulated network); nothing
  ran, change the command or the machine;
- 1: the job ran and failed (a rank raised, a deadline passed, the emulated network broke), or
  an output file could not be written where asked (``output.py``: it went elsewhere);
- 130: interrupted (Ctrl-C);
- 141: the reader of its output went away (``| head``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from commfuse.cluster.errors import DeadlineExceeded, LaunchError, RankError
from commfuse.cluster.netlab import NetlabError, netlab_unavailable_reason
from commfuse.cluster.topology import Topology

if TYPE_CHECKING:
    from commfuse.train.lr_schedule import LRSchedule

T = TypeVar("T")


class UsageError(Exception):
    """The command cannot run here as given (e.g. no privileges to build the emulated network):
    exit status 2, before anything ran."""


#: The command's function: parsed arguments in, exit status out.
Command = Callable[[argparse.Namespace], int]

#: A ``commfuse`` sub-command parser collection (``parser.add_subparsers()``).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_topology_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_hosts: int | None = 1,
    default_link: str | None = None,
    emulate_flag: bool = True,
) -> None:
    """--hosts / --ranks-per-host / --link / --no-emulate, shared by every command that runs ranks
    (``default_hosts=None``: --hosts is required; ``emulate_flag=False``: no --no-emulate, for
    the commands that build the emulated network itself)."""
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--hosts",
        type=int,
        default=default_hosts,
        required=default_hosts is None,
        help="emulated hosts (network namespaces)",
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
        help=f"each host's link rate, each direction, e.g. 100mbit, 1gbit "
        f"(default: {default_link or 'unshaped'})",
    )
    if emulate_flag:
        group.add_argument(
            "--no-emulate",
            action="store_true",
            help="run on plain loopback even where namespaces could be built",
        )


_DEVICES = ("cpu", "cuda")
_BACKENDS = ("gloo", "nccl")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device / --backend: where every rank's tensors live and which process group moves them
    (``--device cuda``: one rank per visible GPU, rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK``,
    NCCL by default)."""
    group = parser.add_argument_group("device")
    group.add_argument(
        "--device",
        choices=_DEVICES,
        default="cpu",
        help="the ranks' device (cuda: one rank per visible GPU; default cpu)",
    )
    group.add_argument(
        "--backend",
        choices=_BACKENDS,
        default=None,
        help="the process group's backend (default: gloo on cpu, nccl on cuda)",
    )


def backend_from_args(args: argparse.Namespace, topology: Topology) -> str:
    """The backend for ``args.device`` on ``topology``, checked before any rank starts.

    UsageError when the machine cannot run it: ``--device cuda`` without CUDA (a CPU build of
    torch, or no visible GPU) or with fewer GPUs than ranks per host (each rank owns one GPU,
    ``cuda:LOCAL_RANK``); ValueError for a pair that cannot work (NCCL moves CUDA tensors only,
    and commfuse's buffers follow ``Communicator.device``, the CPU under gloo).
    """
    import torch

    device = getattr(args, "device", "cpu")
    backend = getattr(args, "backend", None) or ("nccl" if device == "cuda" else "gloo")
    if device == "cpu" and backend == "nccl":
        raise ValueError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
    if device == "cuda" and backend != "nccl":
        raise ValueError(
            f"--device cuda needs --backend nccl, got {backend} (under {backend} every buffer "
            "commfuse allocates follows Communicator.device, the CPU)"
        )
    if device == "cuda":
        if torch.version.cuda is None:
            raise UsageError(
                f"--device cuda: this torch ({torch.__version__}) is built without CUDA"
            )
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise UsageError("--device cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
        if topology.ranks_per_host > visible:
            raise UsageError(
                f"--device cuda: {topology.ranks_per_host} ranks per host need "
                f"{topology.ranks_per_host} GPUs (one each, cuda:LOCAL_RANK); "
                f"{visible} visible"
            )
    return backend


def add_timeout_argument(parser: argparse.ArgumentParser, *, default_s: float | None) -> None:
    """--timeout: the deadline of the whole job, after which every rank is stopped."""
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=default_s,
        help="stop the job after this many seconds"
        + ("" if default_s is None else f" (default {default_s:g})"),
    )


def add_bucket_cap_argument(parser: argparse.ArgumentParser) -> None:
    """--bucket-cap-mb: the gradient bucket cap, in MiB as torch DDP's ``bucket_cap_mb``."""
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="gradient bucket cap, MiB (torch DDP's bucket_cap_mb; default 25)",
    )


def output_path(text: str) -> str:
    """An output file's path (``--json``, ``--markdown``, ``--plot``), checked as the command
    line is read: a run of minutes must not end by failing to write what it measured."""
    path = Path(text).expanduser()
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file to write")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"no directory {parent} to write {path.name} in")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def _positive_seconds(text: str) -> float:
    """A duration in seconds, more than 0 (``--timeout``)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return seconds


def add_output_arguments(
    parser: argparse.ArgumentParser,
    *,
    json: str | None,
    markdown: str | None = None,
    plot: str | None = None,
    plot_default: str | None = None,
) -> None:
    """--json PATH, --markdown PATH and --plot PATH, those the command has (not None); each
    ``str`` says what the file holds (``json="one record per row"``)."""
    group = parser.add_argument_group("output")
    if json is not None:
        group.add_argument("--json", metavar="PATH", type=output_path, help=f"write {json} as JSON")
    if markdown is not None:
        group.add_argument(
            "--markdown", metavar="PATH", type=output_path, help=f"write {markdown} as Markdown"
        )
    if plot is not None:
        default = "" if plot_default is None else f" (default {plot_default})"
        group.add_argument(
            "--plot",
            metavar="PATH",
            type=output_path,
            default=plot_default,
            help=f"plot {plot}{default}",
        )


def add_control_argument(parser: argparse.ArgumentParser, *, what: str) -> None:
    """--control: the A/A control of a balanced benchmark (``what``: which variant runs twice)."""
    parser.add_argument(
        "--control",
        action="store_true",
        help=f"A/A control: {what}; the ratio of the two is the noise floor, a ratio within it "
        "is a tie",
    )


def add_command(
    sub: Subparsers, name: str, run: Command, *, help: str, doc: str | None
) -> argparse.ArgumentParser:
    """Add sub-command ``name`` that runs ``run``: ``help`` is its line in its parent's help,
    ``doc`` (its module docstring, examples first) its description, laid out as written."""
    parser = sub.add_parser(
        name,
        help=help,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    set_command(parser, run)
    return parser


def add_job_command(
    sub: Subparsers,
    name: str,
    run: Command,
    *,
    help: str,
    doc: str | None,
    arguments: Callable[[argparse.ArgumentParser], None],
    default_link: str = "1gbit",
    device: bool = True,
    control: str | None = None,
    json: str | None,
    markdown: str | None = "a dated report (table, machine, versions)",
    plot: str | None = None,
    timeout_s: float,
) -> argparse.ArgumentParser:
    """Add a command that runs one job on an emulated cluster (``bench ...``, ``tune``), with
    the flags every such command has, in one order: the cluster (4 hosts at ``default_link``),
    --device / --backend (unless ``device=False``), the command's own (``arguments(parser)``),
    --control (``control``: which variant runs twice), the outputs (``json``, ``markdown``,
    ``plot``: what each file holds, as ``add_output_arguments``; None: no such flag) and
    --timeout (``timeout_s``).
    ``doc`` is the command's description (its module docstring); ``run`` what it runs."""
    parser = add_command(sub, name, run, help=help, doc=doc)
    add_topology_arguments(parser, default_hosts=4, default_link=default_link)
    if device:
        add_device_arguments(parser)
    arguments(parser)
    if control is not None:
        add_control_argument(parser, what=control)
    add_output_arguments(parser, json=json, markdown=markdown, plot=plot)
    add_timeout_argument(parser, default_s=timeout_s)
    return parser


def require_at_least(flag: str, value: int, minimum: int) -> None:
    """ValueError naming the flag when ``value < minimum`` (checked before any rank starts)."""
    if value < minimum:
        raise ValueError(f"{flag} must be at least {minimum}, got {value}")


def check_run_flags(args: argparse.Namespace) -> None:
    """``train`` and ``compare``'s numeric flags, checked as typed (a ``TrainConfig`` would
    name its field instead of the flag), before any rank starts.

    Raises:
        ValueError: naming the first bad flag.
    """
    require_at_least("--steps", args.steps, 1)
    for flag, minimum in (
        ("--compute-steps", 0),
        ("--checkpoint-every", 0),
        ("--repeats", 1),
    ):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            require_at_least(flag, value, minimum)
    if not args.bucket_cap_mb > 0:
        raise ValueError(f"--bucket-cap-mb must be more than 0, got {args.bucket_cap_mb:g}")
    factor = getattr(args, "max_steps_factor", None)
    if factor is not None and not factor >= 1:
        raise ValueError(f"--max-steps-factor must be at least 1, got {factor:g}")
    _check_start_flags(args)


def _check_start_flags(args: argparse.Namespace) -> None:
    """``--resume`` and ``--init-from`` against their checkpoints and ``--steps``, naming the
    flags (``TrainConfig`` and ``check_start`` check the same and name their fields).

    Raises:
        ValueError: ``--resume`` without ``--checkpoint-dir`` or past ``--steps``;
            ``--init-from`` without a complete checkpoint, or at or past ``--steps``.
    """
    from commfuse.train.checkpoint import latest_step

    resume, folder = getattr(args, "resume", False), getattr(args, "checkpoint_dir", None)
    resumed = None
    if resume:
        if not folder:
            raise ValueError("--resume needs --checkpoint-dir (the run to continue)")
        resumed = latest_step(folder)
        if resumed is not None and resumed > args.steps:
            raise ValueError(
                f"--resume: the checkpoint in --checkpoint-dir {folder} is at step {resumed}, "
                f"past --steps {args.steps} (the total): give --steps {resumed} or more"
            )
    source = getattr(args, "init_from", None)
    if source is None:
        return
    step = latest_step(source)
    if step is None:
        raise ValueError(f"--init-from {source}: no complete checkpoint there")
    if resumed is None and step >= args.steps:
        raise ValueError(
            f"--init-from {source} is at step {step}: --steps (the total) must be larger, "
            f"got {args.steps}"
        )


def topology_from_args(args: argparse.Namespace, *, nproc: int | None = None) -> Topology:
    """Resolve --nproc / --hosts / --ranks-per-host / --link into a Topology (ValueError if bad)."""
    check_topology_flags(args)
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


def check_topology_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for --hosts or --ranks-per-host below 1 (the Topology would
    name its field instead)."""
    require_at_least("--hosts", args.hosts, 1)
    if args.ranks_per_host is not None:
        require_at_least("--ranks-per-host", args.ranks_per_host, 1)


def _will_shape(args: argparse.Namespace) -> bool:
    """Whether a job started with these arguments runs on an emulated (shaped) network."""
    if getattr(args, "no_emulate", False):
        return False
    return netlab_unavailable_reason() is None


def will_emulate(topology: Topology, args: argparse.Namespace) -> bool:
    """Whether ``run_on_ranks(..., topology=topology, args=args)`` runs on an emulated network:
    the decision ``cluster.placement.open_placement`` makes, known before the ranks start so the
    benchmark configs can record it."""
    from commfuse.cluster.placement import wants_emulation

    return wants_emulation(topology) and _will_shape(args)


def emulate_arg(args: argparse.Namespace) -> bool | None:
    """The launcher's ``emulate=``: False under --no-emulate, else None (emulate when useful)."""
    return False if args.no_emulate else None


def run_on_ranks(
    fn: Callable[..., T], *fn_args: Any, topology: Topology, args: argparse.Namespace
) -> list[T]:
    """``fn(*fn_args)`` on every rank of ``topology`` (emulated unless --no-emulate) on the
    backend of --device / --backend (``backend_from_args``), stopped after ``args.timeout``
    seconds; the results in rank order."""
    from commfuse.cluster import run

    return run(
        fn,
        *fn_args,
        net=topology,
        emulate=emulate_arg(args),
        timeout_s=args.timeout,
        backend=backend_from_args(args, topology),
    )


def set_command(parser: argparse.ArgumentParser, func: Command) -> None:
    """Make ``func`` the function ``parser``'s command runs; its errors carry ``parser.prog``."""
    parser.set_defaults(func=func, prog=parser.prog)


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; map its exception to an exit status and one line on stderr."""
    prog = getattr(args, "prog", "commfuse")
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a reader that left fails here, not in the interpreter's last flush
        # An output file written elsewhere than asked (``output.write_output``) fails the command.
        return 1 if status == 0 and getattr(args, "outputs_moved", False) else status
    except (ValueError, LaunchError, UsageError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except (RankError, DeadlineExceeded, NetlabError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("commfuse: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (``commfuse train --list-strategies | head``): what is left to print
        # goes nowhere, so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE


def lr_schedule_arg(args: argparse.Namespace) -> LRSchedule | None:
    """``--lr-schedule`` as a schedule (None when not given)."""
    from commfuse.cli.spec import lr_schedule_from_spec

    text = getattr(args, "lr_schedule", None)
    return None if text is None else lr_schedule_from_spec(text)
