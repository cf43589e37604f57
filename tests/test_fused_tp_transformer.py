"""The tensor-parallel Transformer workload (workloads/tp_transformer.py), on real process groups
of 1, 2 and 3 ranks, with and without sequence parallelism:

* the forward output and every parameter gradient equal those of a single-process dense model
  built from the same full weights (float64 reference, float32 model: atol/rtol 1e-5/1e-4);
* fused equals unfused (forward, gradients, and the parameters after two SGD steps; float32,
  sums in another order: rtol 1e-5, atol 1e-6);
* the bytes are the same: the fused step's exact point-to-point bytes, summed over ranks, equal
  what ring algorithms would send for the unfused step's native collectives (allreduce
  2(P-1)/P of its buffer per rank, allgather (P-1) times its input, reduce-scatter (P-1)/P of
  its input; gloo's own reduce-scatter is an allreduce and a slice, so on the wire the unfused
  sequence-parallel step really sends more), and the unfused step makes exactly the collectives
  Megatron's block needs;
* bad options are rejected with clear errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

from commfuse.comm import Communicator
from commfuse.fused import all_gather_gemm as agg
from commfuse.fused import gemm_all_reduce as gar
from commfuse.fused import gemm_reduce_scatter as grs
from commfuse.fused.chunking import shard_range
from commfuse.fused.modules import full_linear_weight
from commfuse.testing import RankPool
from commfuse.workloads.tp_transformer import (
    TPTransformer,
    TPTransformerConfig,
    TPTransformerWorkload,
)

PoolFn = Callable[[int], RankPool]
SEED = 3
#: 6 heads and 6 tokens divide by 1, 2 and 3 ranks; d_ff = 10 gives uneven MLP shards at P = 3.
CPU = torch.device("cpu")
SHAPE: dict[str, Any] = dict(
    d_model=12, num_heads=6, d_ff=10, num_layers=2, seq_len=6, batch=2, num_classes=5
)
FUSED_LABELS = (gar.LABEL, agg.LABEL, grs.LABEL)


def dense_reference(
    options: TPTransformerConfig, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, gradients by parameter name) of the whole model in one process, float64, from
    the full weights: plain tensors and an explicit masked softmax, no commfuse module."""
    d, f, h = options.d_model, options.d_ff, options.num_heads
    hd = d // h
    params: dict[str, torch.Tensor] = {}

    def linear(name: str, out_f: int, in_f: int, seed: int) -> None:
        w, b = full_linear_weight(out_f, in_f, seed)
        params[f"{name}.weight"] = w.double().requires_grad_(True)
        params[f"{name}.bias"] = b.double().requires_grad_(True)

    def norm(name: str) -> None:
        params[f"{name}.weight"] = torch.ones(d, dtype=torch.float64, requires_grad=True)
        params[f"{name}.bias"] = torch.zeros(d, dtype=torch.float64, requires_grad=True)

    for i in range(options.num_layers):
        seed = SEED + 10 * i
        norm(f"blocks.{i}.norm1")
        norm(f"blocks.{i}.norm2")
        linear(f"blocks.{i}.qkv", 3 * d, d, seed)
        linear(f"blocks.{i}.proj", d, d, seed + 1)
        linear(f"blocks.{i}.fc1", f, d, seed + 2)
        linear(f"blocks.{i}.fc2", d, f, seed + 3)
    norm("norm")
    linear("head", options.num_classes, d, SEED + 7)

    def lin(t: torch.Tensor, name: str) -> torch.Tensor:
        return t @ params[f"{name}.weight"].t() + params[f"{name}.bias"]

    def ln(t: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(t, (d,), params[f"{name}.weight"], params[f"{name}.bias"])

    seq, batch = x.shape[0], x.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    z = x.double()
    for i in range(options.num_layers):
        p = f"blocks.{i}"
        q, k, v = lin(ln(z, f"{p}.norm1"), f"{p}.qkv").reshape(seq, batch, h, 3, hd).unbind(3)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        heads = torch.einsum("bhst,tbhd->sbhd", attn, v).reshape(seq, batch, d)
        z = z + lin(heads, f"{p}.proj")
        z = z + lin(F.gelu(lin(ln(z, f"{p}.norm2"), f"{p}.fc1")), f"{p}.fc2")
    logits = lin(ln(z, "norm"), "head")
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
    (loss / (seq * batch)).backward()  # type: ignore[no-untyped-call]
    return logits.detach(), {n: t.grad for n, t in params.items() if t.grad is not None}


def my_shard(model: TPTransformer, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full parameter (or gradient) of the dense model."""
    module_name, _, kind = name.rpartition(".")
    module = model.get_submodule(module_name)
    if module_name.endswith((".qkv", ".fc1")):
        return full[slice(*cast("tuple[int, int]", module.out_range))]
    if module_name.endswith((".proj", ".fc2")) and kind == "weight":
        return full[:, slice(*cast("tuple[int, int]", module.in_range))]
    return full


def ring_equivalent_bytes(
    snapshot: dict[str, dict[str, int]], world: int, comm: Communicator
) -> tuple[int, int]:
    """(exact point-to-point bytes of the fused operators, ring bytes of the native collectives),
    each summed over ranks (one allreduce, after the snapshot was taken)."""
    counts = torch.tensor(
        [
            sum(snapshot.get(label, {}).get("bytes_sent", 0) for label in FUSED_LABELS),
            snapshot.get("all_reduce", {}).get("native_bytes", 0),
            snapshot.get("all_gather", {}).get("native_bytes", 0),
            snapshot.get("reduce_scatter", {}).get("native_bytes", 0),
        ],
        dtype=torch.int64,
    )
    comm.all_reduce(counts)
    exact, ar, ag, rs = (int(c) for c in counts)
    ring = (2 * (world - 1) * ar) // world + (world - 1) * ag + ((world - 1) * rs) // world
    return exact, ring


def check_block(sequence_parallel: bool, num_chunks: int) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    options = TPTransformerConfig(**SHAPE, sequence_parallel=sequence_parallel)
    workload = TPTransformerWorkload(options)
    x_full, y_full = workload.full_batch(0, seed=SEED, device=comm.device)
    want_logits, want_grads = dense_reference(options, x_full, y_full)
    rows = slice(*shard_range(options.seq_len, world, rank)) if sequence_parallel else slice(None)
    where = f"rank {rank}/{world} sp={sequence_parallel} chunks={num_chunks}"
    failures: list[str] = []
    runs = {}
    fused: bool | TPTransformer  # the loop's flag, then (below) the fused model
    for fused in (False, True):
        # gloo's own AllGather/ReduceScatter in the unfused references: their bytes are counted
        # under the collectives' names, whichever algorithm auto would pick at these sizes.
        model = workload.build_model(
            comm, SEED, fused=fused, num_chunks=num_chunks, reference_algo="native"
        )
        x, y = workload.batch(0, rank, world, seed=SEED, device=comm.device)
        comm.stats.reset()
        logits = model(x)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        ) / (options.seq_len * options.batch)
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        workload.sync_gradients(comm, model, loss)
        snapshot = comm.stats.snapshot()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[fused] = (model, logits.detach(), grads, snapshot)
        tag = f"{where} {'fused' if fused else 'unfused'}"
        if not torch.allclose(logits.double(), want_logits[rows], rtol=1e-4, atol=1e-5):
            err = (logits.double() - want_logits[rows]).abs().max()
            failures.append(f"{tag}: logits differ from the dense model by {err:.3g}")
        if len(grads) != len(want_grads):
            failures.append(f"{tag}: {len(grads)} gradients, dense model has {len(want_grads)}")
        for name, grad in grads.items():
            want = my_shard(model, name, want_grads[name])
            if grad.shape != want.shape or not torch.allclose(
                grad.double(), want, rtol=1e-4, atol=1e-5
            ):
                failures.append(f"{tag}: gradient of {name} differs from the dense model")
    (unfused, u_logits, u_grads, u_snap), (fused, f_logits, f_grads, f_snap) = (
        runs[False],
        runs[True],
    )
    if not torch.allclose(f_logits, u_logits, rtol=1e-5, atol=1e-6):
        failures.append(f"{where}: fused logits differ from unfused")
    for name, grad in f_grads.items():
        if not torch.allclose(grad, u_grads[name], rtol=1e-5, atol=1e-6):
            failures.append(f"{where}: fused gradient of {name} differs from unfused")
    # Communication: the same bytes, and exactly the collectives of Megatron's block.
    f_exact, f_ring = ring_equivalent_bytes(f_snap, world, comm)
    u_exact, u_ring = ring_equivalent_bytes(u_snap, world, comm)
    if u_exact != 0:
        failures.append(f"{where}: the unfused step used the fused operators ({u_exact} B)")
    if f_exact + f_ring != u_ring:
        failures.append(
            f"{where}: fused sent {f_exact} B (+ {f_ring} B native), unfused {u_ring} B"
        )
    layers = options.num_layers
    if world > 1 and f_exact == 0:
        failures.append(f"{where}: the fused step sent nothing through the fused operators")
    if sequence_parallel:
        # Per layer: 2 AllGathers (qkv, fc1) and 2 ReduceScatters (proj, fc2) forward, mirrored
        # in backward; plus one allreduce of the replicated gradients in both steps.
        want_calls = {"all_gather": 4 * layers, "reduce_scatter": 4 * layers, "all_reduce": 1}
        if f_snap.get("all_reduce", {}).get("calls") != 1:
            failures.append(f"{where}: fused step made {f_snap.get('all_reduce')} all_reduces")
    else:
        want_calls = {"all_reduce": 4 * layers}  # proj, fc2 forward; qkv, fc1 inputs backward
        if "all_reduce" in f_snap and world > 1:
            failures.append(f"{where}: the fused step used gloo's all_reduce")
    for kind, calls in want_calls.items():
        got = u_snap.get(kind, {}).get("calls", 0)
        if got != calls and world > 1:  # one rank: the sequence-parallel ops skip theirs
            failures.append(f"{where}: unfused step made {got} {kind}, want {calls}")
    # Two SGD steps: the models stay together.
    for model in (unfused, fused):
        opt = workload.make_optimizer(model)
        for step in range(1, 3):
            workload.train_step(
                comm, model, opt, workload.batch(step, rank, world, seed=SEED, device=comm.device)
            )
    for (name, p), q in zip(fused.named_parameters(), unfused.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            failures.append(f"{where}: parameter {name} differs after two steps")
    return failures


def automatic_chunks_and_loss_falls() -> list[str]:
    """Modules choosing their own chunks (measured) still match the unfused model, and training
    lowers the loss."""
    comm = Communicator()
    options = TPTransformerConfig(**SHAPE, lr=0.5)
    workload = TPTransformerWorkload(options)
    models = [workload.build_model(comm, SEED, fused=fused) for fused in (False, True)]
    opts = [workload.make_optimizer(m) for m in models]
    losses: list[list[float]] = [[], []]
    for step in range(25):
        batch = workload.batch(step % 4, comm.rank, comm.world_size, seed=SEED, device=comm.device)
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            losses[i].append(workload.train_step(comm, model, opt, batch))
    failures = []
    if not torch.allclose(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-4):
        failures.append(f"rank {comm.rank}: fused losses {losses[1]} vs unfused {losses[0]}")
    first, last = sum(losses[1][:4]) / 4, sum(losses[1][-4:]) / 4
    if not last < 0.8 * first:
        failures.append(f"rank {comm.rank}: loss {first:.3f} -> {last:.3f}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_block_matches_dense_and_unfused(pool: PoolFn, world: int, sequence_parallel: bool) -> None:
    failures = [
        f
        for chunks in (2, 3)
        for r in pool(world).run(check_block, sequence_parallel, chunks, timeout_s=120)
        for f in r
    ]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.e2e
def test_automatic_chunks_and_loss_falls(pool: PoolFn) -> None:
    failures = [f for r in pool(2).run(automatic_chunks_and_loss_falls, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_step_bench_records(pool: PoolFn) -> None:
    from commfuse.bench.fused_steps import StepBenchConfig, bench_steps_on_rank

    steps = ("tp-transformer", "tp-transformer-sp")
    config = StepBenchConfig(
        steps=steps, iters=2, warmup=1, chunks=2, shapes=((6, 2, 12, 6, 10, 1),)
    )
    records = pool(2).run(bench_steps_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == [f"{s}_step" for s in steps]
    for r in records:
        assert r["wrong"] == 0 and r["chunks"] == 2 and r["world_size"] == 2
        assert r["fused_vs_unfused"] == pytest.approx(r["fused_us"] / r["unfused_us"])
    with pytest.raises(ValueError, match="unknown step"):
        StepBenchConfig(steps=("tp_transformer",))


def test_batches_deterministic_and_sharded() -> None:
    sp_workload = TPTransformerWorkload(TPTransformerConfig(**SHAPE, sequence_parallel=True))
    x, y = sp_workload.full_batch(2, seed=1, device=CPU)
    assert x.shape == (6, 2, 12) and y.shape == (6, 2) and int(y.max()) < 5
    assert torch.equal(x, sp_workload.full_batch(2, seed=1, device=CPU)[0])
    assert not torch.equal(x, sp_workload.full_batch(3, seed=1, device=CPU)[0])
    parts = [sp_workload.batch(2, r, 4, seed=1, device=CPU)[0] for r in range(4)]
    assert [p.shape[0] for p in parts] == [2, 2, 1, 1] and torch.equal(torch.cat(parts), x)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="multiple of num_heads"):
        TPTransformerConfig(d_model=10, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        TPTransformerConfig(num_layers=0)
    with pytest.raises(ValueError, match="num_classes >= 2"):
        TPTransformerConfig(num_classes=1)


def build_with_four_heads() -> str:
    options = TPTransformerConfig(**{**SHAPE, "num_heads": 4})
    try:
        TPTransformerWorkload(options).build_model(Communicator(), 0)
    except ValueError as err:
        return str(err)
    return ""


def test_heads_must_divide_by_world(pool: PoolFn) -> None:
    errors = pool(3).run(build_with_four_heads, timeout_s=60)
    assert all("multiple of the world size" in e for e in errors), errors
