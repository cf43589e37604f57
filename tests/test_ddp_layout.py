"""The engine's pure parts, in one process: bucket layout (against torch's own assignment),
MG-WFBP merging, and config validation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commfuse.ddp import DataParallelConfig, assign_buckets, merge_by_cost


@pytest.mark.parametrize(
    ("numels", "first", "cap"),
    [
        ([3, 100, 50, 7, 7, 400, 1], 200, 400),
        ([10] * 12, 40, 120),
        ([1000], 1, 1),
        ([1, 2, 3], 1 << 20, 25 << 20),
    ],
)
def test_layout_is_torch_ddp_layout(numels: list[int], first: int, cap: int) -> None:
    dtypes = [torch.float64 if i % 3 == 2 else torch.float32 for i in range(len(numels))]
    tensors = [torch.zeros(n, dtype=d) for n, d in zip(numels, dtypes, strict=True)]
    sizes = [t.numel() * t.element_size() for t in tensors]
    ours = assign_buckets(sizes, dtypes, first_cap_bytes=first, cap_bytes=cap)
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])  # type: ignore[attr-defined]
    assert ours == [list(b) for b in theirs]
    assert sorted(i for b in ours for i in b) == list(range(len(numels)))
    for bucket in ours:
        assert len({dtypes[i] for i in bucket}) == 1


def test_layout_rejects_bad_caps() -> None:
    with pytest.raises(ValueError, match="caps must be > 0"):
        assign_buckets([4], [torch.float32], first_cap_bytes=0, cap_bytes=4)


def _affine(alpha_s: float, beta_s: float):  # type: ignore[no-untyped-def]
    return lambda n: alpha_s + n * beta_s


def test_merge_small_gaps_merge_everything() -> None:
    # Gradients 0.1 ms apart, alpha 5 ms: every start-up saved is a win.
    groups = merge_by_cost([1000] * 6, [i * 1e-4 for i in range(6)], _affine(5e-3, 1e-9))
    assert groups == [[0, 1, 2, 3, 4, 5]]


def test_merge_large_gaps_keep_wait_free() -> None:
    # Gradients 100 ms apart, each sent in about 1 ms: sending early hides everything.
    groups = merge_by_cost([1000] * 4, [i * 0.1 for i in range(4)], _affine(1e-4, 1e-6))
    assert groups == [[0], [1], [2], [3]]


def test_merge_mixed_and_capped() -> None:
    # Two bursts: 0-2 close together, then a long gap, then 3-4.
    ready = [0.0, 1e-4, 2e-4, 0.5, 0.5001]
    cost = _affine(5e-3, 1e-9)
    assert merge_by_cost([100] * 5, ready, cost) == [[0, 1, 2], [3, 4]]
    assert merge_by_cost([100] * 5, ready, cost, cap_bytes=200) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="ready times"):
        merge_by_cost([1, 2], [0.0], cost)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DataParallelConfig(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="on_nonfinite"):
        DataParallelConfig(on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an all_reduce algorithm"):
        DataParallelConfig(algo="tree")
    with pytest.raises(ValueError, match="compressor must be a commfuse"):
        DataParallelConfig(compressor=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"an object, e.g. PowerSGD\(rank=8\).*'powersgd:rank=8'"):
        DataParallelConfig(compressor="powersgd:rank=8")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DataParallelConfig(25.0)  # type: ignore[call-arg]


def test_unreachable_params_walks_the_graph() -> None:
    from torch import nn

    from commfuse.ddp.graph import unreachable_params

    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]
    x = torch.randn(2, 3)
    assert unreachable_params({"out": [b(a(x))], "n": 3}, params) == [4, 5]
    assert unreachable_params((a(x), c.weight), params) == [2, 3, 5]  # a parameter as output
    with torch.no_grad():
        assert unreachable_params(a(x), params) == list(range(6))


def test_bench_config_errors_name_the_field() -> None:
    from commfuse.bench.ddp import DdpBenchConfig, build_model

    with pytest.raises(ValueError, match="model must be one of"):
        DdpBenchConfig(model="resnet")
    with pytest.raises(ValueError, match="num_reps"):
        DdpBenchConfig(num_reps=0)
    with pytest.raises(ValueError, match="not an all_reduce algorithm"):
        DdpBenchConfig(algos=("tree",))
    net = build_model(DdpBenchConfig(model="transformer", num_layers=2, width=32))
    assert (
        sum(p.numel() for p in net.parameters())
        == 2 * (4 * 32 * 33 + 2 * 32 * 128 + 128 + 32 + 4 * 32) + 330
    )
