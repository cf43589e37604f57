"""Compressor state follows its parameters when buckets are laid out anew.

Two equal-size buckets whose order is swapped have the same indices and sizes but hold each
other's parameters: state keyed by bucket index would hand one layer's residual (momentum,
PowerSGD factors) to the other. Each test runs a model twice, once with the layout swapped
after step 0 and once without, and requires the same gradients bit for bit.

(No ``from __future__ import annotations``: DDP rejects a hook with string annotations.)
"""

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket  # = dist.GradBucket, visible to mypy
from torch.nn.parallel import DistributedDataParallel

from commfuse.cli.spec import compressor_from_spec
from commfuse.comm import Communicator
from commfuse.compress import BucketLayout
from commfuse.compress.lowrank import plan_for
from commfuse.ddp import DataParallel, DataParallelConfig
from commfuse.hooks import CompressionState, compressed_allreduce_hook

TINY_MB = 1e-6  # a 1-byte cap: one parameter per bucket

#: Compressors whose step-0 message does not depend on the bucket's index (random draws and
#: initial factors are seeded by it), with state that a swap would misapply.
STATEFUL = [
    "topk:ratio=0.25",
    "dgc:ratio=0.25,momentum=0.5",
    "ef-sign",
    "int8",
    "fp16:ef=1",
    "powersgd:rank=2,warmup=0",
    "acpsgd:rank=2,warmup=0",
]


class Twins(nn.Module):
    """Two layers of the same shape (equal-size buckets); ``swap_order`` registers them in the
    other order, which is what makes torch DDP rebuild its buckets swapped."""

    def __init__(self, swap_order: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        a, b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        if swap_order:
            self.b, self.a = b, a
        else:
            self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(torch.tanh(self.b(x)))
        return out


def _data(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    return [torch.randn(4, 8, generator=gen) for _ in range(steps)]


def _grads(net: Twins) -> torch.Tensor:
    grads = [net.a.weight.grad, net.b.weight.grad]
    return torch.cat([g.reshape(-1) for g in grads if g is not None]).clone()


def engine_run(spec: str, swap: bool, steps: int = 4) -> list[torch.Tensor]:
    """DataParallel, one layer per bucket; ``swap``: the buckets trade places after step 0
    (``Reducer.set_layout``, what ``merge_buckets_by_cost`` and a resume call)."""
    net = Twins()
    config = DataParallelConfig(
        compressor=compressor_from_spec(spec, algo="native", gather_algo="native"),
        bucket_cap_mb=TINY_MB,
        first_bucket_cap_mb=TINY_MB,
    )
    dp = DataParallel(net, config=config)
    assert [len(b.params) for b in dp.reducer.buckets] == [1, 1]
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    out = []
    for step, x in enumerate(_data(steps)):
        if swap and step == 1:
            dp.reducer.set_layout(list(reversed(dp.reducer.groups)))
        dp(x).pow(2).sum().backward()
        out.append(_grads(net))
        dp.step(opt)
        opt.zero_grad()
    dp.close()
    return out


def engine_swap(specs: list[str]) -> dict[str, list[bool]]:
    result = {}
    for spec in specs:
        plain, swapped = engine_run(spec, False), engine_run(spec, True)
        result[spec] = [torch.equal(p, s) for p, s in zip(plain, swapped, strict=True)]
    return result


#: Stateless controls: a swap alone must not change them either.
CONTROLS = ["none", "fp16"]


@pytest.mark.slow
def test_engine_state_follows_swapped_buckets(pool: Any) -> None:
    for per_rank in pool(2).run(engine_swap, CONTROLS + STATEFUL, timeout_s=120):
        for spec, same in per_rank.items():
            assert same == [True] * len(same), spec


def hook_run(spec: str, rebuild_swaps: bool, steps: int = 4) -> dict[str, Any]:
    """torch DDP with our hook, one layer per bucket. DDP buckets parameters in reverse
    registration order and rebuilds them in gradient-arrival order (a, then b) after iteration
    0: registered a then b, its two equal-size buckets trade places; b then a, they stay."""
    net = Twins(swap_order=not rebuild_swaps)
    ddp = DistributedDataParallel(net, bucket_cap_mb_list=[TINY_MB])  # type: ignore[list-item]
    comp = compressor_from_spec(spec, algo="native", gather_algo="native")
    state = CompressionState(comp, module=net)
    layouts: list[list[list[int]]] = []

    def hook(state: CompressionState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0:
            layouts.append([])
        layouts[-1].append([int(p is net.a.weight) for p in bucket.parameters()])
        return compressed_allreduce_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for x in _data(steps):
        ddp(x).pow(2).sum().backward()
        grads.append(_grads(net))
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "layouts": layouts}


def hook_swap(specs: list[str]) -> dict[str, Any]:
    result = {}
    for spec in specs:
        stays, swaps = hook_run(spec, False), hook_run(spec, True)
        result[spec] = {
            "layouts": (stays["layouts"], swaps["layouts"]),
            "same": [
                torch.equal(p, s) for p, s in zip(stays["grads"], swaps["grads"], strict=True)
            ],
        }
    return result


#: The hook's step-0 bucket indices differ between the two registration orders, so only the
#: compressors whose step 0 ignores the index compare bitwise.
HOOK_STATEFUL = ["topk:ratio=0.25", "dgc:ratio=0.25,momentum=0.5", "ef-sign", "int8"]


def test_hook_state_follows_ddp_bucket_rebuild(pool: Any) -> None:
    for per_rank in pool(2).run(hook_swap, HOOK_STATEFUL, timeout_s=120):
        for spec, r in per_rank.items():
            stays, swaps = r["layouts"]
            # 1 marks layer a: DDP's rebuild swapped the buckets of one model, not the other's.
            assert stays[0] == stays[1] == [[1], [0]], stays
            assert swaps[0] == [[0], [1]] and swaps[1] == [[1], [0]], swaps
            assert r["same"] == [True] * len(r["same"]), spec


def per_parameter(state: dict[str, Any], store: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each parameter's slice of an element-wise store (residuals, velocities), by name, read
    from a checkpoint's ``layouts``."""
    out = {}
    for key, tensor in store.items():
        layout = BucketLayout.from_state(state["layouts"][key])
        for name, (offset, numel) in layout.slices.items():
            out[name] = tensor[offset : offset + numel].clone()
    return out


def q_per_matrix(state: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """Each matrix's Q from a PowerSGD checkpoint, by parameter name."""
    out = {}
    for key, q in state["qs"].items():
        layout = BucketLayout.from_state(state["layouts"][key])
        for index, (start, numel, _) in plan_for(layout.shapes, rank).factor_slices("q").items():
            out[layout.names[index]] = q[start : start + numel].clone()
    return out


def _store(state: dict[str, Any], what: str) -> dict[str, torch.Tensor]:
    store: dict[str, torch.Tensor] = (
        state["feedback"]["residuals"] if what == "feedback" else state.get(what, {})
    )
    return store


def engine_merge(spec: str) -> dict[str, Any]:
    """One step on two buckets, then both parameters in one bucket and back: every residual,
    momentum and Q must be where its parameter went, unchanged."""
    net = Twins()
    comp = compressor_from_spec(spec, algo="native", gather_algo="native")
    config = DataParallelConfig(compressor=comp, bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)
    dp = DataParallel(net, config=config)
    x = _data(1)[0]
    dp(x).pow(2).sum().backward()
    before = comp.state_dict()
    split = [list(g) for g in dp.reducer.groups]
    states = []
    for groups in ([split[0] + split[1]], split):
        dp.reducer.set_layout(groups)
        states.append(comp.state_dict())
    out: dict[str, Any] = {"num_keys": [len(s["feedback"]["residuals"]) for s in states]}
    for what in ("feedback", "velocities"):
        want = per_parameter(before, _store(before, what))
        out[what] = [
            sorted(want) == sorted(got := per_parameter(s, _store(s, what)))
            and all(torch.equal(want[n], got[n]) for n in want)
            for s in states
        ]
    if "qs" in before:
        want = q_per_matrix(before, 2)
        out["qs"] = [
            sorted(want) == sorted(got := q_per_matrix(s, 2))
            and all(torch.equal(want[n], got[n]) for n in want)
            for s in states
        ]
    dp(x).pow(2).sum().backward()  # the moved state is used: a step runs on the split layout
    stats = dp.last_stats
    assert stats is not None
    out["moves"] = (stats.state_moved_numel, stats.state_dropped_numel)
    dp.close()
    return out


def engine_merges(specs: list[str]) -> dict[str, Any]:
    return {spec: engine_merge(spec) for spec in specs}


def test_engine_state_moves_element_by_element_into_merged_buckets(pool: Any) -> None:
    specs = ["topk:ratio=0.25", "dgc:ratio=0.25,momentum=0.5", "powersgd:rank=2,warmup=0"]
    for per_rank in pool(2).run(engine_merges, specs, timeout_s=120):
        for spec, r in per_rank.items():
            assert r["num_keys"] == [1, 2], (spec, r)  # the old buckets' state is gone
            assert r["feedback"] == [True, True], (spec, r)
            if spec.startswith("dgc"):
                assert r["velocities"] == [True, True], (spec, r)
            if spec.startswith("powersgd"):
                assert r["qs"] == [True, True], (spec, r)
            per_move = {"topk": 128, "dgc": 256, "powersgd": 128 + 2 * 8 * 2}[spec.split(":")[0]]
            assert r["moves"] == (2 * per_move, 0), (spec, r)  # merged, then split: no drops


def checkpoint_into_another_layout(spec: str) -> bool:
    """A checkpoint taken with two buckets, loaded (``weights_only=True``) into a compressor
    laid out as one: the merged bucket's state is the two old ones side by side."""
    comm = Communicator()
    shapes = [("b.weight", (8, 8)), ("a.weight", (8, 8))]
    first = compressor_from_spec(spec, algo="native", gather_algo="native")
    for bucket, named in enumerate(shapes):
        first.set_layout(bucket, BucketLayout.of([named]))
    gen = torch.Generator().manual_seed(comm.rank)
    for step in range(2):
        for bucket in range(2):
            first.reduce_(comm, torch.randn(64, generator=gen), bucket=bucket, step=step)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    merged = compressor_from_spec(spec, algo="native", gather_algo="native")
    merged.set_layout(0, BucketLayout.of(shapes))
    merged.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    want = first.feedback.residuals
    got = merged.feedback.residuals[merged.layouts[0].key]
    old = [want[first.layouts[b].key] for b in range(2)]
    return len(merged.feedback.residuals) == 1 and torch.equal(got, torch.cat(old))


def checkpoints_into_another_layout(specs: list[str]) -> list[bool]:
    return [checkpoint_into_another_layout(spec) for spec in specs]


def test_checkpoint_loads_into_another_layout(pool: Any) -> None:
    specs = ["topk:ratio=0.25", "dgc:ratio=0.25", "powersgd:rank=2,warmup=0"]
    results = pool(2).run(checkpoints_into_another_layout, specs, timeout_s=60)
    assert results == [[True] * len(specs)] * 2
