"""What one GPU can prove about commfuse, as one JSON report (see gpu_check.sh).

At world size 1 on NCCL with CUDA tensors: every collective of the front door by every
algorithm (the result checked against the expected pattern), each compressor's round trip
through the DataParallel engine (gradient error against the uncompressed step, finiteness) and
its cost per MB of gradient, torch's own PowerSGD DDP hook on the same model as the reference
arithmetic, and the fused modules' forward and backward. Then the training loop as a user runs
it, through the command line on the same device and backend: ``commfuse train`` (PowerSGD on a
small character Transformer, checkpointed after 3 steps, then resumed from that checkpoint to
6) and ``commfuse bench strategies`` (torch DDP, commfuse's engine, PowerSGD and local SGD on
the digits MLP in one job). Every check records ``ok`` and,
when it fails, the error, so one broken piece does not hide the others.

``--device cpu --backend gloo`` runs the same code on the CPU (a dry run, so the script is
exercised where no GPU is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Where each finished check is appended as one JSON line (set by ``check_on_rank``), so a run
#: stopped at its deadline still reports every check it finished.
_progress: Path | None = None


def _check(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        row = {"name": name, "ok": True, **fn()}
    except Exception as err:  # one failing check is a result, not the end of the report
        row = {
            "name": name,
            "ok": False,
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(limit=4),
        }
    row["seconds"] = round(time.monotonic() - started, 3)
    print(f"gpu_check: {'ok' if row['ok'] else 'FAILED'} {name} ({row['seconds']} s)", flush=True)
    if _progress is not None:
        with _progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def _collectives(comm: Any, size_bytes: int) -> list[dict[str, Any]]:
    from commfuse.bench.cases import make_case
    from commfuse.collectives import algorithms_for

    rows = []
    for op in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for algo in algorithms_for(op):

            def one(op: str = op, algo: str = algo) -> dict[str, Any]:
                case = make_case(comm, op, size_bytes, algo=algo)
                case.reset()
                case.call()
                wrong = case.count_wrong()
                if wrong:
                    raise AssertionError(f"{wrong} wrong elements")
                return {"op": op, "algo": algo, "size_bytes": case.size_bytes}

            rows.append(_check(f"collective {op} {algo}", one))
    return rows


def _model(width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _time_ms(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    from commfuse.comm.clock import now

    step()  # warm-up (the first step builds buckets and compressor state)
    times = []
    for _ in range(repeats):
        start = now(device)
        step()
        times.append((now(device) - start) * 1e3)
    return statistics.median(times)


def _compressors(comm: Any, width: int, repeats: int) -> list[dict[str, Any]]:
    import commfuse.compress as cz
    from commfuse.ddp.config import DataParallelConfig
    from commfuse.ddp.wrapper import DataParallel

    device = comm.device
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(1), device="cpu").to(device)
    plain = _model(width, device)
    plain(x).pow(2).mean().backward()
    exact = _grads(plain)
    grad_mb = exact.numel() * exact.element_size() / 2**20
    rows = []
    names = [
        n
        for n in cz.__all__
        if isinstance(getattr(cz, n), type)
        and issubclass(getattr(cz, n), cz.Compressor)
        and n not in ("Compressor", "CastCompressor", "MessageCompressor", "ErrorFeedback")
    ]
    for name in names:

        def one(name: str = name) -> dict[str, Any]:
            model = _model(width, device)
            dp = DataParallel(
                model, comm, config=DataParallelConfig(compressor=getattr(cz, name)())
            )

            def step() -> None:
                model.zero_grad(set_to_none=False)
                dp(x).pow(2).mean().backward()

            ms = _time_ms(step, device, repeats)
            got = _grads(model)
            if not bool(torch.isfinite(got).all()):
                raise AssertionError("non-finite gradient after the round trip")
            rel = float((got - exact).norm() / exact.norm())
            return {
                "compressor": name,
                "device": str(got.device),
                "relative_error": rel,
                "step_ms": ms,
                "ms_per_mb": ms / grad_mb,
            }

        rows.append(_check(f"compressor {name}", one))

    def torch_hook() -> dict[str, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        model = _model(width, device)
        # On gloo (the dry run) torch's hook runs with one bucket only: with several, the
        # collectives its callbacks start meet in a different order on different threads
        # (docs/torch-hooks-on-gloo.md), and even one rank waits for ever.
        one_bucket = {"bucket_cap_mb": 2**14} if comm.backend == "gloo" else {}
        ddp = nn.parallel.DistributedDataParallel(model, **one_bucket)
        state = ps.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=8,
            start_powerSGD_iter=2,
            use_error_feedback=True,
        )
        ddp.register_comm_hook(state, ps.powerSGD_hook)

        def step() -> None:
            model.zero_grad(set_to_none=False)
            ddp(x).pow(2).mean().backward()

        step()
        ms = _time_ms(step, device, repeats)
        return {
            "compressor": "torch powerSGD_hook rank 8",
            "step_ms": ms,
            "ms_per_mb": ms / grad_mb,
        }

    rows.append(_check("torch powerSGD_hook", torch_hook))
    return rows


def _modules(comm: Any) -> list[dict[str, Any]]:
    import commfuse.fused as fz

    device = comm.device
    rows = []
    for name in ("ColumnParallelLinear", "RowParallelLinear"):

        def linear(name: str = name) -> dict[str, Any]:
            layer = getattr(fz, name)(32, 16, comm).to(device)
            x = torch.randn(8, 32, device=device, requires_grad=True)
            layer(x).sum().backward()
            grads = [p.grad for p in layer.parameters()]
            if x.grad is None or any(g is None or g.device != x.device for g in grads):
                raise AssertionError("a gradient is missing or on another device")
            return {"module": name}

        rows.append(_check(f"module {name}", linear))

    def embedding_bag() -> dict[str, Any]:
        bag = fz.ShardedEmbeddingBag([50, 70], 8, comm).to(device)
        indices = [torch.arange(12, device=device) % 50, torch.arange(12, device=device) % 70]
        offsets = [torch.arange(0, 12, 3, device=device) for _ in range(2)]
        out = bag(indices, offsets)
        out.sum().backward()
        if out.device != device or any(p.grad is None for p in bag.parameters()):
            raise AssertionError("output on another device or a table without a gradient")
        return {"module": "ShardedEmbeddingBag", "shape": list(out.shape)}

    def moe() -> dict[str, Any]:
        layer = fz.ExpertParallelMoE(16, 32, 4, comm).to(device)
        x = torch.randn(10, 16, device=device, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        if out.device != device or x.grad is None:
            raise AssertionError("output on another device or no input gradient")
        return {"module": "ExpertParallelMoE", "shape": list(out.shape)}

    rows += [
        _check("module ShardedEmbeddingBag", embedding_bag),
        _check("module ExpertParallelMoE", moe),
    ]
    return rows


def check_on_rank(
    device_kind: str, size_bytes: int, width: int, repeats: int, progress: Path
) -> dict[str, Any]:
    from commfuse.comm import Communicator

    global _progress
    _progress = progress
    comm = Communicator()
    if comm.device.type != device_kind:
        raise RuntimeError(f"the rank's communicator is on {comm.device}, not {device_kind}")
    return {
        "device": str(comm.device),
        "backend": comm.backend,
        "gpu": torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else None,
        "checks": [
            *_collectives(comm, size_bytes),
            *_compressors(comm, width, repeats),
            *_modules(comm),
        ],
    }


#: Seconds for the whole check by default (gpu_check.sh stops it at 480), and the part of them
#: kept for the training checks, which get whatever the rank's own checks leave.
BUDGET_S = 470.0
TRAINING_RESERVE_S = 150.0


def _commfuse(argv: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    """``commfuse ARGV`` as a user runs it (the command line of this checkout's package),
    stopped at ``deadline`` (``time.monotonic()``), so the whole script keeps its budget."""
    left = deadline - time.monotonic()
    if left < 5:
        raise TimeoutError(f"no time left for commfuse {argv[0]} in the script's budget")
    done = subprocess.run(
        [sys.executable, "-m", "commfuse.cli", *argv],
        capture_output=True,
        text=True,
        timeout=left,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"commfuse {argv[0]} exited {done.returncode}: {' | '.join(tail)}")
    return done


def _training(device: str, backend: str, steps: int, deadline: float) -> list[dict[str, Any]]:
    """The training loop at world size 1 on ``device``/``backend`` (module docstring), done by
    ``deadline`` (``time.monotonic()``)."""
    flags = ["--device", device, "--backend", backend, "--no-emulate", "--timeout", "100"]
    one = [*flags, "--nproc", "1", "--no-progress"]
    work = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))

    def record(path: Path) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded

    def train_and_resume() -> dict[str, Any]:
        workload, half = "charlm:dim=64,layers=2,seq=32", str(steps // 2)
        spec = ["--workload", workload, "--strategy", "powersgd:rank=4,warmup=2"]
        ckpt, first, resumed = str(work / "ckpt"), work / "first.json", work / "resumed.json"
        _commfuse(["train", *one, *spec, "--steps", half, "--checkpoint-dir", ckpt,
                   "--json", str(first)], deadline)  # fmt: skip
        _commfuse(["train", *one, *spec, "--steps", str(steps), "--checkpoint-dir", ckpt,
                   "--resume", "--json", str(resumed)], deadline)  # fmt: skip
        a, b = record(first), record(resumed)
        for r in (a, b):
            if r["device"].split(":")[0] != device:
                raise AssertionError(f"the ranks trained on {r['device']}, not {device}")
        if b["start_step"] != int(half) or b["loss_curve"][: int(half)] != a["loss_curve"]:
            raise AssertionError(
                f"the resumed run did not continue the first (at {b['start_step']})"
            )
        return {"workload": workload, "device": b["device"], "resumed_at": b["start_step"],
                "steps": b["steps"], "step_ms": b["step_time_s"] * 1e3,
                "final_loss": b["final_loss"]}  # fmt: skip

    def strategies() -> dict[str, Any]:
        out = work / "strategies.json"
        # Warm-up past PowerSGD's first compressed steps (its factors are built there; with
        # them timed, 2 steps read about 6x the steady step on CPU).
        argv = ["bench", "strategies", *flags, "--hosts", "1", "--workload", "digits",
                "--steps", "6", "--repeats", "2", "--warmup-steps", "4", "--json", str(out)]  # fmt: skip
        for spec in ("ddp", "commfuse", "powersgd:rank=4,warmup=2", "local-sgd:H=2"):
            argv += ["--strategy", spec]
        _commfuse(argv, deadline)
        rows = json.loads(out.read_text())
        return {"step_ms": {r["strategy"]: r["step_s"] * 1e3 for r in rows}}

    return [
        _check("train charlm powersgd resume", train_and_resume),
        _check("bench strategies", strategies),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for gpu_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--size-mb", type=float, default=16.0, help="collective message size")
    parser.add_argument("--width", type=int, default=1024, help="model width (gradient size)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--train-steps", type=int, default=6, help="steps of each training run")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds for the whole check, {TRAINING_RESERVE_S:.0f} of them kept for training",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}); "
            "use --device cpu --backend gloo for the dry run",
            file=sys.stderr,
        )
        return 2
    if (args.device == "cuda") != (args.backend == "nccl"):
        print("gpu_check: --device cuda goes with --backend nccl, cpu with gloo", file=sys.stderr)
        return 2
    from commfuse.cluster import run

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / "gpu_check_progress.jsonl"
    progress.unlink(missing_ok=True)
    try:
        report = run(
            check_on_rank,
            args.device,
            int(args.size_mb * 2**20),
            args.width,
            args.repeats,
            progress,
            world_size=1,
            backend=args.backend,
            timeout_s=args.budget_s - TRAINING_RESERVE_S,
        )[0]
    except Exception as err:  # a rank that died or ran out of time: keep what it finished
        finished = [json.loads(line) for line in progress.read_text().splitlines()]
        stopped = {"name": "rank checks", "ok": False, "error": f"{type(err).__name__}: {err}"}
        report = {"device": args.device, "backend": args.backend, "checks": [*finished, stopped]}
    report["checks"] += _training(
        args.device, args.backend, args.train_steps, deadline=started + args.budget_s
    )
    report["torch"] = torch.__version__
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    report["failed"] = failed
    from commfuse.bench.records import to_text

    (args.out / "gpu_check.json").write_text(to_text("gpu check", report))
    print(
        f"gpu_check: {len(report['checks']) - len(failed)}/{len(report['checks'])} checks "
        f"passed on {report['device']} ({report['backend']}); report in {args.out}/gpu_check.json"
    )
    for name in failed:
        print(f"  FAILED {name}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
