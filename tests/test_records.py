"""The typed records every command writes: each kind reads back what it wrote, every result
JSON under ``benchmarks/`` loads through its kind's ``from_json`` and renders, and a record that
lacks a typed field, or names another kind, is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from commfuse.bench import records as R
from commfuse.cli import main
from commfuse.cli.report import render_result

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = sorted(BENCH.glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_benchmark_json_loads_through_its_kinds_record_and_renders(path: Path) -> None:
    data = json.loads(path.read_text())
    typed = R.load(data)
    rows = data if isinstance(data, list) else [data]
    assert all(type(r) is R.RECORDS[R.kind_named(data)] for r in typed)
    assert [r.to_json() for r in typed] == rows  # nothing lost, nothing added
    again = [r.to_json() for r in typed]
    assert render_result(again if isinstance(data, list) else again[0]) == render_result(data)


#: One record of every kind, with only its typed fields (and one extra key).
EXAMPLES: dict[R.Kind, dict[str, Any]] = {
    "bench collectives": {"op": "all_reduce", "algo": "ring", "bytes": 4096, "time_us": 1.5},
    "bench fused": {"op": "gemm_all_reduce", "shape": [8, 8, 8], "fused_us": 2.0},
    "bench fused --step": {"op": "dlrm_step", "shape": [4, 2], "fused_us": 2.0},
    "bench ddp": {"engine": "dataparallel", "step_s": 0.1},
    "bench pipeline": {
        "schedule": "1f1b",
        "step_s": 0.1,
        "bubble_formula": 0.27,
        "bubble_measured": 0.3,
    },
    "bench strategies": {"strategy": "ddp", "step_s": 0.1, "ratio_to_first": 1.0},
    "bench cli": {"command": "--help", "tree": "new", "wall_s": 0.2},
    "compare": {"strategy": "ddp", "step_time_s": 0.1},
    "compare --fault-tolerant": {"strategy": "ddp", "mode": "ft", "goodput_ratio": 0.9},
    "train": {"strategy": "ddp", "step_time_s": 0.1},
    "train --fault-tolerant": {"strategy": "ddp", "mode": "ddp"},
    "tune": {"intra": {"alpha_s": 1e-5}, "inter": {"alpha_s": 1e-4}},
    "tune calibration": {
        "collective": "all_reduce",
        "algo": "ring",
        "bytes": 4096,
        "measured_s": 1e-4,
        "model_s": 1.1e-4,
    },
    "simulate": {"ranks": 8, "step_us": 100.0},
    "simulate --scale": {"ranks": 8, "series": "ring", "step_us": 100.0},
    "simulate --validate": {"config": "c", "predicted_us": 1.0, "measured_us": 1.1, "error": -0.1},
    "gpu check": {"device": "cuda:0", "backend": "nccl", "checks": [], "failed": []},
}


def test_every_kind_has_an_example() -> None:
    assert set(EXAMPLES) == set(R.KINDS)


@pytest.mark.parametrize("kind", R.KINDS)
def test_a_record_reads_back_what_it_wrote(kind: R.Kind) -> None:
    row = {**EXAMPLES[kind], "note": "kept as written"}
    (record,) = R.of_kind(kind, [row])
    assert record.kind == kind and record.extra == {"note": "kept as written"}
    assert next(iter(record.to_json())) == "kind"
    assert record.to_json() == {"kind": kind, **row}
    assert type(record).from_json(record.to_json()) == record
    text = R.to_text(kind, row if record.single else [row])
    assert R.load(json.loads(text)) == [record]


@pytest.mark.parametrize("kind", R.KINDS)
def test_a_record_that_lacks_a_typed_field_is_refused_naming_it(kind: R.Kind) -> None:
    row = dict(EXAMPLES[kind])
    field = next(iter(row))
    del row[field]
    with pytest.raises(ValueError, match=f"{kind!r} record lacks its field {field!r}"):
        R.of_kind(kind, [row])


def test_a_field_of_the_wrong_type_is_refused_and_floats_take_whole_numbers() -> None:
    row = dict(EXAMPLES["bench collectives"])
    with pytest.raises(ValueError, match="'bytes' is '4K'"):
        R.of_kind("bench collectives", [row | {"bytes": "4K"}])
    with pytest.raises(ValueError, match="'bytes' is True"):
        R.of_kind("bench collectives", [row | {"bytes": True}])
    (record,) = R.of_kind("bench collectives", [row | {"time_us": 2}])  # JSON's 2 for 2.0
    assert record.to_json()["time_us"] == 2


def test_a_row_that_names_another_kind_is_refused() -> None:
    row = {"kind": "compare", **EXAMPLES["compare"]}
    with pytest.raises(ValueError, match="a 'bench ddp' record names kind 'compare'"):
        R.of_kind("bench ddp", [row])


def test_one_record_and_lists_are_told_apart_by_kind() -> None:
    train = {"kind": "train", **EXAMPLES["train"]}
    with pytest.raises(ValueError, match="a 'train' result is one record"):
        R.load([train])
    compare = {"kind": "compare", **EXAMPLES["compare"]}
    with pytest.raises(ValueError, match="a 'compare' result is a list of records"):
        R.load(compare)
    with pytest.raises(ValueError, match="several kinds"):
        R.load([compare, {"kind": "bench ddp", **EXAMPLES["bench ddp"]}])


def test_the_simulated_step_writes_a_record_report_renders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "step.json"
    assert main(["simulate", "--ranks", "8", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["kind"] == "simulate" and data["ranks"] == 8
    capsys.readouterr()
    assert main(["report", str(path)]) == 0
    header, row = capsys.readouterr().out.splitlines()[-2:]
    assert header.split()[:2] == ["ranks", "step_ms"]
    assert row.split()[1] == f"{data['step_us'] / 1e3:.3f}"


#: Commands whose --json is not a result: ``commfuse net`` writes the labs' state.
NOT_RESULTS = {"net.py"}


def test_every_command_writes_its_json_through_the_records() -> None:
    """No command serialises its records itself: ``json.dumps`` in ``cli/`` is a record that
    skipped its kind (``commfuse report`` could not render it)."""
    import ast

    cli = Path(__file__).resolve().parents[1] / "src" / "commfuse" / "cli"
    offenders = []
    for path in sorted(cli.rglob("*.py")):
        if path.name in NOT_RESULTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "dumps"
            ):
                offenders.append(f"{path.relative_to(cli)}:{node.lineno}")
    assert not offenders, f"records written without commfuse.bench.records: {offenders}"
