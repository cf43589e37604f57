"""Which of torch's DDP communication hooks run on gloo, with one bucket and with many.

Run it with no arguments: for every hook, bucket cap and world size it starts one
``torchrun --standalone`` job (a small conv net, a few steps of DDP on gloo, CPU) under a
deadline, and prints one line per job:

    powerSGD_hook   bucket_cap_mb=0.05 world=3 threads=2 buckets=3   HUNG     (step 2 never finished)
    powerSGD_hook   bucket_cap_mb=25   world=3 threads=2 buckets=1   ok       (6 steps)

HUNG: a rank's watchdog fired (``--timeout``); MISMATCH: gloo saw two ranks run different
collectives at one position (it checks sizes), a failure of the same cause; REFUSED: DDP
would not register the hook (its bf16 hooks need a torch built with CUDA and NCCL 2.10+).

``--threads N`` gives gloo N worker threads instead of its default 2 (``ProcessGroupGloo``
options), which shows the cause of the hang (docs/torch-hooks-on-gloo.md). ``--json PATH``
writes the lines as records. Inside torchrun (``--worker``) it trains and prints
``STEP k`` after each step and ``BUCKETS n`` after the second (DDP has rebuilt them by then),
so a hang names its step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HOOKS = (
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "fp16_compress_wrapper(powerSGD_hook)",
    "bf16_compress_wrapper(powerSGD_hook)",
    "commfuse powersgd",
)
STEPS = 6
#: torch's PowerSGD compresses from this step on (its smallest with error feedback).
START_POWERSGD_ITER = 2


def _hook(name: str, group: Any, module: Any) -> tuple[Any, Any]:
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        return group, getattr(default_hooks, name)
    if name == "commfuse powersgd":
        from commfuse.compress import PowerSGD
        from commfuse.hooks import CompressionState, compressed_allreduce_hook

        compressor = PowerSGD(rank=2, warmup=START_POWERSGD_ITER)
        ours = CompressionState(compressor, module=module, process_group=group)
        return ours, compressed_allreduce_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=2,
        start_powerSGD_iter=START_POWERSGD_ITER,
        min_compression_rate=1.0,
    )
    if name == "batched_powerSGD_hook":
        return state, powerSGD_hook.batched_powerSGD_hook
    if name == "fp16_compress_wrapper(powerSGD_hook)":
        return state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
    if name == "bf16_compress_wrapper(powerSGD_hook)":
        return state, default_hooks.bf16_compress_wrapper(powerSGD_hook.powerSGD_hook)
    return state, powerSGD_hook.powerSGD_hook


def worker(hook_name: str, bucket_cap_mb: float, threads: int, timeout_s: float) -> None:
    import threading

    import torch
    import torch.distributed as dist
    from torch import nn

    # A hung collective never returns: a watchdog ends this rank, naming the step.
    step = -1

    def hung() -> None:
        print(f"HUNG rank={os.environ['RANK']} step={step + 1}", flush=True)
        os._exit(3)

    watchdog = threading.Timer(timeout_s, hung)
    watchdog.daemon = True
    watchdog.start()

    if threads:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._threads = threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        dist.init_process_group("gloo", pg_options=options)
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
        nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 10 * 10, 10),
    )  # fmt: skip
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state, hook = _hook(hook_name, dist.group.WORLD, model)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        if dist.get_rank() == 0:
            if step == 1:
                # DDP rebuilds its buckets in gradient order at the start of step 1.
                print(f"BUCKETS {len(ddp.reducer._get_zeros_like_grad_buckets())}")
            print(f"STEP {step}", flush=True)
    watchdog.cancel()
    dist.destroy_process_group()


def run_one(hook: str, cap: float, world: int, threads: int, timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={world}", __file__, "--worker", "--hook", hook]
    argv += ["--bucket-cap-mb", str(cap), "--threads", str(threads), "--timeout", str(timeout_s)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:  # the ranks' watchdogs failed too: torchrun ends them
        proc.terminate()
        out, _ = proc.communicate()
    hung = "HUNG " in out
    # gloo matches collectives by the order they were issued in; a different order on two
    # ranks is caught when sizes differ (and hangs when they do not).
    mismatch = "Received data size doesn't match expected size" in out
    # DDP refuses hooks named bf16_compress_* unless torch was built with CUDA and NCCL 2.10+.
    refused = "hook required CUDA 11+ and NCCL 2.10+" in out
    steps = sum(1 for line in out.splitlines() if line.startswith("STEP "))
    buckets = next((int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("BUCKETS")), 0)
    ok = proc.returncode == 0 and steps == STEPS
    status = (
        "REFUSED"
        if refused
        else "MISMATCH"
        if mismatch
        else "HUNG"
        if hung
        else "ok"
        if ok
        else "FAILED"
    )
    return {
        "hook": hook, "bucket_cap_mb": cap, "world_size": world, "gloo_threads": threads or 2,
        "buckets": buckets, "steps_done": steps, "status": status,
        "tail": "" if status == "ok" else out[-2000:],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hook", action="append", choices=HOOKS, help="default: every hook")
    parser.add_argument("--bucket-cap-mb", type=float, action="append", help="default: 0.05, 25")
    parser.add_argument("--world", type=int, action="append", help="default: 2, 3")
    parser.add_argument("--threads", type=int, default=0, help="gloo worker threads (0: its 2)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per job")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.worker:
        worker(args.hook[0], args.bucket_cap_mb[0], args.threads, args.timeout)
        return 0
    records = []
    for hook in args.hook or HOOKS:
        for cap in args.bucket_cap_mb or (0.05, 25.0):
            for world in args.world or (2, 3):
                r = run_one(hook, cap, world, args.threads, args.timeout)
                records.append(r)
                what = f"({r['steps_done']} steps)"
                if r["status"] in ("HUNG", "MISMATCH"):
                    what = f"(step {r['steps_done']} never finished)"
                print(
                    f"{hook:<38} bucket_cap_mb={cap:<5g} world={world} "
                    f"threads={r['gloo_threads']} buckets={r['buckets']:<3} {r['status']:<6} {what}",
                    flush=True,
                )
                if r["status"] == "FAILED" or (r["status"] == "HUNG" and not r["steps_done"]):
                    print(r["tail"], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
