"""The command line's one spec parser: one vocabulary for every target, errors that name the key,
the value and what is accepted, and the same typed objects Python code builds by hand."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import pytest

from commfuse.cli.spec import (
    build,
    compressor_from_spec,
    compressors,
    keys_of,
    split_spec,
    strategy_from_spec,
    strategy_listing,
    workload_from_spec,
)
from commfuse.compress import DeMo, Int4, Int8, PowerSGD, SparseLoCo, TopK
from commfuse.localsgd import (
    PeriodicSyncConfig,
    diloco,
    local_sgd,
    post_local_sgd,
    slowmo,
    streaming_diloco,
)
from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig
from commfuse.train import CommfuseDPConfig, TorchDDPConfig, TorchPowerSGDConfig
from commfuse.train.strategy import StrategyConfig, describe_compressor, describe_strategy
from commfuse.train.torch_ddp import bf16_hooks_supported
from commfuse.workloads import CharLMConfig, DigitsConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """Every kind of value the vocabulary reads."""

    on: bool = False
    count: int = 1
    scale: float = 1.0
    mode: Literal["ring", "tree"] = "ring"
    limit: int | None = None
    buffer_bytes: int = 0
    link_mbit: float = 0.0
    link_gbit: float = 0.0
    name: str = ""


def sample(text: str) -> Sample:
    spec = split_spec(text)
    return build(Sample, spec.options, where=f"sample {spec.name}")


@pytest.mark.parametrize("word", ["1", "true", "True", "yes", "on", "ON"])
def test_every_true_word_reads_as_true(word: str) -> None:
    assert sample(f"s:on={word}").on is True


@pytest.mark.parametrize("word", ["0", "false", "no", "off", "Off"])
def test_every_false_word_reads_as_false(word: str) -> None:
    assert sample(f"s:on={word}").on is False


def test_numbers_sizes_rates_choices_and_none() -> None:
    got = sample(
        "s:count=8,scale=1e-3,mode=tree,limit=none,buffer_bytes=16M,link_mbit=1gbit,"
        "link_gbit=100mbit,name=x"
    )
    assert got == Sample(
        count=8,
        scale=1e-3,
        mode="tree",
        limit=None,
        buffer_bytes=16 << 20,
        link_mbit=1000.0,
        link_gbit=0.1,
        name="x",
    )
    # A bare number is in the field's own unit; an Optional takes its inner type too.
    assert sample("s:link_mbit=250,link_gbit=2.5,limit=4,buffer_bytes=4096") == Sample(
        link_mbit=250.0, link_gbit=2.5, limit=4, buffer_bytes=4096
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("s:on=maybe", "on='maybe' is not a boolean (accepted: 1/0, true/false, yes/no, on/off)"),
        ("s:count=many", "count='many' is not a valid int (accepted: a whole number"),
        ("s:scale=big", "scale='big' is not a valid float (accepted: a number"),
        ("s:mode=star", "mode='star' is not one of the choices (accepted: ring, tree)"),
        ("s:buffer_bytes=lots", "buffer_bytes='lots' is not a size (accepted: a byte count"),
        ("s:link_mbit=fast", "link_mbit='fast' is not a link rate (accepted: a rate like 100mbit"),
        ("s:cuont=3", "unknown key 'cuont'; known keys: buffer_bytes, count, limit, link_gbit"),
        ("s:count", "option 'count' is not key=value"),
        ("s:count=1,count=2", "option 'count' given twice"),
        (":count=1", "has no name before ':'"),
        ("  ", "empty spec"),
    ],
)
def test_errors_name_the_key_the_value_and_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        sample(text)


def test_keys_are_the_fields_or_the_parameters() -> None:
    assert set(keys_of(Sample)) == {f.name for f in dataclasses.fields(Sample)}
    assert list(keys_of(streaming_diloco))[:4] == [
        "H",
        "num_fragments",
        "overlap_steps",
        "mix_global",
    ]


def test_compressor_specs_build_the_objects_python_builds() -> None:
    # Compressors hold state (error feedback), so they compare by their settings: their repr.
    got = compressor_from_spec("powersgd:rank=4,wire=bf16,ef=off")
    assert repr(got) == repr(PowerSGD(rank=4, wire="bf16", ef=False))
    # Defaults fill only what the spec leaves out.
    assert compressor_from_spec("topk", algo="native").algo == "native"
    assert compressor_from_spec("topk:gather_algo=ring", gather_algo="native").gather_algo == "ring"
    assert [cls.name for cls in compressors().values()] == list(compressors())


def test_strategy_specs_build_the_typed_configs() -> None:
    assert strategy_from_spec("ddp") == TorchDDPConfig()
    assert strategy_from_spec("ddp-fp16:static_graph=yes") == TorchDDPConfig(
        hook="fp16", static_graph=True
    )
    assert strategy_from_spec("ddp-powersgd:rank=8") == TorchPowerSGDConfig(rank=8)
    assert strategy_from_spec("commfuse:algo=ring") == CommfuseDPConfig(algo="ring")
    got = strategy_from_spec("topk:ratio=0.1,staleness=1")
    assert isinstance(got, CommfuseDPConfig) and got.staleness == 1
    assert repr(got.compressor) == repr(TopK(ratio=0.1))
    # Local SGD: the method's function's arguments; a compressor rides the method's algo.
    assert strategy_from_spec("local-sgd:H=4") == local_sgd(H=4)
    assert strategy_from_spec("post-local-sgd:warmup_steps=3") == post_local_sgd(warmup_steps=3)
    assert strategy_from_spec("slowmo:beta=0.7,alpha=0.5") == slowmo(beta=0.7, alpha=0.5)
    assert strategy_from_spec("streaming-diloco:num_fragments=2") == streaming_diloco(
        num_fragments=2
    )
    nested = strategy_from_spec("diloco:H=50,compressor=int8,algo=native")
    expected = diloco(H=50, algo="native", compressor=Int8(algo="native"))
    assert repr(nested) == repr(expected)
    assert strategy_from_spec("diloco:H=50,compressor=sparseloco") == diloco(
        H=50, compressor=SparseLoCo()
    )
    assert strategy_from_spec("onebit-adam:freeze_step=20") == OneBitAdamConfig(freeze_step=20)
    assert strategy_from_spec("zeroone-adam:exchange=none") == ZeroOneAdamConfig(exchange="none")


def test_every_listed_strategy_builds() -> None:
    for name, line in strategy_listing():
        assert line
        if name == "ddp-bf16" and not bf16_hooks_supported():
            with pytest.raises(ValueError, match="bf16 hooks only in a build with CUDA"):
                strategy_from_spec(name)
            continue
        strategy_from_spec(name)
    with pytest.raises(ValueError, match="unknown strategy 'none'"):
        strategy_from_spec("none")  # no compression is the commfuse strategy


def test_workload_specs_build_their_options() -> None:
    assert workload_from_spec("charlm:dim=64,layers=1") == CharLMConfig(dim=64, layers=1)
    assert workload_from_spec("Digits") == DigitsConfig()


def test_hierarchical_local_sgd_takes_the_runs_host_layout() -> None:
    """``--ranks-per-host`` becomes ranks_per_host of a hierarchical method, unless the spec
    says otherwise; other strategies keep their own default."""
    assert strategy_from_spec("local-sgd:hierarchical=1", ranks_per_host=2) == local_sgd(
        hierarchical=True, ranks_per_host=2
    )
    assert strategy_from_spec("diloco:hierarchical=1,ranks_per_host=4", ranks_per_host=2) == diloco(
        hierarchical=True, ranks_per_host=4
    )
    assert strategy_from_spec("local-sgd", ranks_per_host=2) == local_sgd()


#: One config of every kind the command line names, with settings off their defaults.
ROUND_TRIP: list[StrategyConfig] = [
    TorchDDPConfig(static_graph=True, first_bucket_cap_mb=2.0),
    TorchDDPConfig(hook="fp16", bucket_view=False),
    TorchPowerSGDConfig(rank=8, wire="fp16", error_feedback=False),
    CommfuseDPConfig(algo="ring", merge_buckets_by_cost=True),
    CommfuseDPConfig(compressor=PowerSGD(rank=8, wire="bf16"), staleness=1, first_bucket_cap_mb=2),
    local_sgd(H=4, inner_lr_scale=0.5, final_sync=False),
    local_sgd(hierarchical=True, ranks_per_host=2),
    post_local_sgd(H=4, warmup_steps=3),
    slowmo(beta=0.7, alpha=0.5),
    diloco(H=100, algo="ring", compressor=Int8(algo="ring")),
    diloco(compressor=TopK(ratio=0.1)),
    diloco(compressor=Int8(algo="native")),
    streaming_diloco(H=8, num_fragments=2, mix_global=0.9),
    # No method has a warm-up with an outer momentum: the general form has.
    PeriodicSyncConfig(warmup_steps=5, outer_momentum=0.5),
]
# The outer-gradient compressors and the optimizers that communicate.
ROUND_TRIP += [
    diloco(compressor=SparseLoCo(decay=1.0)),
    diloco(outer_momentum=0.0, compressor=DeMo()),
    streaming_diloco(compressor=Int4(chunk_numel=128)),
    OneBitAdamConfig(freeze_step=20, exchange="none"),
    ZeroOneAdamConfig(var_freeze_step=30, local_step_clipper=8),
]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=describe_strategy)
def test_a_description_is_the_spec_that_builds_the_config(config: StrategyConfig) -> None:
    text = describe_strategy(config)
    assert strategy_from_spec(text) == config, text


@pytest.mark.parametrize("name", [name for name, _ in strategy_listing()])
def test_every_name_describes_its_defaults_as_the_bare_name(name: str) -> None:
    if name == "ddp-bf16" and not bf16_hooks_supported():
        pytest.skip("torch refuses its bf16 hooks in this build")
    config = strategy_from_spec(name)
    assert describe_strategy(config) == name
    assert strategy_from_spec(describe_strategy(config)) == config


@pytest.mark.parametrize("name", [name for name in compressors() if name != "none"])
def test_every_compressor_round_trips_with_its_settings(name: str) -> None:
    cls = compressors()[name]
    variants: list[dict[str, Any]] = [{}, {"algo": "ring", "gather_algo": "ring", "seed": 3}]
    for settings in variants:
        compressor = cls(**settings)
        text = describe_compressor(compressor)
        assert compressor_from_spec(text) == compressor, text
        engine = CommfuseDPConfig(compressor=compressor, staleness=1)
        assert strategy_from_spec(describe_strategy(engine)) == engine
