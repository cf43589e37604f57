"""``commfuse report``: every result JSON renders as its command's table, and the tables in the
benchmark reports are exactly what it renders (generated, not typed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commfuse.cli import main
from commfuse.cli.report import kind_of, render_result, report, update_report

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = sorted(BENCH.glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_benchmark_json_renders_as_the_table_in_its_report(path: Path) -> None:
    data = json.loads(path.read_text())
    table = render_result(data, markdown=True)
    assert table.count("\n") >= 2, table
    assert table in path.with_suffix(".md").read_text(), (
        f"{path.with_suffix('.md').name}'s table is not `commfuse report {path.name}`'s output "
        f"(after a change to a command's columns: commfuse report benchmarks/*.json --update)"
    )


def test_kinds_are_told_apart_by_their_keys() -> None:
    collective = {"op": "all_reduce", "algo": "ring", "time_us": 1.0}
    assert kind_of([collective]) == "bench collectives"
    assert kind_of([{"strategy": "ddp", "step_time_s": 1.0}]) == "compare"
    assert kind_of([{"strategy": "ddp", "step_s": 1.0, "ratio_to_first": 1.0}]) == (
        "bench strategies"
    )
    assert kind_of({"intra": {}, "inter": {}}) == "tune"
    assert kind_of([{"ranks": 2, "series": "tree", "step_us": 1.0}]) == "simulate --scale"


def test_a_missing_value_prints_as_a_dash() -> None:
    record = {"op": "broadcast", "algo": "tree", "bytes": 1024, "time_us": 12.5, "wrong": 0}
    row = render_result([record]).splitlines()[1]  # no algbw, busbw, %link in this record
    assert "12.5" in row and " - " in row


@pytest.mark.parametrize(
    ("content", "message"),
    [("not json", "not a JSON file"), ('{"a": 1}', "not a commfuse result"), ("[]", "not a")],
)
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        report([path])
    assert str(path) in str(info.value)


def test_the_command_prints_and_writes_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tables.md"
    paths = [str(RESULTS[0]), str(RESULTS[-1])]
    assert main(["report", *paths, "--markdown", str(out)]) == 0
    printed = capsys.readouterr().out
    assert RESULTS[0].name in printed and RESULTS[-1].name in printed
    written = out.read_text()
    assert written.count("## ") == 2 and "|---" in written


def test_the_command_exits_2_on_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_update_rewrites_only_the_table(tmp_path: Path) -> None:
    source = RESULTS[0]
    data, text = source.read_text(), source.with_suffix(".md").read_text()
    table = render_result(json.loads(data), markdown=True)
    (tmp_path / source.name).write_text(data)
    stale = text.replace(table, "| old |\n|-----|\n|   1 |")
    assert stale != text
    (tmp_path / source.with_suffix(".md").name).write_text(stale)
    assert update_report(tmp_path / source.name) is True
    assert (tmp_path / source.with_suffix(".md").name).read_text() == text
    assert update_report(tmp_path / source.name) is False


def test_update_needs_a_report_beside_the_json(tmp_path: Path) -> None:
    (tmp_path / "alone.json").write_text(RESULTS[0].read_text())
    with pytest.raises(ValueError, match=r"no report alone\.md"):
        update_report(tmp_path / "alone.json")
