"""``commfuse train --fault-tolerant``: the run on torchft, its faults and its accounting.

commfuse train --hosts 4 --link 100mbit --fault-tolerant --steps 100
commfuse train --hosts 4 --fault-tolerant --chaos kill:host=2,at_step=15,restart_after_s=5 --json r.json
commfuse train --hosts 4 --fault-tolerant --strategy diloco:H=20,compressor=sparseloco --steps 400
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from commfuse.bench.records import to_text
from commfuse.cli.common import emulate_arg, lr_schedule_arg, topology_from_args
from commfuse.cli.output import write_output

if TYPE_CHECKING:
    from commfuse.cluster.topology import Topology
    from commfuse.ft.config import FaultToleranceConfig


def run_train_ft(args: argparse.Namespace) -> int:
    """Build the run from the flags, train it fault-tolerantly, print and write its record.

    Raises:
        ValueError: a bad flag (replica groups that do not split the ranks, a strategy that
            runs in neither per-step nor per-period mode, a bad fault spec).
    """
    from commfuse.cli.spec import strategy_from_spec, workload_from_spec
    from commfuse.ft.periods import ft_mode
    from commfuse.train.loop import TrainConfig

    topology = replica_topology(args)
    strategy = strategy_from_spec(args.strategy, ranks_per_host=1)
    ft_mode(strategy)  # ValueError: neither mode runs it (the message lists what runs)
    for flag in ("checkpoint_dir", "resume"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} does not combine with --fault-tolerant")
    ft = fault_tolerance_from_args(args)
    ft.check_hosts(topology.num_hosts, topology.ranks_per_host)
    config = TrainConfig(
        workload=workload_from_spec(args.workload),
        strategy=strategy,
        label=f"{args.strategy.strip()} (fault-tolerant)",
        steps=args.steps,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        init_from=args.init_from,
        lr_schedule=lr_schedule_arg(args),
    )
    from commfuse.ft.launch import run_fault_tolerant

    print(f"commfuse train: {args.workload} on {topology.describe()}, {config.label} on torchft")
    record = run_fault_tolerant(
        config, ft, topology, emulate=emulate_arg(args), timeout_s=args.timeout or 3600.0
    )
    print(describe_ft_record(record))
    if args.json:
        written = write_output(args, args.json, to_text("train --fault-tolerant", record))
        print(f"metrics written to {written}")
    return 0


def replica_topology(args: argparse.Namespace) -> Topology:
    """The emulated cluster of a fault-tolerant run (its ranks make the replica groups:
    ``FaultToleranceConfig.group_layout``).

    Raises:
        ValueError: bad topology flags.
    """
    return topology_from_args(args, nproc=args.nproc)


def fault_tolerance_from_args(args: argparse.Namespace) -> FaultToleranceConfig:
    """The timeouts, quorum size, faults and global-batch rule that ``train`` and ``compare``
    take under ``--fault-tolerant``.

    Raises:
        ValueError: a bad ``--chaos`` spec or setting.
    """
    from commfuse.cli.spec import fault_from_spec
    from commfuse.ft.config import FaultToleranceConfig

    return FaultToleranceConfig(
        timeout_s=args.ft_timeout,
        min_replicas=args.min_replicas,
        faults=tuple(fault_from_spec(spec) for spec in args.chaos),
        global_batch=args.global_batch,
        digest_every_steps=args.digest_every_steps,
        num_replica_groups=args.replica_groups,
    )


def describe_ft_record(r: dict[str, Any]) -> str:
    """The record in a few lines: steps, losses, agreement and one line per fault."""
    periods = (
        f" in {r['committed_periods']} periods ({r['discarded_periods']} attempts discarded)"
        if r.get("mode") == "periodic"
        else ""
    )
    held = "" if r.get("eval_loss") is None else f", held-out loss {r['eval_loss']:.3f}"
    good = r.get("goodput_steps_per_s")
    rate = "" if good is None else f", goodput {good:.2f} committed steps/s"
    batch = r.get("global_batch", "shrink")
    waits = r.get("progress_waits") or 0
    waited = (
        f"; {waits} attempts waited for a replica holding the run's progress (progress floor)"
        if waits
        else ""
    )
    lines = [
        f"{r['committed_steps']}/{r['steps']} steps committed{periods}, {r['discarded_steps']} "
        f"discarded, {r['samples_lost']} samples lost (global batch {batch}), "
        f"final loss {r['final_loss']:.3f}{held}, {r['wall_s']:.1f} s{rate}{waited}"
        + ("" if r["step_digests_agree"] else "  (WARNING: replicas' parameters differ)")
    ]
    for e in r["events"]:

        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f} s"

        how = e["phase"] if e["kind"] == "kill" else f"for {e['for_s']:g} s"
        period = "" if e.get("period") is None else f" of period {e['period']}"
        groups = e.get("groups", [e["host"]])
        where = f"host {e['host']}" + ("" if groups == [e["host"]] else f" (groups {groups})")
        lines.append(
            f"  {e['kind']} {where} at step {e['step']}{period} ({how}): detected "
            f"{s(e['detect_s'])}, survivors committed again {s(e['recover_s'])}, rejoined "
            f"{s(e['rejoin_s'])} later"
        )
    return "\n".join(lines)
