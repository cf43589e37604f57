"""Compressed stage boundaries: each wire against the same quantize-dequantize applied to the
unsplit model in one process (bit for bit, activations forward and gradients back), AQ-SGD's
deltas against a per-sample reference (a warm cache sends zero codes and rebuilds the
activation exactly), the bytes of every boundary per micro-batch, and an exact resume of the
caches, in one process and on 2 gloo ranks."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from commfuse.comm import CommConfig, Communicator
from commfuse.pipeline import Boundary, PipelineRuntime, interleaved_1f1b, one_f_one_b
from commfuse.pipeline.cut import cut
from commfuse.pipeline.runtime import HEADER_SLOTS, LABELS
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
WIDTH, LAYERS, CUTS = 4, 4, [2]
SIZES, LENGTH = [2, 1, 3], 2
WIRES = [
    Boundary("fp16"),
    Boundary("bf16"),
    Boundary("int8"),
    Boundary("int8", scale="tensor"),
    Boundary("int8", delta=True),
    Boundary("bf16", delta=True),
    Boundary("subspace", rank=2),
]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    ).double()


def batches(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Step ``step``'s micro-batches: samples 0..5 every step (an epoch a step) in an order of
    the step's own, so each delta cache is read in another order than it was written."""
    gen = torch.Generator().manual_seed(1)
    total = sum(SIZES)
    xs_all = torch.randn(total, LENGTH, WIDTH, generator=gen, dtype=torch.float64)
    ys_all = torch.randn(total, LENGTH, WIDTH, generator=gen, dtype=torch.float64)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(step))
    ids = list(torch.split(order, SIZES))
    return [xs_all[i] for i in ids], [ys_all[i] for i in ids], ids


class Wire(torch.autograd.Function):
    """The reference boundary: forward gives ``value`` (the receiver's tensor), backward
    sends the gradient through the boundary's quantize-dequantize."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, value: torch.Tensor, b: Boundary) -> torch.Tensor:
        ctx.boundary = b
        return value.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.boundary.qdq(g), None, None


class Reference:
    """The unsplit model in one process with the boundary applied by hand at each cut."""

    def __init__(self, b: Boundary) -> None:
        self.b, self.model = b, make_model()
        self.stages = cut(self.model, CUTS)
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def cross(self, a: torch.Tensor, stage: int, ids: torch.Tensor) -> torch.Tensor:
        if not self.b.delta:
            return Wire.apply(a, self.b.qdq(a.detach()), self.b)  # type: ignore[no-untyped-call,no-any-return]
        ref = torch.zeros_like(a)
        for i, s in enumerate(ids.tolist()):
            if (stage, s) in self.cache:
                ref[i] = self.cache[(stage, s)]
        value = ref + self.b.qdq(a.detach() - ref)
        for i, s in enumerate(ids.tolist()):
            self.cache[(stage, s)] = value[i].clone()
        return Wire.apply(a, value, self.b)  # type: ignore[no-untyped-call,no-any-return]

    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor], ids: list[torch.Tensor]) -> None:
        total = sum(x.shape[0] for x in xs)
        for x, y, i in zip(xs, ys, ids, strict=True):
            h = x
            for s, stage in enumerate(self.stages):
                h = stage(self.cross(h, s, i) if s else h)
            (nn.functional.mse_loss(h, y) * (x.shape[0] / total)).backward()  # type: ignore[no-untyped-call]


def make_runtime(
    b: Boundary, comm: Communicator | None = None
) -> tuple[PipelineRuntime, nn.Sequential]:
    """Two stages: on one rank (handed over in process, through the same boundary) or on two."""
    model = make_model()
    stages = cut(model, CUTS)
    if comm is None:
        schedule = interleaved_1f1b(num_ranks=1, stages_per_rank=2, num_microbatches=len(SIZES))
        mine = dict(enumerate(stages))
    else:
        schedule = one_f_one_b(num_stages=2, num_microbatches=len(SIZES))
        mine = {comm.rank: stages[comm.rank]}
    rt = PipelineRuntime(schedule, mine, comm, loss_fn=nn.functional.mse_loss, boundary=b)
    return rt, model


def train(rt: PipelineRuntime, model: nn.Module, steps: range) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in steps:
        xs, ys, ids = batches(step)
        rt.step(xs if 0 in rt.stages else None, ys if 1 in rt.stages else None, sample_ids=ids)
        opt.step()
        opt.zero_grad()
    return opt


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- the wire formats -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 2, 5), (1, 7), (4,), ()])
@pytest.mark.parametrize(
    "b", [Boundary("fp16"), Boundary("bf16"), Boundary("int8"), Boundary("int8", scale="tensor")]
)
def test_each_wire_has_its_bytes_and_its_rounding(b: Boundary, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    payload = b.encode(x)
    numel, rows = math.prod(shape), math.prod(shape[:-1]) if b.per_row and shape else 1
    want = {"fp16": 2 * numel, "bf16": 2 * numel}.get(b.wire, numel + 4 * rows)
    assert payload.dtype == torch.uint8 and payload.numel() == want == b.payload_bytes(
        shape, x.dtype
    )
    y = b.qdq(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    if b.wire != "int8":
        assert torch.equal(y, x.to(torch.float16 if b.wire == "fp16" else torch.bfloat16).double())
        return
    r = x.reshape(-1, shape[-1]) if b.per_row and shape else x.reshape(1, -1)
    scale = (r.abs().amax(dim=1, keepdim=True) / 127).float().double()
    assert torch.equal(y.reshape(r.shape), torch.round(r / scale) * scale)
    assert bool(((y.reshape(r.shape) - r).abs() <= scale / 2 + 1e-15).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_of_narrow_activations_scales_in_fp32(dtype: torch.dtype) -> None:
    """Tiny 16-bit activations: their scale would underflow in 16 bits, not in fp32."""
    x = (torch.randn(3, 8, generator=torch.Generator().manual_seed(3)) * 1e-6).to(dtype)
    y = Boundary("int8").qdq(x)
    assert y.dtype == dtype and Boundary("int8").encode(x).numel() == 3 * 8 + 4 * 3
    r = x.float()
    scale = r.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((y.float() - r).abs() <= scale / 2 + r.abs() * 2**-7).all())
    assert bool(y.float().count_nonzero() > 0)


def test_the_subspace_wire_sends_k_coefficients_a_row_and_exact_gradients() -> None:
    """Rows of 5 features on a 2-d subspace: 2 elements a row on the wire; a row inside the
    subspace comes through, and the gradient sent back, ``(g U) U^T``, is autograd's of the
    projected model."""
    b = Boundary("subspace", rank=2, seed=7)
    x = torch.randn(3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert b.encode(x).numel() == b.payload_bytes(x.shape, x.dtype) == 3 * 4 * 2 * 8
    inside = b.qdq(x)
    torch.testing.assert_close(b.qdq(inside), inside, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(inside, x)  # a general row loses what lies outside
    a = x.clone().requires_grad_()
    w = torch.randn(3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    projected = a.reshape(-1, 5) @ b._basis(5, x, "") @ b._basis(5, x, "").T
    (projected.reshape(x.shape) * w).sum().backward()  # type: ignore[no-untyped-call]
    assert a.grad is not None
    torch.testing.assert_close(b.qdq(w), a.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"projects rows on 2 dimensions; .* rows of 1 features"):
        b.encode(torch.ones(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"the subspace wire needs a rank >= 1"):
        Boundary("subspace")
    with pytest.raises(ValueError, match=r"no other wire takes one"):
        Boundary("int8", rank=2)
    with pytest.raises(ValueError, match=r"drop delta"):
        Boundary("subspace", rank=2, delta=True)


def test_unsupported_combinations_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"wire 'int4': choose one of identity, fp16, bf16, int8, subspace"
    ):
        Boundary("int4")
    with pytest.raises(ValueError, match=r"scale='row' with wire 'fp16'.*int8 wire only"):
        Boundary("fp16", scale="row")
    with pytest.raises(ValueError, match=r"delta only pays on a lossy wire"):
        Boundary("identity", delta=True)
    with pytest.raises(ValueError, match=r"compresses floating tensors; .* carries torch.int64"):
        Boundary("int8").encode(torch.arange(3))
    rt, _ = make_runtime(Boundary("int8", delta=True))
    xs, ys, ids = batches(0)
    with pytest.raises(ValueError, match=r"step needs sample_ids on every rank.*\(3\), got none"):
        rt.step(xs, ys)
    with pytest.raises(ValueError, match=r"sample_ids repeat a sample"):
        rt.step(xs, ys, sample_ids=[ids[0], ids[0], ids[2]])
    with pytest.raises(ValueError, match=r"checkpoint's boundary is 'int8'"):
        rt.load_state_dict(make_runtime(Boundary("int8"))[0].state_dict())


# -- one process against the reference ------------------------------------------------------


@pytest.mark.parametrize("b", WIRES, ids=str)
def test_a_boundary_equals_its_quantize_dequantize_on_the_unsplit_model(b: Boundary) -> None:
    """Three steps (the deltas' caches warm up and the model moves): the pipeline's losses
    and gradients are the reference's bit for bit."""
    rt, model = make_runtime(b)
    ref = Reference(b)
    for step in range(3):
        xs, ys, ids = batches(step)
        loss = rt.step(xs, ys, sample_ids=ids).loss
        ref.step(xs, ys, ids)
        for (n, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), f"{b} step {step}: {n}"
            with torch.no_grad():
                p.sub_(0.5 * p.grad)
                q.sub_(0.5 * q.grad)
            p.grad, q.grad = None, None
        assert loss is not None
    # the boundary did change something: the identity boundary's gradients are others
    exact, model = make_runtime(Boundary())
    xs, ys, ids = batches(0)
    exact.step(xs, ys)
    ref = Reference(b)
    ref.step(xs, ys, ids)
    assert not all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), ref.model.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )


def test_a_warm_delta_cache_sends_zero_codes_and_rebuilds_the_activation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same samples again and again through a model that does not move: each delta is a
    254th of the last, so after a few visits the codes are all zero, which happens only when
    the cache holds the activation exactly."""
    codes: list[torch.Tensor] = []
    encode = Boundary.encode

    def spy(self: Boundary, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        payload = encode(self, x, where=where)
        if where.endswith("into stage 1"):  # activations; gradients go into stage 0
            codes.append(payload)
        return payload

    b = Boundary("int8", delta=True)
    rt, model = make_runtime(b)
    xs, ys, ids = batches(0)
    first = cut(model, CUTS)[0]
    firsts = [first(x).detach() for x in xs]  # stage 0's outputs
    for visit in range(16):
        monkeypatch.setattr(Boundary, "encode", spy)
        codes.clear()
        rt.step(xs, ys, sample_ids=ids)
        monkeypatch.undo()
        for p in model.parameters():
            p.grad = None
        received = [rt.received_cache.gather(1, i, f) for i, f in zip(ids, firsts, strict=True)]
        if visit == 0:  # a cold cache: the activation itself, quantized
            for r, f in zip(received, firsts, strict=True):
                torch.testing.assert_close(r, b.qdq(f), rtol=0, atol=0)
    assert len(codes) == len(SIZES)
    for r, f in zip(received, firsts, strict=True):
        assert torch.equal(r, f)
    for i, c in zip(ids, codes, strict=True):
        assert c.numel() == b.payload_bytes((i.numel(), LENGTH, WIDTH), torch.float64)
        assert not bool(c[4 * i.numel() * LENGTH :].view(torch.int8).any())


def test_resume_equals_the_uninterrupted_run_bit_for_bit() -> None:
    """Four steps straight against two, a checkpoint through bytes, a fresh runtime, two
    more; and without the caches in the checkpoint it would not be the same."""
    b = Boundary("int8", delta=True)
    rt, model = make_runtime(b)
    train(rt, model, range(4))
    want = params(model)

    rt1, model1 = make_runtime(b)
    opt1 = train(rt1, model1, range(2))
    buf = io.BytesIO()
    torch.save(
        {"rt": rt1.state_dict(), "model": model1.state_dict(), "opt": opt1.state_dict()}, buf
    )
    for with_caches in (True, False):
        buf.seek(0)
        state = torch.load(buf)
        rt2, model2 = make_runtime(b)
        model2.load_state_dict(state["model"])
        if with_caches:
            rt2.load_state_dict(state["rt"])
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
        opt2.load_state_dict(state["opt"])
        for step in (2, 3):
            xs, ys, ids = batches(step)
            rt2.step(xs, ys, sample_ids=ids)
            opt2.step()
            opt2.zero_grad()
        same = all(torch.equal(p, q) for p, q in zip(params(model2), want, strict=True))
        assert same is with_caches
    assert rt2.step_count == 2  # the last one ran without the runtime's state


# -- two gloo ranks -------------------------------------------------------------------------


def on_two_ranks(boundaries: list[Boundary]) -> list[dict[str, Any]]:
    """Each boundary: two steps, the bytes of the second counted, then a third on a fresh
    runtime resumed from the first's state."""
    comm = Communicator(config=CommConfig(deadline_s=60))
    out = []
    for b in boundaries:
        rt, model = make_runtime(b, comm)
        opt = train(rt, model, range(1))
        comm.stats.reset()
        xs, ys, ids = batches(1)
        rt.step(xs if comm.rank == 0 else None, ys if comm.rank == 1 else None, sample_ids=ids)
        counted = {
            label: (c.bytes_sent, c.messages_sent, c.bytes_recv, c.messages_recv)
            for label in LABELS.values()
            for c in [comm.stats[label]]
        }
        opt.step()
        opt.zero_grad()
        state = rt.state_dict()
        # a fresh runtime over the same stages, its caches from the checkpoint
        rt2 = PipelineRuntime(
            rt.schedule, rt.stages, comm, loss_fn=nn.functional.mse_loss, boundary=b
        )
        rt2.load_state_dict(state)
        xs, ys, ids = batches(2)
        rt2.step(xs if comm.rank == 0 else None, ys if comm.rank == 1 else None, sample_ids=ids)
        out.append(
            {
                "grads": {
                    n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
                },
                "bytes": counted,
            }
        )
    return out


@pytest.mark.e2e
def test_two_gloo_ranks_equal_one_process_and_send_the_counted_bytes(pool: PoolFn) -> None:
    bs = [
        Boundary("bf16"),
        Boundary("int8"),
        Boundary("int8", scale="tensor", delta=True),
        Boundary("subspace", rank=3),
    ]
    ranks = pool(2).run(on_two_ranks, bs, timeout_s=180)
    for i, b in enumerate(bs):
        rt, model = make_runtime(b)
        train(rt, model, range(2))
        xs, ys, ids = batches(2)
        rt.step(xs, ys, sample_ids=ids)
        got = {**ranks[0][i]["grads"], **ranks[1][i]["grads"]}
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.equal(got[n], p.grad), f"{b}: {n}"
        elems = [n * LENGTH * WIDTH for n in SIZES]
        rows = [n * LENGTH if b.per_row else 1 for n in SIZES]
        per_mb = [b.payload_bytes((n, LENGTH, WIDTH), torch.float64) for n in SIZES]
        want = {
            "bf16": [2 * e for e in elems],
            "int8": [e + 4 * r for e, r in zip(elems, rows, strict=True)],
            "subspace": [n * LENGTH * 3 * 8 for n in SIZES],  # 3 fp64 coefficients a row
        }[b.wire]
        assert per_mb == want
        m, total = len(SIZES), sum(per_mb)
        assert ranks[0][i]["bytes"][LABELS["F"]] == (total, m, 0, 0)
        assert ranks[0][i]["bytes"][LABELS["B"]] == (0, 0, total, m)
        assert ranks[1][i]["bytes"][LABELS["F"]] == (0, 0, total, m)
        assert ranks[1][i]["bytes"][LABELS["B"]] == (total, m, 0, 0)
        head = (m * HEADER_SLOTS * 8, m, m * HEADER_SLOTS * 8, m)
        assert (
            ranks[0][i]["bytes"][LABELS["header"]] == ranks[1][i]["bytes"][LABELS["header"]] == head
        )
