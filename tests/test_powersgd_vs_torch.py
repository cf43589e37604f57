"""commfuse's PowerSGD held against torch's ``powerSGD_hook``, on the same gradients.

Two ranks on gloo, one DDP bucket (torch's hook can hang on gloo with several:
docs/torch-hooks-on-gloo.md). Every rank builds the same MLP four times behind torch DDP:
torch's hook (``PowerSGDState``), and commfuse's ``compressed_allreduce_hook`` with
``PowerSGD`` in the paper's error memory, in torch's (``error_memory="averaged"``,
``orthonormalize_q=True``), and in the paper's with Q orthonormalised. No optimizer step is
taken, so the weights never move and each step's gradients are the same in every copy; a
fifth copy without DDP gives each rank's own gradients, from which the test computes the
paper's step by hand.

Settings where torch's hook and commfuse do the same arithmetic: rank 4 (torch orthonormalises
with Gram-Schmidt at rank 2 or less, commfuse always with QR), torch's
``min_compression_rate=1`` (commfuse's rule), two ranks (torch orthonormalises the summed P,
commfuse the averaged one: the same bits when the world size is a power of two), matrices of
at least 400 multiply-adds per product (below that torch's batched ``bmm`` takes another CPU
kernel than ``mm``). The first Q is not drawn the same way (torch seeds a numpy generator per
state, commfuse per bucket), so the test puts the same Q into both before the first
compressed step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from commfuse.cli.spec import compressor_from_spec
from commfuse.compress import PowerSGD
from commfuse.hooks import CompressionState, compressed_allreduce_hook

RANK = 4
WARMUP = 2  # torch's hook needs 2 or more with error feedback (DDP rebuilds its buckets at 1)
STEPS = 6
#: commfuse's settings beside torch's hook: name -> PowerSGD options.
COMMFUSE: dict[str, dict[str, Any]] = {
    "local": {},
    "averaged": {"error_memory": "averaged", "orthonormalize_q": True},
    "local+orthonormal_q": {"orthonormalize_q": True},
}


def mlp() -> nn.Module:
    """Weights (32, 24), (32, 32) twice (one batched group) and (2, 32) (plain: rank-2 factors
    would not be smaller), and three biases, all in one bucket."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2),
    )  # fmt: skip


def compressed(shape: torch.Size) -> bool:
    """Whether PowerSGD (both) sends a tensor of ``shape`` as factors: torch's
    ``_should_compress`` with ``min_compression_rate=1``."""
    rows = shape[0]
    cols = math.prod(shape) // rows
    return len(shape) >= 2 and (rows + cols) * min(RANK, rows, cols) < rows * cols


@contextlib.contextmanager
def counting_all_reduce(group: dist.ProcessGroup, sizes: list[int]) -> Iterator[None]:
    """Append the bytes of every ``dist.all_reduce`` on ``group`` to ``sizes`` (torch's hook
    calls it through the module attribute, so wrapping it sees every call)."""
    original: Callable[..., Any] = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is group:
            sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def side_by_side() -> dict[str, Any]:
    """Per step, each copy's output gradients by parameter name and the bytes and calls each
    allreduced; the rank's own gradients; the Q put into all before the first compressed step
    (by name, ``cols x rank``); after each step, each hook's error and warm-start Q."""
    rank = dist.get_rank()
    names = [name for name, _ in mlp().named_parameters()]
    plain = mlp()
    models = {"torch": mlp(), **{key: mlp() for key in COMMFUSE}}
    ddps = {key: DistributedDataParallel(model) for key, model in models.items()}
    torch_group = dist.new_group(ranks=list(range(dist.get_world_size())))
    torch_state = torch_powersgd.PowerSGDState(
        process_group=torch_group,
        matrix_approximation_rank=RANK,
        start_powerSGD_iter=WARMUP,
        min_compression_rate=1,
    )
    ddps["torch"].register_comm_hook(torch_state, torch_powersgd.powerSGD_hook)
    states = {}
    for key, options in COMMFUSE.items():
        compressor = PowerSGD(rank=RANK, warmup=WARMUP, algo="native", **options)
        states[key] = CompressionState(compressor, module=models[key])
        ddps[key].register_comm_hook(states[key], compressed_allreduce_hook)
    out: dict[str, Any] = {"own": [], "q": {}, **{key: [] for key in ddps}}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 24, generator=gen), torch.randn(16, 2, generator=gen)
        if step == WARMUP:
            out["q"] = put_first_q(torch_state, [s.compressor for s in states.values()])
        plain.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        out["own"].append(grads_of(plain))
        for key, ddp in ddps.items():
            ddp.zero_grad()
            if key == "torch":
                sizes: list[int] = []
                with counting_all_reduce(torch_group, sizes):
                    nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
                sent: tuple[int, ...] = (sum(sizes), len(sizes))
                error, q = torch_state.error_dict.get(0), torch_state.q_memory_dict.get(0)
            else:
                stats = states[key].comm.stats
                before = stats.snapshot().get("all_reduce", {"native_bytes": 0, "calls": 0})
                nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
                after = stats.snapshot()["all_reduce"]
                sent = tuple(after[k] - before[k] for k in ("native_bytes", "calls"))
                error, q = state_of(states[key].compressor)
            out[key].append(
                {
                    "grads": grads_of(models[key]),
                    "sent": sent,
                    "error": None if error is None else error.clone(),
                    "q": None if q is None else q.clone(),
                }
            )
    out["names"] = names
    layout = states["local"].compressor.layouts[0]
    out["layout"] = list(zip(layout.names, layout.shapes, strict=True))
    return out


def state_of(compressor: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Bucket 0's residual and warm-start Q (None before the first compressed step)."""
    assert isinstance(compressor, PowerSGD)
    key = compressor._state_key(0)
    return compressor.feedback.residuals.get(key), compressor.qs.get(key)


def by_name(flat: torch.Tensor, layout: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    """A flat bucket-sized tensor (a residual) cut into its parameters' shapes."""
    parts, at = {}, 0
    for name, shape in layout:
        parts[name] = flat[at : at + shape.numel()].view(shape)
        at += shape.numel()
    return parts


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def put_first_q(
    torch_state: torch_powersgd.PowerSGDState, compressors: list[Any]
) -> dict[str, torch.Tensor]:
    """Give torch's hook and every compressor the same first Q (a normal draw, the same on
    every rank), laid out by commfuse's plan of the bucket; torch's hook lays its Q's out in
    the same order (by shape, then bucket order), which the bitwise comparison confirms."""
    first = compressors[0]
    layout = first.layouts[0]
    plan = first._plan_of(layout)
    flat = torch.randn(plan.q_numel, generator=torch.Generator().manual_seed(7))
    for compressor in compressors:
        assert compressor.layouts[0] == layout
        compressor.qs[compressor._state_key(0)] = flat.clone()
    torch_state.q_memory_dict[0] = flat.clone()
    torch_state.p_memory_dict[0] = torch.empty(plan.p_numel)  # present: no random draw
    by_name = {}
    for index, (start, numel, group) in plan.factor_slices("q").items():
        by_name[layout.names[index]] = flat[start : start + numel].view(group.cols, group.rank)
    return by_name


def near(got: torch.Tensor, want: torch.Tensor, tol: float, scale: float) -> None:
    """``got`` equals ``want`` to ``tol`` of each element or of ``scale`` (the tensor's size)."""
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)


def paper_step(
    ms: list[torch.Tensor], q: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One PowerSGD step by hand (Vogels et al. 2019, Algorithm 1) on every rank's ``M``
    (``rows x cols``) from ``q``: the averaged output ``P Q^T``, each rank's local error
    ``M_r - P Q_r^T``, and the averaged Q (the next step's warm start)."""
    p = sum(m @ q for m in ms) / len(ms)
    p = torch.linalg.qr(p, mode="reduced").Q
    qs = [m.T @ p for m in ms]
    q_avg = sum(qs) / len(ms)
    return p @ q_avg.T, [m - p @ qr.T for m, qr in zip(ms, qs, strict=True)], q_avg


def test_powersgd_against_torch_powersgd_hook(pool: Any) -> None:
    """What each side sends, outputs and keeps, step by step:

    * bytes: every step, commfuse's hook allreduces exactly the bytes torch's hook does, in
      every setting: the whole bucket in the warm-up, then plain elements + P's + Q's (torch
      in three allreduces, commfuse in two: the plain elements ride with the P's);
    * warm-up: all outputs equal the plain average bitwise;
    * paper's error memory (``local``): on each compressed step the output and each rank's
      error are the paper's step computed by hand from the same Q and the same ``M`` (own
      gradient + own error, carried by hand); with Q orthonormalised, the same up to rounding;
    * torch's (``averaged`` + ``orthonormalize_q``): output, error and warm-start Q equal
      torch's hook's bitwise at every step;
    * the two memories give the same output up to rounding (the step is linear in the ranks'
      average of ``M`` and both keep the same sum of errors over the ranks) but different
      errors on each rank: torch's holds the rank's deviation from the average, also on the
      elements sent exactly.
    """
    check_side_by_side(pool(2).run(side_by_side, timeout_s=120))


def check_side_by_side(ranks: list[dict[str, Any]]) -> None:
    """The assertions of ``test_powersgd_against_torch_powersgd_hook`` on both ranks' results."""
    names, layout = ranks[0]["names"], ranks[0]["layout"]
    for result in ranks:
        for step in range(STEPS):
            torch_sent = result["torch"][step]["sent"]
            for key in COMMFUSE:
                sent = result[key][step]["sent"]
                assert sent[0] == torch_sent[0], (key, step, sent, torch_sent)
                assert sent[1] == (1 if step < WARMUP else 2), (key, step, sent)
            assert torch_sent[1] == (1 if step < WARMUP else 3), (step, torch_sent)
        numel = sum(shape.numel() for _, shape in layout)
        factors = sum(
            (s[0] + s.numel() // s[0]) * RANK if compressed(s) else s.numel() for _, s in layout
        )
        assert result["torch"][0]["sent"][0] == 4 * numel
        assert result["torch"][WARMUP]["sent"][0] == 4 * factors < 4 * numel / 2

    # Warm-up: the plain average, bitwise, everywhere.
    for step in range(WARMUP):
        for name in names:
            want = (ranks[0]["own"][step][name] + ranks[1]["own"][step][name]) / 2
            for result in ranks:
                for key in ("torch", *COMMFUSE):
                    assert torch.equal(result[key][step]["grads"][name], want), (key, step, name)

    # Paper's error memory, by hand from the same Q and M = g + e.
    q = dict(ranks[0]["q"])
    errors: dict[str, list[torch.Tensor]] = {}
    for step in range(WARMUP, STEPS):
        kept = [by_name(result["local"][step]["error"], layout) for result in ranks]
        kept_by_torch = [by_name(result["averaged"][step]["error"], layout) for result in ranks]
        for name, shape in layout:
            gs = [result["own"][step][name] for result in ranks]
            if not compressed(shape):
                want = (gs[0] + gs[1]) / 2
                own_errors = [torch.zeros(shape)] * 2  # sent exactly: no error kept
            else:
                ms = [g.reshape(shape[0], -1) for g in gs]
                if name in errors:
                    ms = [m + e for m, e in zip(ms, errors[name], strict=True)]
                out, errors[name], q[name] = paper_step(ms, q[name])
                want = out.view(shape)
                own_errors = [e.view(shape) for e in errors[name]]
            # The same arithmetic as the hand's up to fused products (addmm): 1e-5 of the
            # output's size; other arithmetic for the same subspace (Q orthonormalised first):
            # 1e-4, rounding amplified by the spread of M Q's columns.
            scale = float(want.abs().max())
            for r, result in enumerate(ranks):
                got = result["local"][step]["grads"][name]
                near(got, want, 1e-5, scale)
                near(kept[r][name], own_errors[r], 1e-5, scale)
                near(result["local+orthonormal_q"][step]["grads"][name], got, 1e-4, scale)
                near(result["averaged"][step]["grads"][name], got, 1e-4, scale)
            # Same sum over the ranks, different shares (errors are the size of M, not of the
            # output: measured against their own size).
            size = max(float(e[name].abs().max()) for e in (*kept, *kept_by_torch))
            ours, torchs = (
                kept[0][name] + kept[1][name],
                kept_by_torch[0][name] + kept_by_torch[1][name],
            )
            near(ours, torchs, 1e-4, size)
            apart = float((kept[0][name] - kept_by_torch[0][name]).abs().max())
            assert apart > 0.1 * size, (step, name, apart, size)

    # Torch's error memory: bitwise torch's hook, output and state.
    for result in ranks:
        for step in range(WARMUP, STEPS):
            mine, torch_hook = result["averaged"][step], result["torch"][step]
            for name in names:
                assert torch.equal(mine["grads"][name], torch_hook["grads"][name]), (step, name)
            assert torch.equal(mine["error"], torch_hook["error"]), step
            assert torch.equal(mine["q"], torch_hook["q"]), step


def test_torch_error_memory_from_a_spec_and_only_for_powersgd() -> None:
    """The command line reaches both settings; a bad value names the choices; ACP-SGD, which
    keeps its factors as they are, refuses them rather than ignore them."""
    got = compressor_from_spec("powersgd:rank=4,error_memory=averaged,orthonormalize_q=1")
    assert got == PowerSGD(rank=4, error_memory="averaged", orthonormalize_q=True)
    assert PowerSGD(warmup_rank=8, error_memory="averaged").warmup_compressor == PowerSGD(
        rank=8, warmup=0, error_memory="averaged"
    )
    with pytest.raises(ValueError, match="local, averaged"):
        compressor_from_spec("powersgd:error_memory=torch")
    with pytest.raises(ValueError, match="acpsgd: error_memory and orthonormalize_q"):
        compressor_from_spec("acpsgd:orthonormalize_q=1")
