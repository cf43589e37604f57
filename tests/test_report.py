"""``commfuse report``: every result JSON renders as its command's table, and the tables in the
benchmark reports are exactly what it renders (generated, not typed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from commfuse.bench.records import KINDS, RECORDS
from commfuse.cli import main
from commfuse.cli.report import KINDS as report_kinds
from commfuse.cli.report import control_line, kind_of, render_result, report, update_report

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


def test_kinds_are_looked_up_by_the_kind_the_records_name() -> None:
    collective = {"op": "all_reduce", "algo": "ring", "bytes": 4, "time_us": 1.0}
    assert kind_of([collective | {"kind": "bench collectives"}]) == "bench collectives"
    assert kind_of([{"kind": "compare", "strategy": "ddp", "step_time_s": 1.0}]) == "compare"
    ft = {"strategy": "ddp (ft)", "mode": "ft", "goodput_ratio": 1.0, "step_time_s": 1.0}
    assert kind_of([ft | {"kind": "compare --fault-tolerant"}]) == "compare --fault-tolerant"
    strategies = {"strategy": "ddp", "step_s": 1.0, "ratio_to_first": 1.0}
    assert kind_of([strategies | {"kind": "bench strategies"}]) == "bench strategies"
    assert kind_of({"kind": "tune", "intra": {}, "inter": {}}) == "tune"
    scale = {"kind": "simulate --scale", "ranks": 2, "series": "tree", "step_us": 1.0}
    assert kind_of([scale]) == "simulate --scale"
    gpu = {"kind": "gpu check", "device": "cuda:0", "backend": "nccl", "checks": [], "failed": []}
    assert kind_of(gpu) == "gpu check"
    cli = {"kind": "bench cli", "command": "--help", "tree": "new", "wall_s": 0.1}
    assert kind_of([cli]) == "bench cli"


def test_a_record_that_names_its_kind_is_rendered_as_that_kind() -> None:
    """``kind`` decides, whatever the other keys: a compare record that also has a strategies
    record's keys."""
    record = {"strategy": "ddp", "step_time_s": 0.1, "step_s": 0.1, "ratio_to_first": 1.0}
    assert kind_of([record | {"kind": "compare"}]) == "compare"
    assert kind_of([record | {"kind": "bench strategies"}]) == "bench strategies"
    assert "step_ms" in render_result([record | {"kind": "bench strategies"}]).splitlines()[0]
    assert "final_loss" in render_result([record | {"kind": "compare"}]).splitlines()[0]
    # simulate --validate's records name a configuration's kind as config_kind
    validation = {"config": "c", "predicted_us": 1.0, "measured_us": 1.0, "error": 0.0}
    records = [validation | {"kind": "simulate --validate", "config_kind": "step"}]
    assert kind_of(records) == "simulate --validate"
    assert render_result(records).splitlines()[1].split()[:2] == ["c", "step"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"strategy": "ddp", "step_time_s": 1.0}], "name no kind"),
        ({"intra": {}, "inter": {}}, "name no kind"),
        ([{"kind": "collective", "op": "all_reduce"}], "kind 'collective'"),
    ],
)
def test_a_record_without_a_known_kind_is_refused_naming_the_kinds(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        render_result(data)
    for kind in KINDS:  # every kind, in the message
        assert repr(kind) in str(info.value)


def test_every_kind_of_record_has_its_table() -> None:
    assert set(report_kinds) == set(KINDS) == set(RECORDS)


def test_a_missing_value_prints_as_a_dash() -> None:
    record = {"op": "broadcast", "algo": "tree", "bytes": 1024, "time_us": 12.5, "wrong": 0}
    record["kind"] = "bench collectives"
    row = render_result([record]).splitlines()[1]  # no algbw, busbw, %link in this record
    assert "12.5" in row and " - " in row


def test_rows_judged_by_their_interval_print_the_speedups_interval() -> None:
    base = {"op": "all_reduce", "algo": "native", "bytes": 4096, "time_us": 10.0, "wrong": 0}
    base |= {"kind": "bench collectives", "iters": 10}  # rounds: enough for a 95% interval
    records = [
        {**base, "variant": "native", "speedup_vs_first": 1.0, "tie": None, "ratio_ci": [1, 1]},
        # time ratios 0.5-0.8 of the baseline: 1.25x to 2x as fast
        {**base, "variant": "ring", "speedup_vs_first": 1.6, "tie": False, "ratio_ci": [0.5, 0.8]},
    ]
    lines = render_result(records).splitlines()
    header, baseline_row, ring_row = lines[0], lines[-2], lines[-1]
    assert "speedup_95%" in header and "1.25-2.00" in ring_row and " - " in baseline_row
    without = [{k: v for k, v in r.items() if k != "ratio_ci"} for r in records]
    assert "speedup_95%" not in render_result(without).splitlines()[0]


FT_GOODPUT = BENCH / "fault-tolerance-goodput_netlab-4x100mbit-2core.json"


@pytest.mark.parametrize("rounds", [2, 5, 6, 9])
def test_an_interval_over_fewer_than_six_rounds_is_headed_range_not_95(rounds: int) -> None:
    # Below six rounds the median's interval is the rounds' whole range (at two rounds it
    # covers half the time): no table may call it 95%.
    label = "95%" if rounds >= 6 else "range"
    base = {"op": "all_reduce", "algo": "native", "bytes": 4096, "time_us": 10.0, "wrong": 0}
    base["kind"] = "bench collectives"
    collectives = [
        {**base, "variant": v, "iters": rounds, "speedup_vs_first": s, "tie": t, "ratio_ci": ci}
        for v, s, t, ci in [("native", 1.0, None, [1, 1]), ("ring", 1.6, False, [0.5, 0.8])]
    ]
    for r in collectives:
        r["control_ratio"] = 1.01
    ft = [{**r, "repeats": rounds} for r in json.loads(FT_GOODPUT.read_text())]
    for records, head in ((collectives, f"speedup_{label}"), (ft, label)):
        for markdown in (False, True):
            header = render_result(records, markdown=markdown).splitlines()[0]
            assert head in header.replace("|", " ").split(), header
        note = control_line(records)
        assert note is not None
        assert ("95% interval over rounds" in note) == (rounds >= 6), note
        assert ("range over rounds" in note) == (rounds < 6), note


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


def test_update_keeps_what_follows_the_table_and_writes_the_control_line(tmp_path: Path) -> None:
    source = next(p for p in RESULTS if '"control_ratio": 0.' in p.read_text())
    data = json.loads(source.read_text())
    table = render_result(data, markdown=True)
    note = control_line(data)
    assert note is not None
    by_hand = "A/A control by hand: a paragraph that reads the control.\n\nMore words.\n"
    stale = f"# t\n\n## Results\n\n| old |\n|-----|\n|   1 |\n\n{by_hand}\n## Reading it\n"
    (tmp_path / source.name).write_text(source.read_text())
    report_md = tmp_path / source.with_suffix(".md").name
    report_md.write_text(stale)
    assert update_report(tmp_path / source.name) is True
    expected = f"# t\n\n## Results\n\n{table}\n\n{note}\n\n{by_hand}\n## Reading it\n"
    assert report_md.read_text() == expected
    assert update_report(tmp_path / source.name) is False  # its own output is up to date


def test_update_needs_a_report_beside_the_json(tmp_path: Path) -> None:
    (tmp_path / "alone.json").write_text(RESULTS[0].read_text())
    with pytest.raises(ValueError, match=r"no report alone\.md"):
        update_report(tmp_path / "alone.json")


CONTROLLED = [p for p in RESULTS if '"control_ratio": ' in p.read_text()]


@pytest.mark.parametrize("path", CONTROLLED, ids=[p.stem for p in CONTROLLED])
def test_a_run_with_an_ab_control_prints_its_line_under_the_table(path: Path) -> None:
    ratios = {
        r["control_ratio"]
        for r in json.loads(path.read_text())
        if r.get("control_ratio") is not None
    }
    for markdown in (False, True):
        text = report([path], markdown=markdown)
        line = next(line for line in text.splitlines() if line.startswith("A/A control"))
        assert f"{min(ratios):.3f}" in line and "(tie)" in line, line


def test_a_simulated_collective_has_a_row_per_size_and_rank_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "c.json"
    argv = ["simulate", "--op", "all_reduce", "--sizes", "64K,16M", "--algo", "ring,doubling"]
    assert main([*argv, "--scale", "8,16", "--json", str(records)]) == 0
    printed = capsys.readouterr().out.splitlines()
    data = json.loads(records.read_text())
    assert {(r["bytes"], r["ranks"]) for r in data} == {
        (s, p) for s in (64 << 10, 16 << 20) for p in (8, 16)
    }
    table = render_result(data).splitlines()
    assert table[0].split()[:4] == ["size", "ranks", "ring_ms", "doubling_ms"]
    assert [row.split()[:2] for row in table[1:]] == [
        ["64K", "8"],
        ["64K", "16"],
        ["16M", "8"],
        ["16M", "16"],
    ]
    assert table == printed[-len(table) :]  # the command prints what report renders
    # Several rank counts: each series over its own time at the first count.
    assert table[0].split()[4:] == ["ring_vs_8_ranks", "doubling_vs_8_ranks"]
    ring = {(r["bytes"], r["ranks"]): r["step_us"] for r in data if r["series"] == "ring"}
    assert table[2].split()[4] == f"{ring[(64 << 10, 16)] / ring[(64 << 10, 8)]:.2f}"


def test_a_simulation_at_one_rank_count_compares_each_series_with_the_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--op", "all_reduce", "--sizes", "64K", "--algo", "ring,doubling"]
    assert main([*argv, "--ranks", "1024"]) == 0
    header, row = capsys.readouterr().out.splitlines()[-2:]
    # Not each series over itself (1.00 in every cell): the second over the first.
    assert header.split() == ["size", "ranks", "ring_ms", "doubling_ms", "doubling_vs_ring"]
    _, _, ring_ms, doubling_ms, ratio = row.split()
    assert float(ratio) == pytest.approx(float(doubling_ms) / float(ring_ms), abs=0.01)
    assert float(ratio) < 0.5  # doubling's log p rounds against ring's 2(p - 1) at 64 KB


def _plot_of(kind: str) -> Any:
    """The function the bench command of ``kind`` draws its --plot with."""
    from commfuse.cli.bench import fused
    from commfuse.cli.bench.report import plot_steps

    return {
        "bench fused": fused.plot_rows,
        "bench fused --step": fused.plot_rows,
        "bench ddp": plot_steps("engine"),
        "bench strategies": plot_steps("strategy"),
    }.get(kind)


PLOTTED = [p for p in RESULTS if _plot_of(kind_of(json.loads(p.read_text()))) is not None]


@pytest.mark.parametrize("path", PLOTTED, ids=[p.stem for p in PLOTTED])
def test_the_bench_commands_plot_their_records(path: Path, tmp_path: Path) -> None:
    data = json.loads(path.read_text())
    png = tmp_path / "plot.png"
    _plot_of(kind_of(data))(data, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def _compare_result() -> Path:
    return next(p for p in RESULTS if kind_of(json.loads(p.read_text())) == "compare")


def test_runs_of_several_seeds_merge_into_one_result_with_a_seed_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = json.loads(_compare_result().read_text())
    paths = []
    for seed in (0, 1):
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps([{**r, "seed": seed} for r in records]))
    merged = tmp_path / "seeds.json"
    assert main(["report", *map(str, paths), "--json", str(merged)]) == 0
    data = json.loads(merged.read_text())
    assert [r["seed"] for r in data] == [0] * len(records) + [1] * len(records)
    lines = render_result(data).splitlines()
    assert lines[0].split()[0] == "seed" and len(lines) == 1 + 2 * len(records)
    assert render_result(records).splitlines()[0].split()[0] == "strategy"  # one seed: none
    # A workload or a schedule that varies gets its column too, after the seed.
    varied = [
        {**r, "seed": 0, "lr_schedule": "cosine:warmup_steps=0,min_ratio=0.1"} for r in records
    ]
    varied += [{**r, "seed": 0, "workload": "digits"} for r in records]
    header = render_result(varied).splitlines()[0].split()
    assert header[:3] == ["workload", "lr_schedule", "strategy"]
    assert render_result(varied).splitlines()[-1].split()[:2] == ["digits", "-"]
    other = next(p for p in RESULTS if kind_of(json.loads(p.read_text())) != "compare")
    assert main(["report", str(paths[0]), str(other), "--json", str(merged)]) == 2
    assert "different commands" in capsys.readouterr().err


def test_engine_runs_of_several_models_in_one_file_get_a_model_column() -> None:
    records = json.loads((BENCH / "ddp-engine_netlab-4x1gbit-2core.json").read_text())
    mlp = [r for r in records if r["model"].startswith("mlp")]
    assert render_result(mlp).splitlines()[0].split()[0] == "engine"  # one model: none
    lines = render_result(records).splitlines()
    assert lines[0].split()[:2] == ["model", "engine"]
    assert {line.split()[0] for line in lines[1:]} == {r["model"] for r in records}


def test_rounds_of_a_fault_tolerant_compare_in_several_files_merge_into_one_result(
    tmp_path: Path,
) -> None:
    source = BENCH / "fault-tolerance-goodput_netlab-4x100mbit-2core.json"
    records = json.loads(source.read_text())
    assert all(len(r["rounds"]) == 2 for r in records)
    paths = []
    for i in (0, 1):  # each round as if it had been a job of its own
        paths.append(tmp_path / f"round{i}.json")
        paths[-1].write_text(json.dumps([{**r, "rounds": r["rounds"][i : i + 1]} for r in records]))
    merged = tmp_path / "rounds.json"
    assert main(["report", *map(str, paths), "--json", str(merged)]) == 0
    data = json.loads(merged.read_text())
    # One record per job, its medians, ratios, control and fault times over both rounds.
    assert render_result(data) == render_result(records)
    for key in ("s_per_step", "time_ratio", "goodput_ratio", "detect_s", "tie", "committed_steps"):
        assert [r[key] for r in data] == [r[key] for r in records], key
    # Runs of different jobs do not merge.
    paths[1].write_text(json.dumps(records[:2]))
    assert main(["report", *map(str, paths), "--json", str(merged)]) == 2


def test_plot_bytes_draws_compare_results_and_refuses_others(tmp_path: Path) -> None:
    png = tmp_path / "bytes.png"
    assert main(["report", str(_compare_result()), "--plot-bytes", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    other = next(p for p in RESULTS if kind_of(json.loads(p.read_text())) == "bench collectives")
    assert main(["report", str(other), "--plot-bytes", str(png)]) == 2


def test_the_frontier_keeps_the_points_no_other_beats_on_both_axes() -> None:
    from commfuse.bench.compare import pareto_frontier

    points = {
        "ddp": (12.9, 1.89),
        "cheap": (0.01, 1.93),
        "dominated": (0.5, 1.95),  # more bytes and a higher loss than "mid"
        "mid": (0.1, 1.90),
        "tie": (0.1, 1.91),  # mid's bytes, a higher loss
        "best": (3.4, 1.88),
    }
    assert pareto_frontier(points) == ["cheap", "mid", "best"]
