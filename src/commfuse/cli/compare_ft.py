"""``commfuse compare --fault-tolerant``: each strategy with and without torchft, or with and
without faults (``commfuse.bench.compare_ft``).

commfuse compare --fault-tolerant --strategy ddp --repeats 3 --control
commfuse compare --fault-tolerant --strategy powersgd:rank=8 --chaos kill-every:every_s=30
"""

from __future__ import annotations

import argparse

from commfuse.bench.records import to_text
from commfuse.cli.common import emulate_arg, lr_schedule_arg
from commfuse.cli.output import write_output
from commfuse.cli.train_ft import fault_tolerance_from_args, replica_topology


def run_compare_ft(args: argparse.Namespace) -> int:
    """Build the pairs from the flags, run them in balanced rounds, print and write them.

    Raises:
        ValueError: a bad flag (replica groups that do not split the ranks, a strategy that
            fault-tolerant training refuses, a bad fault spec).
    """
    from commfuse.bench.compare import DEFAULT_STRATEGIES
    from commfuse.bench.compare_ft import LEGEND, compare_fault_tolerance, render_table
    from commfuse.bench.table import control_note
    from commfuse.cli.spec import strategy_from_spec, workload_from_spec
    from commfuse.train.loop import TrainConfig

    topology = replica_topology(args)
    specs = args.strategy or [DEFAULT_STRATEGIES[0]]
    strategies = [strategy_from_spec(s, ranks_per_host=1) for s in specs]
    if args.max_steps_factor not in (None, 1.0):
        raise ValueError("--max-steps-factor does not combine with --fault-tolerant")
    ft = fault_tolerance_from_args(args)
    base = TrainConfig(
        workload=workload_from_spec(args.workload),
        steps=args.steps,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        init_from=args.init_from,
        lr_schedule=lr_schedule_arg(args),
    )
    pairs = "with faults against without" if ft.faults else "under torchft against without"
    print(
        f"commfuse compare --fault-tolerant: {args.workload} on {topology.describe()}, "
        f"{args.steps} steps, each strategy {pairs}, {args.repeats} balanced round(s)"
        f"{' (A/A control: the first reference twice)' if args.control else ''}"
    )
    records = compare_fault_tolerance(
        strategies,
        base,
        topology,
        ft,
        repeats=args.repeats,
        control=args.control,
        emulate=emulate_arg(args),
        timeout_s=args.timeout or 3600.0,
        labels=[s.strip() for s in specs],
    )
    print()
    print(render_table(records))
    print()
    print(LEGEND)
    note = control_note(records, "run")
    if note:
        print(note)
    if args.json:
        written = write_output(args, args.json, to_text("compare --fault-tolerant", records))
        print(f"records written to {written}")
    if args.markdown:
        title = f"{args.workload} on {topology.describe()}, fault-tolerant"
        written = write_output(
            args, args.markdown, f"# {title}\n\n{render_table(records, markdown=True)}\n"
        )
        print(f"markdown table written to {written}")
    return 0
