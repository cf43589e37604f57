"""``commfuse train``: train a workload on N ranks with one strategy, with progress and metrics.

commfuse train --workload charlm --hosts 4 --link 100mbit --strategy powersgd:rank=4 --steps 100
commfuse train --workload digits --nproc 2 --strategy ddp --steps 50 --json metrics.json
commfuse train ... --checkpoint-dir ckpt --checkpoint-every 20     # then add --resume to continue
commfuse train --hosts 4 --fault-tolerant --chaos kill:host=2,at_step=15,restart_after_s=5
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from commfuse.bench.records import to_text
from commfuse.cli.common import (
    Subparsers,
    add_bucket_cap_argument,
    add_command,
    add_device_arguments,
    add_output_arguments,
    add_timeout_argument,
    add_topology_arguments,
    backend_from_args,
    check_run_flags,
    emulate_arg,
    lr_schedule_arg,
    topology_from_args,
)
from commfuse.cli.output import write_output

if TYPE_CHECKING:
    from commfuse.train.checkpoint import DifferentRun


def add_run_arguments(parser: argparse.ArgumentParser, *, default_steps: int) -> None:
    """Flags shared by ``train`` and ``compare``."""
    parser.add_argument(
        "--workload",
        default="charlm",
        help="charlm or digits, with options as NAME:key=value (e.g. charlm:dim=128,layers=2)",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="total ranks (default: hosts x ranks-per-host)"
    )
    parser.add_argument("--steps", type=int, default=default_steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    add_bucket_cap_argument(parser)
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: on a terminal)"
    )
    add_timeout_argument(parser, default_s=3600.0)
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        default=None,
        help="start from the latest model and optimizer state in this checkpoint directory "
        "(any strategy's), at its step; --steps is the total",
    )
    parser.add_argument(
        "--lr-schedule",
        metavar="SPEC",
        default=None,
        help="learning-rate schedule over the --steps total (every strategy, --fault-tolerant "
        "included): "
        "cosine[:warmup_steps=W,min_ratio=0.1], step:every_steps=K[,gamma=0.1,warmup_steps=W], "
        "constant:warmup_steps=W (default: the workload's rate throughout)",
    )


def register(sub: Subparsers) -> None:
    parser = add_command(
        sub,
        "train",
        _run_train,
        help="train a workload (charlm, digits) on N ranks with one strategy",
        doc=__doc__,
    )
    add_run_arguments(parser, default_steps=100)
    add_topology_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument(
        "--strategy",
        default="ddp",
        help="NAME[:key=value,...], e.g. ddp, ddp-powersgd:rank=4, commfuse, powersgd:rank=4 "
        "(see `commfuse train --list-strategies`)",
    )
    parser.add_argument("--list-strategies", action="store_true", help="list strategies and exit")
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save every K steps (and after the last); 0: only after the last",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from --checkpoint-dir's latest checkpoint"
    )
    parser.add_argument(
        "--compute-steps",
        type=int,
        default=0,
        help="extra steps timed with communication skipped (the compute-only floor)",
    )
    add_output_arguments(parser, json="the run's metrics")
    add_fault_tolerance_arguments(parser)


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fault-tolerant`` and its settings (``train_ft.py`` runs it)."""
    group = parser.add_argument_group("fault tolerance (torchft; pip install 'commfuse[ft]')")
    group.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="one torchft replica group per host (or --replica-groups): a replica group that "
        "dies costs the step in flight, the others go on, and it rejoins with its state from a "
        "peer (strategy ddp, a compressor's name, or a local-SGD method)",
    )
    group.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="N",
        help="split hosts x ranks-per-host ranks into N replica groups of consecutive ranks "
        "(default: one per host); a group of several ranks trains ddp inside itself and meets "
        "the others shard by shard through torchft, and dies and rejoins as one",
    )
    group.add_argument(
        "--ft-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="a peer silent this long is dead; every other timeout derives from it (default 2)",
    )
    group.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewest replica groups that may commit a step (default 1)",
    )
    group.add_argument(
        "--digest-every-steps",
        type=int,
        default=None,
        metavar="K",
        help="per-step mode: hash every replica's parameters after every K committed steps and "
        "compare them step by step (default: after the last step only)",
    )
    group.add_argument(
        "--global-batch",
        choices=("fixed", "shrink"),
        default="shrink",
        help="while a replica group is missing: fixed = the survivors train its samples too "
        "(more per step; the global batch and the data of every step stay the same), shrink = "
        "its samples are lost (the global batch shrinks with the quorum; default)",
    )
    group.add_argument(
        "--chaos",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fault to inject, repeatable: kill:host=H,at_step=S[,restart_after_s=5]"
        "[,phase=allreduce|compute], cut:host=H,at_s=T[,for_s=5], slow:host=H,link_mbit=10mbit, "
        "kill-every:every_s=30[,restart_after_s=5,seed=0]",
    )


def list_strategies() -> str:
    """Every strategy name, its line, and the keys it takes with their defaults."""
    import textwrap

    from commfuse.cli.spec import strategy_keys, strategy_listing

    indent = " " * 19
    lines = []
    for name, help in strategy_listing():
        lines.append(f"  {name:<16} {help}")
        keys = strategy_keys(name)
        if keys:
            lines += textwrap.wrap(keys, width=100, initial_indent=indent, subsequent_indent=indent)
    return (
        "strategies, each with its keys and their defaults (--strategy name:key=value,...):\n"
        + "\n".join(lines)
    )


def _run_train(args: argparse.Namespace) -> int:
    from commfuse.cli.spec import strategy_from_spec, workload_from_spec
    from commfuse.train.checkpoint import DifferentRun
    from commfuse.train.loop import TrainConfig, check_start
    from commfuse.train.runner import run_training

    if args.list_strategies:
        print(list_strategies())
        return 0
    check_run_flags(args)  # named as typed, before anything starts
    if args.fault_tolerant:
        from commfuse.cli.train_ft import run_train_ft

        return run_train_ft(args)
    if args.chaos:
        raise ValueError("--chaos injects faults into a --fault-tolerant run; add --fault-tolerant")
    topology = topology_from_args(args, nproc=args.nproc)
    backend = backend_from_args(args, topology)  # the device checks, before any rank starts
    config = TrainConfig(
        workload=workload_from_spec(args.workload),
        strategy=strategy_from_spec(args.strategy, ranks_per_host=topology.ranks_per_host),
        label=args.strategy.strip(),
        steps=args.steps,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        compute_steps=args.compute_steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        init_from=args.init_from,
        lr_schedule=lr_schedule_arg(args),
    )
    try:
        start = check_start(config, topology.world_size).said
    except DifferentRun as err:
        raise ValueError(_different_run(err)) from None
    schedule = "" if args.lr_schedule is None else f", learning rate {args.lr_schedule}"
    print(
        f"commfuse train: {args.workload} on {topology.describe()}, strategy {config.label}"
        f"{schedule}" + ("" if start is None else f"; {start}")
    )
    if topology.world_size == 1:
        print("  one rank: nothing to communicate (--nproc N or --hosts N for more ranks)")
    record = run_training(
        config,
        topology,
        emulate=emulate_arg(args),
        progress=False if args.no_progress else None,
        timeout_s=args.timeout,
        backend=backend,
    )
    print(_describe_record(record))
    if args.json:
        written = write_output(args, args.json, to_text("train", record))
        print(f"metrics written to {written}")
    return 0


#: The flag that sets each field of a checkpoint's run identity (``loop._identity``).
_IDENTITY_FLAGS = {
    "workload": "--workload",
    "strategy": "--strategy",
    "seed": "--seed",
    "world_size": "ranks (--nproc, or --hosts x --ranks-per-host)",
    "bucket_cap_mb": "--bucket-cap-mb",
    "lr_schedule": "--lr-schedule",
}


def _different_run(err: DifferentRun) -> str:
    """``--resume``'s refusal of another run's checkpoint, naming the flags that differ."""
    diffs = "; ".join(
        f"{_IDENTITY_FLAGS.get(key, key)}: {old!r} there, {new!r} now"
        for key, old, new in err.diffs
    )
    return (
        f"--resume: the checkpoint in --checkpoint-dir {err.path} is of another run ({diffs}): "
        "give the same flags, or another --checkpoint-dir"
    )


def _describe_record(r: dict[str, Any]) -> str:
    acc = "-" if r["eval_accuracy"] is None else f"{100 * r['eval_accuracy']:.1f}%"
    compute = (
        ""
        if r["compute_step_time_s"] is None
        else f" (compute only {r['compute_step_time_s'] * 1e3:.0f} ms)"
    )
    return (
        f"{r['strategy']}: {r['steps']} steps in {r['wall_s']:.1f} s, "
        f"{r['step_time_s'] * 1e3:.0f} ms/step{compute}, "
        f"{r['bytes_per_step'] / 1e6:.2f} MB/step/rank sent, final loss {r['final_loss']:.3f}, "
        f"held-out loss {r['eval_loss']:.3f}, accuracy {acc}"
        + ("" if r["ranks_agree"] else "  (WARNING: ranks' parameters differ)")
    )
