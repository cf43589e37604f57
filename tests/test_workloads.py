"""Workloads: real offline data, fixed disjoint splits, deterministic batches, losses that fall."""

from __future__ import annotations

import os

import pytest
import torch

from commfuse.cli.spec import workload_from_spec
from commfuse.workloads import corpus, make_workload
from commfuse.workloads.digits import HELDOUT_EVERY, load_split_tensors

CPU = torch.device("cpu")


def test_corpus_files_present_and_heldout_disjoint() -> None:
    train = corpus.module_paths(corpus.TRAIN_MODULES)
    held = corpus.module_paths(corpus.HELDOUT_MODULES)
    assert len(train) >= 30 and len(held) >= 12
    assert not set(train) & set(held)
    assert all(p.startswith(corpus.stdlib_dir()) and os.path.getsize(p) > 1000 for p in train)
    ids = corpus.load_split("train")
    assert ids.numel() > 500_000  # about 1.5 MB of real Python source
    assert int(ids.min()) >= 0 and int(ids.max()) < corpus.VOCAB_SIZE
    assert corpus.decode(corpus.encode(b"def f(x):\n\treturn x")) == "def f(x):\n\treturn x"


def test_digits_split_fixed_and_disjoint() -> None:
    splits = load_split_tensors()
    (xt, yt), (_, yh) = splits["train"], splits["heldout"]
    assert len(yt) + len(yh) == 1797 and len(yh) == -(-1797 // HELDOUT_EVERY)
    assert set(yh.tolist()) == set(range(10))
    assert float(xt.max()) == 1.0 and float(xt.min()) == 0.0


def test_split_replica_data_gives_each_rank_windows_of_its_own_share_only() -> None:
    text = corpus.load_split("train").to(torch.uint8).numpy().tobytes()  # 98 symbols: a byte each
    share = len(text) // 4
    split = make_workload(workload_from_spec("charlm:replica_data=split"), device=CPU)
    shared = make_workload(workload_from_spec("charlm"), device=CPU)

    def inside(window: torch.Tensor, rank: int) -> bool:
        """Whether the window's 65 symbols occur within rank ``rank``'s share of the corpus."""
        return (
            text.find(window.to(torch.uint8).numpy().tobytes(), rank * share, (rank + 1) * share)
            >= 0
        )

    for rank in range(4):
        windows = [w for step in range(5) for w in split.batch(step, rank, 4, seed=0)]
        assert all(inside(w, rank) for w in windows), rank
    windows = [w for step in range(5) for w in shared.batch(step, 0, 4, seed=0)]
    assert not all(inside(w, 0) for w in windows)  # the shared corpus reaches past the share
    assert "each rank its own share" in split.describe()


@pytest.mark.parametrize("spec", ["charlm:dim=32,layers=1,heads=2", "digits:hidden=16"])
def test_batches_are_a_function_of_seed_step_rank(spec: str) -> None:
    w = make_workload(workload_from_spec(spec), device=torch.device("cpu"))

    def flat(b: object) -> torch.Tensor:
        return torch.cat([t.float().reshape(-1) for t in b]) if isinstance(b, tuple) else b  # type: ignore[return-value]

    a = flat(w.batch(7, 1, 4, seed=3))
    assert torch.equal(a, flat(w.batch(7, 1, 4, seed=3)))
    for other in [(8, 1, 3), (7, 2, 3), (7, 1, 4)]:
        step, rank, seed = other
        assert not torch.equal(a, flat(w.batch(step, rank, 4, seed=seed))), other
    with pytest.raises(ValueError, match="outside world size"):
        w.batch(0, 4, 4, seed=0)


def test_models_are_seeded() -> None:
    w = make_workload(workload_from_spec("charlm"), device=torch.device("cpu"))
    a, b = w.build_model(5), w.build_model(5)
    n = sum(p.numel() for p in a.parameters())
    assert 3_000_000 < n < 3_400_000  # the 3.2M-parameter character Transformer
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(a.parameters()), next(w.build_model(6).parameters()))


@pytest.mark.parametrize("spec", ["charlm:dim=32,layers=1,heads=2,seq=16", "digits:hidden=16"])
def test_the_model_its_optimizer_state_and_batches_live_on_the_given_device(spec: str) -> None:
    """A workload built for a device puts everything it makes there. torch's ``meta`` device
    stands in for a GPU on a CPU-only machine: a parameter or a batch left on the CPU (a
    missing ``.to(device)``) shows up as a CPU tensor, or as torch refusing to mix the two."""
    meta = torch.device("meta")
    w = make_workload(workload_from_spec(spec), device=meta)
    model = w.build_model(0)
    optimizer = w.make_optimizer(model)
    batch = w.batch(3, 1, 2, seed=0)
    tensors = batch if isinstance(batch, tuple) else (batch,)
    assert {p.device for p in model.parameters()} == {meta}
    assert {t.device for t in tensors} == {meta}
    loss = w.loss(model, batch)
    assert loss.device == meta
    loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
    optimizer.step()
    # AdamW's moments sit beside their parameters; its step counters on the host, by torch's
    # rule for an optimizer that is neither fused nor capturable.
    state = [(k, t) for s in optimizer.state.values() for k, t in s.items()]
    assert state and all(
        t.device == (torch.device("cpu") if k == "step" else meta) for k, t in state
    )


@pytest.mark.parametrize(
    ("spec", "steps"), [("charlm", 12), ("charlm:optimizer=sgd,lr=0.1", 12), ("digits", 40)]
)
def test_a_few_steps_reduce_the_loss(spec: str, steps: int) -> None:
    torch.set_num_threads(1)
    w = make_workload(workload_from_spec(spec), device=torch.device("cpu"))
    model = w.build_model(0)
    opt = w.make_optimizer(model)
    assert type(opt) is (torch.optim.SGD if "sgd" in spec else torch.optim.AdamW)
    before = w.evaluate(model)
    for step in range(steps):
        opt.zero_grad()
        w.loss(model, w.batch(step, 0, 1, seed=0)).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        opt.step()
    after = w.evaluate(model)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["accuracy"] > before["accuracy"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("imagenet", "unknown workload 'imagenet'; known: charlm, digits"),
        ("charlm:depth=3", "unknown key.*depth.*known keys: batch, dim"),
        ("charlm:dim=65,heads=4", "heads=4 must divide dim=65"),
        ("charlm:optimizer=adam", "optimizer='adam'.*adamw, sgd"),
        ("charlm:optimizer=sgd,momentum=1", r"momentum must be in \[0, 1\), got 1"),
        ("digits:lr=fast", "lr='fast' is not a valid float"),
        ("digits:hidden", "is not key=value"),
    ],
)
def test_bad_workload_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        workload_from_spec(spec)
