"""``commfuse compare``: train several strategies side by side; print a table, write a plot.

commfuse compare                                   # the default: charlm, 4 hosts at 100 Mbit/s
commfuse compare --strategy ddp --strategy fp16 --strategy topk:ratio=0.01 --steps 50
commfuse compare --workload digits --nproc 2 --strategy ddp --strategy sign --json out.json
commfuse compare --fault-tolerant --strategy ddp --repeats 3 --control   # torchft's overhead
"""

from __future__ import annotations

import argparse

from commfuse.bench import compare as C
from commfuse.bench.records import to_text
from commfuse.cli.common import (
    Subparsers,
    add_command,
    add_control_argument,
    add_device_arguments,
    add_output_arguments,
    add_topology_arguments,
    backend_from_args,
    check_run_flags,
    emulate_arg,
    lr_schedule_arg,
    topology_from_args,
)
from commfuse.cli.output import write_file, write_output
from commfuse.cli.train import add_fault_tolerance_arguments, add_run_arguments

LEGEND = """\
step_ms       median time of one training step after warm-up (rank 0)
compute_ms    the same step with every gradient collective skipped: the floor
step/compute  step time over that floor (1.00 = communication fully hidden or removed)
worst/compute the slowest position of the strategy's period (median over periods) over that floor:
              local SGD's synchronising step; - = no period (SelSync, ADPSGD decide when);
              worst/bound = the same over the machine's bound of a step (where measured)
busy          share of the machine's cores the ranks kept busy during the steps (their processes
              with gloo's threads, and the kernel's packet work; not other programs): near 100%
              the step is CPU-bound, and fewer bytes cannot shorten it
MB/step       mean bytes one rank handed to collectives per step; x less = baseline's / this one's;
              peak_MB = the most in one step (a synchronisation's burst)
final_loss    training loss at the last step (mean over ranks, moving average)
held_loss     the final model's loss on the held-out split (local SGD: after the final sync);
              acc = its held-out accuracy
wall_s        the strategy's training time, start to last step
t_to_base_s   wall time until this strategy reaches the baseline's final loss (- = never)
speedup       torch DDP's mean step time / this one's; speedup_to_loss = DDP's t_to_base_s / this
              one's; (tie): within the A/A control's noise floor (--control)"""


def register(sub: Subparsers) -> None:
    parser = add_command(
        sub,
        "compare",
        _run_compare,
        help="train several strategies on the same workload; table of step time, bytes, loss",
        doc=__doc__,
    )
    add_run_arguments(parser, default_steps=C.DEFAULT_STEPS)
    add_topology_arguments(parser, default_hosts=C.DEFAULT_HOSTS, default_link=C.DEFAULT_LINK)
    add_device_arguments(parser)
    parser.add_argument(
        "--strategy",
        action="append",
        default=None,
        help="repeat, one per strategy (default: " + " ".join(C.DEFAULT_STRATEGIES) + ")",
    )
    parser.add_argument(
        "--compute-steps",
        type=int,
        default=C.DEFAULT_COMPUTE_STEPS,
        help="steps timed with communication skipped after each run (the compute-only floor)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all strategies in balanced orders (A B C D, D C B A, ...); medians over "
        "rounds of the step times, the busy share and the time to the baseline's loss",
    )
    add_control_argument(parser, what="run the baseline twice per round (NAME', a job of its own)")
    parser.add_argument(
        "--max-steps-factor",
        type=float,
        default=1.0,
        help="strategies other than the baseline may train up to this multiple of --steps to "
        "reach the baseline's final loss (t_to_base_s); all else is read at --steps",
    )
    add_fault_tolerance_arguments(parser)
    add_output_arguments(
        parser,
        json="one record per strategy",
        markdown="the table",
        plot="loss vs wall time",
        plot_default="compare.png",
    )


def _run_compare(args: argparse.Namespace) -> int:
    import torch

    from commfuse.cli.spec import strategy_from_spec, workload_from_spec
    from commfuse.train.loop import TrainConfig
    from commfuse.workloads import make_workload

    check_run_flags(args)  # named as typed, before anything starts
    if args.fault_tolerant:
        from commfuse.cli.compare_ft import run_compare_ft

        return run_compare_ft(args)
    if args.chaos:
        raise ValueError("--chaos injects faults into a --fault-tolerant run; add --fault-tolerant")
    strategies = args.strategy or list(C.DEFAULT_STRATEGIES)
    topology = topology_from_args(args, nproc=args.nproc)
    backend = backend_from_args(args, topology)  # the device checks, before any rank starts
    # Every spec is checked before any run starts.
    layout = topology.ranks_per_host
    configs = [strategy_from_spec(s, ranks_per_host=layout) for s in strategies]
    options = workload_from_spec(args.workload)
    base = TrainConfig(
        workload=options,
        strategy=configs[0],
        steps=args.steps,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        compute_steps=args.compute_steps,
        init_from=args.init_from,
        lr_schedule=lr_schedule_arg(args),
    )
    workload = make_workload(options, device=torch.device(args.device)).describe()
    print(
        f"commfuse compare: {workload}\n  on {topology.describe()}, {args.steps} steps, "
        f"seed {args.seed}, bucket cap {args.bucket_cap_mb:g} MiB, "
        f"{'' if base.lr_schedule is None else f'learning rate {args.lr_schedule}, '}"
        "strategies one after another"
        f"{' (A/A control: the baseline twice)' if args.control else ''}"
    )
    records = C.compare_strategies(
        configs,
        base,
        topology,
        repeats=args.repeats,
        control=args.control,
        max_steps_factor=args.max_steps_factor,
        emulate=emulate_arg(args),
        progress=False if args.no_progress else None,
        timeout_s=args.timeout,
        labels=[s.strip() for s in strategies],
        backend=backend,
    )
    print()
    print(C.render_table(records))
    print()
    print(LEGEND)
    print(
        f"baseline: {records[0]['baseline']}; times are medians on a shared machine, quote ratios"
    )
    from commfuse.bench.table import control_note

    rounds = (
        f"medians over {args.repeats} rounds in balanced orders"
        if args.repeats > 1
        else "one run each (--repeats R for medians over rounds)"
    )
    print(f"timings: {rounds}; losses, bytes and accuracy from the first round")
    for note in (control_note(records, "strategy"), C.cpu_bound_note(records)):
        if note:
            print(note)
    title = f"{args.workload} on {topology.describe()}"
    if args.plot:
        plotted = write_file(
            args, args.plot, lambda p: C.plot_loss_vs_time(records, p, title=title)
        )
        if plotted is not None:
            print(f"plot (loss vs wall time) written to {plotted}")
    if args.json:
        written = write_output(args, args.json, to_text("compare", records))
        print(f"records written to {written}")
    if args.markdown:
        written = write_output(
            args, args.markdown, f"# {title}\n\n{C.render_table(records, markdown=True)}\n"
        )
        print(f"markdown table written to {written}")
    return 0
