"""The simulator prices the training strategies themselves: each bucket as the strategy's own
message (its compressor's payload, on its collective), local SGD's exchange every H steps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from commfuse.cli import main
from commfuse.compress import FP16, PowerSGD, TopK
from commfuse.localsgd import diloco, local_sgd, streaming_diloco
from commfuse.sim import PRESETS, build_step, simulate_step
from commfuse.sim.builtins import transformer
from commfuse.sim.program import Task
from commfuse.train import CommfuseDPConfig, TorchDDPConfig, TorchPowerSGDConfig
from commfuse.train.sim_plan import plan_for

CLUSTER = PRESETS["netlab-1gbit"].with_ranks(8)
MODEL = transformer(num_layers=2, hidden=256, seq_len=64, batch_per_rank=2, dtype_bytes=4)


def dp_tasks(strategy: object) -> list[Task]:
    plan = plan_for(strategy, bucket_cap_mb=1.0)  # type: ignore[arg-type]
    return [t for t in build_step(CLUSTER, MODEL, plan) if t.category == "dp"]


def bucket_bytes() -> list[int]:
    """The fp32 gradient bytes of each bucket, as uncompressed torch DDP sends them."""
    return [t.nbytes for t in dp_tasks(TorchDDPConfig())]


def test_ddp_sends_every_gradient_and_its_fp16_hook_half() -> None:
    buckets = bucket_bytes()
    assert sum(buckets) == MODEL.dp_param_bytes and len(buckets) > 1
    half = [t.nbytes for t in dp_tasks(TorchDDPConfig(hook="fp16"))]
    assert half == [b // 2 for b in buckets]


def test_each_bucket_is_the_compressors_own_message() -> None:
    world = CLUSTER.world_size
    rank4 = PowerSGD(rank=4)
    tasks = dp_tasks(CommfuseDPConfig(compressor=rank4))
    # PowerSGD can turn a NaN into NaN everywhere: no agreement round; an allreduce of factors.
    assert [t.nbytes for t in tasks] == [
        rank4.payload_bytes(b // 4, torch.float32, world) for b in bucket_bytes()
    ]
    assert all(t.name.startswith("all_reduce bucket") for t in tasks)
    # top-k's messages are allgathered (S = every rank's), after a flag agreement per bucket.
    topk = TopK(ratio=0.01)
    tasks = dp_tasks(CommfuseDPConfig(compressor=topk))
    gathers = [t for t in tasks if t.name.startswith("all_gather bucket")]
    flags = [t for t in tasks if t.name.startswith("agree finite")]
    assert len(gathers) == len(flags) == len(bucket_bytes())
    assert [t.nbytes for t in gathers] == [
        world * topk.payload_bytes(b // 4, torch.float32, world) for b in bucket_bytes()
    ]
    # torch's PowerSGD hook: the same factors' bytes as commfuse's flat count.
    hook = dp_tasks(TorchPowerSGDConfig(rank=4))
    assert [t.nbytes for t in hook] == [
        t.nbytes for t in dp_tasks(CommfuseDPConfig(compressor=rank4))
    ]


def test_local_sgd_exchanges_the_model_every_h_steps() -> None:
    plan = plan_for(diloco(H=50))
    assert plan.local_sgd_period == 50
    tasks = build_step(CLUSTER, MODEL, plan)
    assert not [t for t in tasks if t.category == "dp"]  # no gradient buckets
    outer = [t for t in tasks if t.category == "outer"]
    assert [t.nbytes for t in outer] == [MODEL.dp_param_bytes]
    fp16 = plan_for(local_sgd(H=8, compressor=FP16()))
    assert [t.nbytes for t in build_step(CLUSTER, MODEL, fp16) if t.category == "outer"] == [
        MODEL.dp_param_bytes // 2
    ]
    # Streaming: a quarter of the model every H / 4 steps, the same bytes per period.
    streaming = plan_for(streaming_diloco(H=48, num_fragments=4))
    assert streaming.local_sgd_period == 12
    assert [t.nbytes for t in build_step(CLUSTER, MODEL, streaming) if t.category == "outer"] == [
        MODEL.dp_param_bytes // 4
    ]
    # Fewer bytes, less often: the predicted step gets no slower than DDP's.
    ddp = simulate_step(CLUSTER, MODEL, plan_for(TorchDDPConfig())).step_s
    assert simulate_step(CLUSTER, MODEL, plan).step_s < ddp
    with pytest.raises(ValueError, match="hierarchical"):
        plan_for(local_sgd(hierarchical=True, ranks_per_host=2))


def test_simulate_takes_training_strategy_specs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--cluster",
        "netlab-1gbit",
        "--ranks",
        "16",
        "--workload",
        "transformer:num_layers=2",
    ]
    specs = ["ddp", "powersgd:rank=4", "diloco:H=50"]
    assert main([*argv, *(a for s in specs for a in ("--strategy", s))]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in specs)
    assert main([*argv, "--strategy", "powersgd:rank=4"]) == 0
    assert "compressor=powersgd" in capsys.readouterr().out
    assert main([*argv, "--strategy", "ddp", "--algo", "ring"]) == 2
    assert "give one or the other" in capsys.readouterr().err
    assert main([*argv, "--strategy", "powersgd:rnak=4"]) == 2
    assert "unknown key 'rnak'" in capsys.readouterr().err


def test_simulates_what_if_flags_are_what_if_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--algo, --compression-ratio and --local-sgd-period are the keys of the what-if spec:
    the flags' series and the specs' predict the same steps."""
    argv = ["simulate", "--cluster", "two-dc", "--scale", "16,256", "--workload"]
    argv += ["transformer:num_layers=2", "--compression-ratio", "0.25"]
    flags, specs = tmp_path / "flags.json", tmp_path / "specs.json"
    assert main([*argv, "--local-sgd-period", "1,100", "--json", str(flags)]) == 0
    what_if = "what-if:compression_ratio=0.25"
    assert (
        main(
            [
                *argv[:-2],
                *("--strategy", what_if, "--strategy", f"{what_if},local_sgd_period=100"),
                *("--json", str(specs)),
            ]
        )
        == 0
    )
    capsys.readouterr()

    def steps(path: Path) -> list[float]:
        return [r["step_us"] for r in json.loads(path.read_text())]

    assert steps(flags) == steps(specs) and len(steps(flags)) == 4
    assert main([*argv, "--strategy", "ddp"]) == 2
    assert "--strategy what-if:" in capsys.readouterr().err
    assert main([*argv[:-2], "--strategy", "what-if:period=3"]) == 2
    assert "known keys: algo, compression_ratio, local_sgd_period" in capsys.readouterr().err


def test_the_compressed_adams_send_their_one_bit_allreduce() -> None:
    from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig
    from commfuse.optim.compressed_all_reduce import wire_bytes_per_rank
    from commfuse.train.sim_plan import OneBitMessage

    world, numel = CLUSTER.world_size, MODEL.dp_param_bytes // 4
    # 1-bit Adam: the whole momentum in one exchange after backward, whatever the bucket cap,
    # priced as an allreduce whose ring traffic is the two-phase collective's own.
    (task,) = dp_tasks(OneBitAdamConfig())
    assert task.name.startswith("all_reduce bucket")
    assert 2 * (world - 1) * task.nbytes == world * wire_bytes_per_rank(numel, world)
    assert task.nbytes < MODEL.dp_param_bytes / 16  # about 1 bit of 32 an element
    # 0/1 Adam: the same message for the accumulated update, every local_step_clipper steps.
    plan = plan_for(ZeroOneAdamConfig(local_step_clipper=8))
    assert plan.local_sgd_period == 8
    tasks = build_step(CLUSTER, MODEL, plan)
    assert not [t for t in tasks if t.category == "dp"]
    outer = [t.nbytes for t in tasks if t.category == "outer"]
    assert outer == [OneBitMessage().payload_bytes(numel, torch.float32, world)]


def test_adpsgd_is_priced_at_its_mean_period() -> None:
    from commfuse.localsgd import ADPSGDConfig

    # 9 syncs and the final average send 10 models over 1000 steps, as local SGD with H = 100;
    # without the final average 10 syncs do.
    assert plan_for(ADPSGDConfig(total_steps=1000, num_syncs=9)) == plan_for(local_sgd(H=100))
    without_final = ADPSGDConfig(total_steps=1000, num_syncs=10, final_sync=False)
    assert plan_for(without_final) == plan_for(
        dataclasses.replace(local_sgd(H=100), final_sync=False)
    )
    with pytest.raises(ValueError, match="give total_steps"):
        plan_for(ADPSGDConfig(num_syncs=10))


def test_simulate_takes_the_compressed_adams_and_adpsgd(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--cluster", "netlab-1gbit", "--ranks", "16", "--workload"]
    argv.append("transformer:num_layers=2")
    specs = ["ddp", "onebit-adam", "zeroone-adam", "adpsgd:total_steps=1000,num_syncs=10"]
    assert main([*argv, *(a for s in specs for a in ("--strategy", s))]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in specs)
    assert main([*argv, "--strategy", "onebit-adam"]) == 0
    assert "bucket=one buffer no-overlap, compressor=onebit" in capsys.readouterr().out
    assert main([*argv, "--strategy", "selsync"]) == 2
    assert "does not model selsync" in capsys.readouterr().err
