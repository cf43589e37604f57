"""The overlap cost model and the chunk choice (pure functions, one process)."""

from __future__ import annotations

import pytest

from commfuse.fused.chunking import (
    ChunkConfig,
    choose_chunks,
    predict_us,
    split_ranges,
    split_sizes,
)


def test_model_is_max_plus_min_over_k_plus_overhead() -> None:
    assert predict_us(100.0, 60.0, 1, 5.0) == 100 + 60 + 5
    assert predict_us(100.0, 60.0, 4, 5.0) == 100 + 15 + 20
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        predict_us(1.0, 1.0, 0, 0.0)


def test_choice_minimises_the_model() -> None:
    c, m, o = 10_000.0, 8_000.0, 100.0
    k = choose_chunks(c, m, o, max_chunks=64)
    assert k == 9  # sqrt(8000 / 100) = 8.94: 9 beats 8 on the model
    assert all(predict_us(c, m, k, o) <= predict_us(c, m, j, o) for j in range(1, 65))
    assert choose_chunks(c, m, o, max_chunks=4) == 4


def test_falls_back_to_one_chunk_when_chunking_cannot_pay() -> None:
    assert choose_chunks(10_000.0, 50.0, 100.0) == 1  # communication negligible
    assert choose_chunks(0.0, 5_000.0, 10.0) == 1
    assert choose_chunks(1_000.0, 1_000.0, 400.0) == 1  # overhead eats the gain
    # A predicted gain below min_gain is not worth the risk.
    assert choose_chunks(1_000.0, 100.0, 10.0, min_gain=0.05) == 1
    assert choose_chunks(1_000.0, 1_000.0, 10.0, min_gain=0.05) > 1


def test_splits_cover_everything_once() -> None:
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert split_ranges(2, 4) == [(0, 1), (1, 2)]
    assert split_ranges(0, 3) == [(0, 0)]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_sizes(3, 0)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="num_chunks"):
        ChunkConfig(num_chunks=-1)
    with pytest.raises(ValueError, match="schedule='by_table'"):
        ChunkConfig(num_chunks=0)
    assert ChunkConfig(schedule="by_table").fixed() == "by_table"  # the embedding exchange
    with pytest.raises(ValueError, match="leave num_chunks None"):
        ChunkConfig(num_chunks=2, schedule="by_table")
    with pytest.raises(ValueError, match="min_gain"):
        ChunkConfig(min_gain=1.0)
    with pytest.raises(ValueError, match="overhead_us"):
        ChunkConfig(overhead_us=-1.0)
