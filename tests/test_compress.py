"""Compressors as pure functions, in one process: specs, declared ratios, round-trip bounds.

The multi-rank behaviour (averages against exact references, bytes on the wire, error
feedback, resume, non-finite input) is in ``test_compress_ranks.py``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import wire_decode
from commfuse.cli.spec import compressor_from_spec, compressors
from commfuse.compress import (
    DGC,
    BucketLayout,
    CastCompressor,
    MessageCompressor,
    PowerSGD,
    RandomK,
)
from commfuse.compress.demo import dct_matrix, dct_reference
from commfuse.compress.powersgd import matrix_shape
from commfuse.compress.sparseloco import SparseLoCo, sparseloco_reference
from commfuse.compress.wire import Layout, pack_bits, unpack_bits

MB = 1 << 20


def sample(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


# ---- specs -------------------------------------------------------------------------------------


def test_every_name_builds_and_specs_set_fields() -> None:
    for name in compressors():
        assert compressor_from_spec(name).name == name
    c = compressor_from_spec("powersgd:rank=4,warmup=3", algo="ring")
    assert isinstance(c, PowerSGD)
    assert (c.rank, c.warmup, c.algo, c.ef) == (4, 3, "ring", True)
    t = compressor_from_spec(" TopK : ratio=0.05 , ef=0 ")
    assert (t.name, t.ef) == ("topk", False)
    q = compressor_from_spec("qsgd:levels=16,chunk_numel=128,seed=7")
    assert (q.levels, q.chunk_numel, q.seed) == (16, 128, 7)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("gzip", "unknown compressor 'gzip'; known: none, fp16"),
        ("topk:rate=0.1", "known keys: algo, ef, gather_algo, ratio, seed"),
        ("topk:ratio=lots", "ratio='lots' is not a valid float"),
        ("topk:ratio=0", "ratio must be > 0 and <= 1"),
        ("topk:ratio=1.5", "ratio must be > 0 and <= 1"),
        ("topk:ratio", "is not key=value"),
        ("topk:ratio=0.1,ratio=0.2", "given twice"),
        ("topk:ef=maybe", "ef='maybe' is not a boolean (accepted: 1/0, true/false"),
        ("qsgd:levels=0", "levels must be in 1..127"),
        ("qsgd:levels=200", "levels must be in 1..127"),
        ("terngrad:levels=3", "exactly 1 level"),
        ("qsgd:ef=1", "error feedback diverges unless levels**2 > chunk_numel"),
        ("terngrad:ef=1", "error feedback diverges unless levels**2 > chunk_numel"),
        ("powersgd:rank=0", "rank must be >= 1"),
        ("powersgd:warmup=-1", "warmup must be >= 0"),
        ("dgc:momentum=1", "momentum must be in [0, 1)"),
        ("dgc:ef=0", "IS its error feedback"),
        ("none:ef=1", "needs a lossy compressor"),
        ("topk:rank=4", "unknown key 'rank'"),
        ("sparseloco:chunk_numel=70000", "chunk_numel must be in 1..65536"),
        ("sparseloco:num_kept_per_chunk=0", "num_kept_per_chunk must be >= 1"),
        ("sparseloco:decay=0", "decay must be in (0, 1]"),
        ("demo:chunk_numel=300", "chunk_numel must be in 1..256"),
        ("demo:ef=0", "IS its error feedback"),
        ("int4:chunk_numel=0", "chunk_numel must be >= 1"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        compressor_from_spec(spec)


# ---- declared ratios ----------------------------------------------------------------------------


def ratio(spec: str, numel: int = MB, step: int | None = None) -> float:
    c = compressor_from_spec(spec)
    return numel * 4 / c.payload_bytes(numel, torch.float32, 4, step=step)


def test_declared_ratios() -> None:
    assert ratio("none") == 1.0
    assert ratio("fp16") == 2.0 and ratio("bf16") == 2.0
    assert ratio("topk:ratio=0.01") >= 30  # values + int32 indices: 50x
    assert ratio("sign") >= 25 and ratio("ef-sign") >= 25  # 1 bit + a scale: ~32x
    assert 3.99 < ratio("int8") <= 4
    assert 7.8 < ratio("qsgd:levels=7") <= 8  # 4-bit codes + a norm per 512
    assert 15.4 < ratio("terngrad") <= 16  # 2-bit codes + a max per 512
    assert ratio("randomk:ratio=0.01") >= 99
    m, c = matrix_shape(MB)
    assert (m, c) == (1024, 1024)
    assert ratio("powersgd:rank=4") == MB / ((m + c) * 4)  # 128x
    assert ratio("powersgd:rank=4,warmup=5", step=4) == 1.0  # warm-up steps are uncompressed
    assert ratio("powersgd:rank=4,warmup=5", step=5) == MB / ((m + c) * 4)
    assert ratio("powersgd:rank=8", numel=100) == 1.0  # (10 + 10) * 8 >= 100: not worth it
    dgc = compressor_from_spec("dgc:ratio=0.001,warmup=10")
    assert dgc.payload_bytes(MB, torch.float32, 4, step=0) == math.ceil(0.25 * MB) * 8
    assert ratio("dgc:ratio=0.001,warmup=10", step=10) >= 400
    # SparseLoCo: per 4096-chunk 8 B of (lo, hi) + 64 x 16-bit indices + 64 x 2-bit codes.
    assert ratio("sparseloco") == MB * 4 / ((MB // 4096) * (8 + 64 * 2 + 64 // 4))
    assert ratio("demo") == MB * 4 / ((MB // 64) * 4 * 5)  # 4 x (fp32 + uint8) per 64
    assert ratio("int4") == MB * 4 / ((MB // 512) * 4 + MB // 2)


def test_dgc_warmup_decays_density_exponentially() -> None:
    dgc = compressor_from_spec("dgc:ratio=0.001,warmup=4")
    assert isinstance(dgc, DGC)
    densities = [dgc.density(s) for s in range(6)]
    assert densities[0] == 0.25 and densities[4:] == [0.001, 0.001]
    factors = [densities[i] / densities[i + 1] for i in range(3)]
    assert all(abs(f - factors[0]) < 1e-9 for f in factors) and factors[0] > 1


# ---- wire format ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bit_packing_round_trips(bits: int) -> None:
    for numel in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 1 << bits, (numel,), dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.numel() == math.ceil(numel * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, numel)[0], codes)


def test_layout_packs_mixed_fields_into_words() -> None:
    layout = Layout.of((torch.float64, 3), (torch.float32, 1), (torch.int32, 2), (torch.uint8, 5))
    assert (layout.nbytes, layout.wire_bytes) == (24 + 4 + 8 + 5, 44)
    parts = [
        torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64),
        torch.tensor([0.125]),
        torch.tensor([7, -9], dtype=torch.int32),
        torch.arange(5, dtype=torch.uint8),
    ]
    words = layout.pack(parts)
    assert words.dtype == torch.int32 and words.numel() == 11
    two_ranks = torch.cat([words, words])
    for got, want in zip(layout.unpack(two_ranks), parts, strict=True):
        assert got.shape == (2, want.numel()) and torch.equal(got[1], want)
    with pytest.raises(ValueError, match=re.escape("message field must be 3 x torch.float64")):
        layout.pack([parts[1], *parts[1:]])


# ---- round trips within their documented bounds ---------------------------------------------------


def round_trip(spec: str, x: torch.Tensor, step: int = 0, rank: int = 0) -> torch.Tensor:
    """``x``'s message as it goes on the wire, decoded by the test's own decoder (and the
    compressor's decoder must agree with it)."""
    c = compressor_from_spec(spec)
    assert isinstance(c, MessageCompressor)
    parts = c.compress(x, step=step, bucket=0, rank=rank)
    message = c.layout(x.numel(), x.dtype, step).pack(parts).numpy().tobytes()
    back = torch.from_numpy(wire_decode.decode(c, message, x.numel(), step, str(x.dtype)))
    ours = c.decompress(parts, x.numel(), x.dtype, step)
    assert torch.allclose(ours.double(), back, rtol=1e-6, atol=1e-7), spec
    return back.to(x.dtype)


def test_casts_round_trip_within_half_precision() -> None:
    x = sample(10_000) * 100
    x = x[x.abs() > 1e-3]  # fp16's normal range
    for spec, eps in (("fp16", 2**-11), ("bf16", 2**-8)):
        c = compressor_from_spec(spec)
        assert isinstance(c, CastCompressor)
        back = c.decompress(c.compress(x), torch.float32)
        assert bool(((back - x).abs() <= eps * x.abs()).all()), spec
    ints = torch.arange(-1000, 1000, dtype=torch.float32)
    fp16 = compressor_from_spec("fp16")
    assert isinstance(fp16, CastCompressor)
    assert torch.equal(fp16.decompress(fp16.compress(ints, 4), torch.float32) * 4, ints)


def test_int8_error_at_most_half_a_step() -> None:
    x = sample(4097, 1) * 3
    err = (round_trip("int8", x) - x).abs().max()
    assert err <= x.abs().max() / 254 * (1 + 1e-6)
    assert torch.equal(round_trip("int8", torch.zeros(10)), torch.zeros(10))


def test_scaled_sign_error_is_exactly_the_lemma() -> None:
    for numel in (1, 9, 1000):
        x = sample(numel, numel)
        x[0] = 0.0  # sign(0) counts as +: still x_i * sign_i = |x_i|
        back = round_trip("sign", x)
        assert torch.allclose(back.abs(), x.abs().mean().expand(numel))
        lhs = (x - back).pow(2).sum()
        rhs = x.pow(2).sum() - x.abs().sum() ** 2 / numel
        assert torch.isclose(lhs, rhs, rtol=1e-4, atol=1e-5), (numel, lhs, rhs)


def test_topk_keeps_exactly_the_largest() -> None:
    x = sample(1000, 2)
    back = round_trip("topk:ratio=0.05", x)
    kept = back != 0
    assert int(kept.sum()) == 50
    assert torch.equal(back[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()
    assert (x - back).pow(2).sum() <= (1 - 50 / 1000) * x.pow(2).sum()


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1", "randblock:ratio=0.1"])
def test_random_sparsifiers_share_indices_per_step_and_bucket(spec: str) -> None:
    c = compressor_from_spec(spec)
    assert isinstance(c, RandomK)
    x = sample(1000, 3)
    same = c.indices(1000, step=4, bucket=2)
    assert torch.equal(same, c.indices(1000, step=4, bucket=2))  # what every rank draws
    assert not torch.equal(same, c.indices(1000, step=5, bucket=2))
    assert same.numel() == 100 and same.unique().numel() == 100  # type: ignore[no-untyped-call]  # torch's Tensor.unique is unannotated
    back = c.decompress(c.compress(x, step=4, bucket=2), 1000, step=4, bucket=2)
    assert torch.equal(back[same], x[same]) and int((back != 0).sum()) == 100
    if spec.startswith("randblock"):
        assert bool(((same.diff() % 1000) == 1).all())  # one contiguous (wrapping) block


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "levels"), [("qsgd:levels=4", 4), ("terngrad", 1)])
def test_stochastic_quantizers_bounded_and_unbiased(spec: str, levels: int) -> None:
    x = sample(1000, 4)
    c = compressor_from_spec(spec)
    chunks = torch.nn.functional.pad(x, (0, 24)).view(-1, 512)
    norm = chunks.abs().amax(1) if spec == "terngrad" else chunks.norm(dim=1)
    per_element = norm.repeat_interleave(512)[:1000]
    draws = torch.stack([round_trip(spec, x, step=s) for s in range(400)])
    assert bool(((draws - x).abs() <= per_element / levels + 1e-6).all())
    if spec == "terngrad":
        assert bool(((draws.abs() - per_element).abs() < 1e-6).logical_or(draws == 0).all())
    # Unbiased: each element's draws are x rounded up or down by one step s = norm / levels,
    # so their standard deviation is at most s / 2; the mean of 400 draws is within 5 of its
    # standard errors of x, and the bias summed over all elements within 5 of its own.
    step_size = per_element / levels
    error = draws.mean(0) - x
    assert bool((error.abs() <= 5 * step_size / 2 / math.sqrt(400) + 1e-6).all())
    assert abs(float(error.sum())) <= 5 * float(step_size.pow(2).sum().sqrt()) / 2 / math.sqrt(400)
    # Different ranks draw differently at the same step (independent rounding).
    assert not torch.equal(round_trip(spec, x, rank=0), round_trip(spec, x, rank=1))
    assert c.payload_bytes(1000, torch.float32, 2) == 8 + math.ceil(1000 * c.bits / 8 / 4) * 4  # type: ignore[attr-defined]


# ---- PowerSGD's per-tensor layout --------------------------------------------------------------


def test_powersgd_layout_plans_matrices_like_torchs_hook() -> None:
    """Per tensor, as torch's powerSGD_hook (min_compression_rate 1): ``ndim >= 2`` tensors whose
    factors are smaller become ``(shape[0], rest)`` matrices at rank ``min(r, rows, cols)``."""
    shapes = [
        (768, 256),
        (768,),
        (256, 256),
        (256,),
        (1, 40),
        (3, 3),
        (4, 3, 5),
        (0, 7),
        (768, 256),
    ]
    c = compressor_from_spec("powersgd:rank=4,warmup=2")
    assert isinstance(c, PowerSGD)
    c.set_layout(5, BucketLayout.of_shapes([torch.Size(s) for s in shapes], prefix="b5."))
    numel = sum(math.prod(s) for s in shapes)
    plan = c.plans[c.layouts[5].key]
    compressed = {(g.rows, g.cols, g.rank): len(g.members) for g in plan.groups}
    # (1, 40): rank 1 gives 41 > 40; (3, 3): rank 3 gives 18 > 9; (4, 15): rank 4 gives 76 > 60.
    assert compressed == {(768, 256, 4): 2, (256, 256, 4): 1}
    plain = 768 + 256 + 40 + 9 + 60
    assert plan.plain == (
        (768 * 256, 768),
        (768 * 257 + 256 * 256, 256 + 40 + 9 + 60),
    )  # merged runs
    expected = plain + 2 * (768 + 256) * 4 + (256 + 256) * 4
    assert c.payload_bytes(numel, torch.float32, 4, step=2, bucket=5) == expected * 4
    assert c.payload_bytes(numel, torch.float32, 4, step=1, bucket=5) == numel * 4  # warm-up
    assert c.payload_bytes(numel, torch.bfloat16, 4, step=2, bucket=5) == expected * 4  # fp32
    m, cols = matrix_shape(numel)  # without ``bucket``: the flat layout's count
    assert c.payload_bytes(numel, torch.float32, 4) == (m + cols) * 4 * 4
    only_plain = compressor_from_spec("powersgd:rank=4")
    assert isinstance(only_plain, PowerSGD)
    only_plain.set_layout(
        0, BucketLayout.of_shapes([torch.Size([100]), torch.Size([2, 2])], prefix="b0.")
    )
    assert not only_plain.compresses(104, None, bucket=0)
    assert only_plain.payload_bytes(104, torch.float32, 4, bucket=0) == 104 * 4


def test_powersgd_layout_rejects_bad_shapes_and_mismatched_buckets() -> None:
    c = compressor_from_spec("powersgd:rank=2")
    assert isinstance(c, PowerSGD)
    with pytest.raises(ValueError, match=re.escape("tensor 1 has a negative dimension in (-1, 3)")):
        c.set_layout(0, BucketLayout.of_shapes([torch.Size([3]), (-1, 3)], prefix="b0."))
    with pytest.raises(
        ValueError, match=re.escape("tensor 0 has shape 'ab', not a sequence of ints")
    ):
        c.set_layout(0, BucketLayout.of_shapes(["ab"], prefix="b0."))  # type: ignore[list-item]  # a bad layout on purpose
    c.set_layout(0, BucketLayout.of_shapes([torch.Size([10, 10])], prefix="b0."))
    with pytest.raises(ValueError, match=re.escape("bucket 0 has 99 elements but its layout")):
        c.payload_bytes(99, torch.float32, 2, bucket=0)
    # Element-wise compressors accept a layout and ignore it.
    topk = compressor_from_spec("topk:ratio=0.1")
    topk.set_layout(0, BucketLayout.of_shapes([torch.Size([10, 10])], prefix="b0."))
    assert topk.payload_bytes(100, torch.float32, 2) == 10 * 8


@pytest.mark.parametrize("numel", [1, 7, 100, 1001])
def test_sparseloco_batched_selection_equals_the_chunk_by_chunk_reference(numel: int) -> None:
    c = SparseLoCo(chunk_numel=64, num_kept_per_chunk=5)
    x = sample(numel, numel)
    back = c.decompress(c.compress(x), numel, torch.float32)
    want, kept = sparseloco_reference(c, x)
    assert torch.equal(back != 0, kept)
    assert torch.allclose(back.double(), want, rtol=1e-6, atol=1e-7)


def test_sparseloco_levels_are_each_groups_mean_magnitude() -> None:
    """Each 2-bit level decodes to the mean magnitude of the values it stands for (the paper's
    quantiser decodes a bin to its mean), so a chunk's decoded magnitudes sum to the kept
    ones'; one outlier no longer sends the rest of its chunk as the smallest kept value."""
    x = torch.tensor([10.0, -1.0, 1.2, -0.8, 1.0, 0.0, 0.0, 0.0])
    back = round_trip("sparseloco:chunk_numel=8,num_kept_per_chunk=5", x)
    assert torch.allclose(back, torch.tensor([10.0, -1.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0]))
    x = sample(4096, 11)
    c = SparseLoCo(chunk_numel=256, num_kept_per_chunk=16)
    back = c.decompress(c.compress(x), x.numel(), torch.float32)
    kept = back != 0
    for row in range(16):
        part = slice(row * 256, (row + 1) * 256)
        assert torch.allclose(back[part].abs().sum(), x[part][kept[part]].abs().sum(), rtol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 8, 63])
def test_dct_matrix_is_the_defining_sum_and_orthonormal(size: int) -> None:
    d = dct_matrix(size, "cpu", torch.float64)
    rows = sample(3 * size, size).double().view(3, size)
    for row in rows:
        assert torch.allclose(d @ row, dct_reference(row), rtol=1e-12, atol=1e-12)
    assert torch.allclose(d @ d.T, torch.eye(size, dtype=torch.float64), atol=1e-12)


def test_outer_compressors_keep_everything_when_nothing_is_dropped() -> None:
    """All kept (k = chunk): DeMo's round trip is the identity up to rounding; SparseLoCo's
    two levels are exact on values of two magnitudes; int4 on multiples of the scale."""
    x = sample(300, 3)
    demo = compressor_from_spec("demo:num_kept_per_chunk=64")
    assert isinstance(demo, MessageCompressor)
    assert torch.allclose(demo.decompress(demo.compress(x), 300, torch.float32), x, atol=1e-5)
    two = torch.where(x > 0, 2.0, -0.5)
    assert torch.equal(round_trip("sparseloco:chunk_numel=100,num_kept_per_chunk=100", two), two)
    steps = torch.randint(-7, 8, (1000,), generator=torch.Generator().manual_seed(0)).float()
    steps[::512] = 7.0  # each chunk's max is 7 steps: the scale is exactly 1
    assert torch.equal(round_trip("int4", steps * 0.25), steps * 0.25)
