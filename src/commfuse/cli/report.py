"""``commfuse report``: render result JSON files as the tables their commands printed.

    commfuse report benchmarks/fused_netlab-4x1gbit-2core.json
    commfuse report a.json b.json --markdown tables.md
    commfuse report benchmarks/*.json --update   # rewrite each report's table from its JSON
    commfuse report seed0.json seed1.json --json seeds.json          # one file of both runs
    commfuse report seeds.json --plot-bytes seeds.png  # held-out loss against bytes (compare)

Every command that writes ``--json`` writes a list of records (or one record, for ``train``,
``tune``'s profile and ``simulate``'s step); each record names the command that wrote it in
its ``kind`` (``commfuse.bench.records``), and this command prints the columns ``KINDS`` gives
that kind, the same columns the command printed, so the tables in ``docs/`` and
``benchmarks/`` are generated from the raw data instead of typed. A value an older record lacks
prints as ``-``. The one-GPU check (``benchmarks/device/gpu_check.sh``) writes one object of
checks; it renders as one row per check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.bench.records import KINDS as RECORD_KINDS
from commfuse.bench.records import Kind as RecordKind
from commfuse.bench.records import kind_named, load, to_text
from commfuse.bench.table import interval_label, ratio_cell
from commfuse.cli.common import Subparsers, add_command, add_output_arguments, output_path
from commfuse.cli.output import write_file, write_output
from commfuse.units import format_size

Record = dict[str, Any]
Column = tuple[str, Callable[[Record], str]]


def _ms(key: str, spec: str = ".1f") -> Callable[[Record], str]:
    return lambda r: format(r[key] * 1e3, spec)


_STRATEGIES_COLUMNS: tuple[Column, ...] = (
    ("strategy", lambda r: r["strategy"]),
    ("step_ms", _ms("step_s")),
    ("min-max_ms", lambda r: f"{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}"),
    ("time/first", lambda r: ratio_cell(r, "ratio_to_first")),
    ("spread", lambda r: f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"),
    ("/compute", lambda r: f"{r['step_over_compute']:.2f}"),
    ("fwd_ms", _ms("forward_s")),
    ("bwd+sync_ms", _ms("backward_sync_s")),
    ("opt_ms", _ms("optimizer_s")),
    ("cpu_ms", _ms("cpu_s_per_step")),
    ("floor_ms", _ms("cpu_floor_s")),
    ("MB/step", lambda r: f"{r['bytes_per_step'] / 1e6:.3f}"),
)

_DDP_COLUMNS: tuple[Column, ...] = (
    ("engine", lambda r: r["engine"]),
    ("step_ms", _ms("step_s")),
    ("min-max_ms", lambda r: f"{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}"),
    ("exposed_ms", _ms("exposed_comm_s")),
    ("time/torch", lambda r: ratio_cell(r, "ratio_to_torch_ddp")),
    ("spread", lambda r: f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"),
    ("buckets", lambda r: "-" if r["num_buckets"] is None else str(r["num_buckets"])),
)

_PIPELINE_COLUMNS: tuple[Column, ...] = (
    ("schedule", lambda r: r["schedule"]),
    ("stages", lambda r: str(r["stages"])),
    ("micro", lambda r: str(r["micro_batches"])),
    ("step_ms", _ms("step_s")),
    ("min-max_ms", lambda r: f"{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}"),
    ("time/sequential", lambda r: ratio_cell(r, "ratio_to_sequential")),
    ("spread", lambda r: f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"),
    ("bubble", lambda r: f"{r['bubble_measured']:.3f}"),
    ("formula", lambda r: f"{r['bubble_formula']:.3f}"),
    ("MB/step", lambda r: f"{r['bytes_per_step'] / 1e6:.3f}"),
)

_TRAIN_COLUMNS: tuple[Column, ...] = (
    ("strategy", lambda r: r["strategy"]),
    ("steps", lambda r: str(r["steps"])),
    ("step_ms", _ms("step_time_s", ".0f")),
    ("compute_ms", _ms("compute_step_time_s", ".0f")),
    ("MB/step", lambda r: f"{r['bytes_per_step'] / 1e6:.3f}"),
    ("final_loss", lambda r: f"{r['final_loss']:.3f}"),
    ("held_loss", lambda r: f"{r['eval_loss']:.3f}"),
)

_CLI_COLUMNS: tuple[Column, ...] = (
    ("command", lambda r: r["command"]),
    ("tree", lambda r: r["tree"]),
    ("wall_ms", _ms("wall_s", ".0f")),
    ("min-max_ms", lambda r: f"{r['wall_s_min'] * 1e3:.0f}-{r['wall_s_max'] * 1e3:.0f}"),
    ("time/first", lambda r: ratio_cell(r, "ratio_to_first")),
    ("spread", lambda r: f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"),
    ("cpu_ms", _ms("cpu_s", ".0f")),
    ("cpu/first", lambda r: f"{r['cpu_ratio_to_first']:.3f}"),
    ("torch", lambda r: "yes" if r["imports_torch"] else "no"),
    ("torch_import_ms", lambda r: f"{r['torch_import_us'] / 1e3:.0f}"),
    ("imports", lambda r: str(r["num_imports"])),
)

_PROFILE_COLUMNS: tuple[Column, ...] = (
    ("link", lambda r: r["link"]),
    ("alpha_us", lambda r: f"{r['alpha_s'] * 1e6:.1f}"),
    ("beta_GB/s", lambda r: f"{1e-9 / r['beta_s_per_byte']:.4f}"),
    ("gamma_GB/s", lambda r: f"{1e-9 / r['gamma_s_per_byte']:.2f}"),
)

_VALIDATION_COLUMNS: tuple[Column, ...] = (
    ("configuration", lambda r: r["config"]),
    ("kind", lambda r: r["config_kind"]),
    ("runs", lambda r: str(r["runs"])),
    ("predicted_ms", lambda r: f"{r['predicted_us'] / 1e3:.2f}"),
    ("measured_ms", lambda r: f"{r['measured_us'] / 1e3:.2f}"),
    ("error", lambda r: f"{r['error'] * 100:+.1f}%"),
)


_TRAIN_FT_COLUMNS: tuple[Column, ...] = (
    ("strategy", lambda r: r["strategy"]),
    ("mode", lambda r: r["mode"]),
    ("steps", lambda r: str(r["steps"])),
    ("committed", lambda r: str(r["committed_steps"])),
    ("step_ms", _ms("step_time_s", ".0f")),
    ("final_loss", lambda r: f"{r['final_loss']:.3f}"),
    ("held_loss", lambda r: f"{r['eval_loss']:.3f}"),
    ("restarts", lambda r: str(r["restarts"])),
)

#: ``commfuse tune --json``: one row per calibration point (``*``: what ``auto`` picks there).
_TUNE_CALIBRATION_COLUMNS: tuple[Column, ...] = (
    ("collective", lambda r: r["collective"]),
    ("size", lambda r: format_size(r["bytes"])),
    ("algo", lambda r: r["algo"] + ("*" if r["chosen"] else "")),
    ("block", lambda r: format_size(r["block_bytes"]) if r.get("block_bytes") else "-"),
    ("measured_ms", _ms("measured_s", ".3f")),
    ("model_ms", _ms("model_s", ".3f")),
    ("model_err", lambda r: f"{r['model_err'] * 100:+.0f}%"),
    ("loo_err", lambda r: f"{r['loo_err'] * 100:+.0f}%"),
)

#: ``commfuse simulate`` (one step): the predicted step and its parts.
_SIMULATE_COLUMNS: tuple[Column, ...] = (
    ("ranks", lambda r: str(r["ranks"])),
    ("step_ms", lambda r: f"{r['step_us'] / 1e3:.3f}"),
    ("compute_ms", lambda r: f"{r['compute_us'] / 1e3:.3f}"),
    ("exposed_ms", lambda r: f"{r['exposed_comm_us'] / 1e3:.3f}"),
    ("overlapped_ms", lambda r: f"{r['overlapped_comm_us'] / 1e3:.3f}"),
    ("collectives", lambda r: str(r["num_collectives"])),
)


#: ``benchmarks/device/gpu_check.sh``: one row per check (a relative error and a step time where
#: the check timed a gradient exchange).
_GPU_CHECK_COLUMNS: tuple[Column, ...] = (
    ("check", lambda r: r["name"]),
    ("result", lambda r: "ok" if r["ok"] else f"FAILED: {r['error']}"),
    ("device", lambda r: r["device"]),
    ("rel_error", lambda r: f"{r['relative_error']:.3g}"),
    ("step_ms", lambda r: f"{r['step_ms']:.2f}"),
    ("ms/MB", lambda r: f"{r['ms_per_mb']:.3f}"),
    ("check_s", lambda r: f"{r['seconds']:.2f}"),
)


def _collective_columns() -> Sequence[Column]:
    from commfuse.bench.table import COLLECTIVE_COLUMNS

    return COLLECTIVE_COLUMNS


def _fused_columns() -> Sequence[Column]:
    from commfuse.bench.fused import COLUMNS

    return COLUMNS


def _fused_step_columns() -> Sequence[Column]:
    from commfuse.bench.fused_steps import COLUMNS

    return COLUMNS


def _compare_columns(records: Sequence[Record]) -> Sequence[Column]:
    from commfuse.bench.compare import compare_columns

    return compare_columns(records)


def kind_of(data: Any) -> RecordKind:
    """Which command wrote ``data`` (the parsed JSON): the ``kind`` its records name
    (``commfuse.bench.records``).

    Raises:
        ValueError: records that name no kind, or one no command writes (the message lists
            the kinds).
    """
    return kind_named(data)


def _safe(fmt: Callable[[Record], str]) -> Callable[[Record], str]:
    def cell(record: Record) -> str:
        try:
            return fmt(record)
        except (KeyError, TypeError):
            return "-"

    return cell


def _table(records: Sequence[Record], columns: Sequence[Column], markdown: bool) -> str:
    from commfuse.bench.table import render

    return render(records, [(name, _safe(fmt)) for name, fmt in columns], markdown=markdown)


def _scale_table(records: Sequence[Record], markdown: bool) -> str:
    """One row per rank count (and message size, for a collective), one column per series
    (ms), then time ratios, each over a baseline of the same size: with several rank counts,
    each series over its own time at the first count (``ring_vs_8_ranks``: how the step
    grows); at one rank count, each series after the first over the first at that count
    (``rabenseifner_vs_ring``)."""
    series = list(dict.fromkeys(r["series"] for r in records))
    ranks = list(dict.fromkeys(r["ranks"] for r in records))
    sizes = list(dict.fromkeys(r.get("bytes") for r in records))
    time_us = {(r.get("bytes"), r["ranks"], r["series"]): r["step_us"] for r in records}
    # (column, series, baseline series, baseline rank count: None for the row's own)
    ratios: list[tuple[str, str, str, int | None]]
    if len(ranks) > 1:
        ratios = [(f"{s}_vs_{ranks[0]}_ranks", s, s, ranks[0]) for s in series]
    else:
        ratios = [(f"{s}_vs_{series[0]}", s, series[0], None) for s in series[1:]]
    rows: list[Record] = []
    for size in sizes:
        for p in ranks:
            row: Record = {"bytes": size, "ranks": p}
            for s in series:
                row[f"{s} ms"] = time_us[(size, p, s)] / 1e3
            for name, s, base, base_ranks in ratios:
                baseline = time_us[(size, p if base_ranks is None else base_ranks, base)]
                row[name] = time_us[(size, p, s)] / max(baseline, 1e-12)
            rows.append(row)
    columns: list[Column] = [("ranks", lambda r: str(r["ranks"]))]
    if sizes != [None]:
        columns.insert(0, ("size", lambda r: format_size(r["bytes"])))
    columns += [(f"{s}_ms", _cell(f"{s} ms", ".3f")) for s in series]
    columns += [(name, _cell(name, ".2f")) for name, *_ in ratios]
    return _table(rows, columns, markdown)


def _cell(key: str, spec: str) -> Callable[[Record], str]:
    return lambda r: format(r[key], spec)


def _validation_table(records: Sequence[Record], markdown: bool) -> str:
    """Median signed error of each held-out configuration over the runs, then the summary
    (the calibration fits' residuals, role ``calibration``, are not held out: left out)."""
    by_config: dict[str, list[Record]] = {}
    for r in records:
        if r.get("role", "validation") != "validation":
            continue
        by_config.setdefault(r["config"], []).append(r)
    rows = [
        {
            "config": config,
            "config_kind": runs[0].get("config_kind", "-"),
            "runs": len(runs),
            "predicted_us": statistics.median(r["predicted_us"] for r in runs),
            "measured_us": statistics.median(r["measured_us"] for r in runs),
            "error": statistics.median(r["error"] for r in runs),
        }
        for config, runs in by_config.items()
    ]
    absolute = [abs(r["error"]) for r in rows]
    summary = (
        f"held-out configurations: {len(rows)}, median |error| "
        f"{statistics.median(absolute) * 100:.1f}%, max {max(absolute) * 100:.1f}%"
    )
    return _table(rows, _VALIDATION_COLUMNS, markdown) + "\n\n" + summary


def _speedup_interval_cell(record: dict[str, Any]) -> str:
    """The interval of ``speedup`` (the inverse of the record's time-ratio interval,
    ``ratio_ci``: 95% from six rounds, their range below), ``low-high``; "-" for the baseline
    and records without one."""
    interval = record.get("ratio_ci")
    if interval is None or record.get("tie") is None:
        return "-"
    low, high = (1.0 / v if v > 0 else float("inf") for v in reversed(interval))
    return f"{low:.2f}-{high:.2f}"


def render_result(data: Any, *, markdown: bool = False) -> str:
    """The table the command that wrote ``data`` printed (Markdown with ``markdown=True``).

    Args:
        data: a parsed ``--json`` file of ``bench``, ``compare``, ``train``, ``tune`` or
            ``simulate``.
        markdown: a Markdown table instead of aligned plain text.

    Returns:
        The table, without a trailing newline.

    Raises:
        ValueError: when ``data`` is not such a file: its records name no kind, or one no
            command writes (the message lists the kinds), or lack a field their kind types.
    """
    kind = kind_of(data)
    rows = [record.to_json() for record in load(data)]
    return KINDS[kind].table(rows if isinstance(data, list) else rows[0], markdown)


def _collectives_table(data: Any, markdown: bool) -> str:
    columns = list(_collective_columns())
    layouts = {(r.get("hosts"), r.get("ranks_per_host")) for r in data}
    if len(layouts) > 1:  # several runs in one file (a scaling sweep): say which is which
        columns.insert(0, ("hosts", lambda r: f"{r['hosts']}x{r['ranks_per_host']}"))
    if len({r.get("run") for r in data}) > 1:  # runs of one layout, tagged by the report
        columns.insert(0, ("run", lambda r: str(r.get("run", "-"))))
    if any(r.get("ratio_ci") is not None for r in data):  # rows judged by their interval too
        at = next(i for i, (name, _) in enumerate(columns) if name == "speedup") + 1
        label = f"speedup_{interval_label(data)}"  # 95% from six rounds, else range
        columns.insert(at, (label, _speedup_interval_cell))
    return _table(data, columns, markdown)


def _compare_table(data: Any, markdown: bool) -> str:
    columns = list(_compare_columns(data))
    # Runs of several seeds, workloads or schedules in one file: a column for each that
    # varies, before the strategy.
    for key in ("lr_schedule", "workload", "seed"):
        if len({str(r.get(key)) for r in data}) > 1:
            columns.insert(0, (key, _setting(key)))
    return _table(data, columns, markdown)


def _compare_ft_table(data: Any, markdown: bool) -> str:
    from commfuse.bench.compare_ft import columns as ft_columns

    return _table(data, ft_columns(data), markdown)


def _ddp_table(data: Any, markdown: bool) -> str:
    columns = list(_DDP_COLUMNS)
    if len({str(r.get("model")) for r in data}) > 1:  # runs of several models in one file
        columns.insert(0, ("model", _setting("model")))
    return _table(data, columns, markdown)


def _profile_table(data: Any, markdown: bool) -> str:
    rows = [{"link": link, **data[link]} for link in ("intra", "inter")]
    return _table(rows, _PROFILE_COLUMNS, markdown)


def _columns_table(columns: Callable[[], Sequence[Column]]) -> Callable[[Any, bool], str]:
    return lambda data, markdown: _table(data, columns(), markdown)


@dataclasses.dataclass(frozen=True)
class Kind:
    """How ``commfuse report`` renders the result of one command: its table, and what its A/A
    control times twice (the control line's word; None: the command has no control)."""

    table: Callable[[Any, bool], str]
    control: str | None = None


#: Every kind of result (``commfuse.bench.records.Kind``) and its table: a new column or a new
#: command's table goes here, and nowhere else in the report.
KINDS: dict[RecordKind, Kind] = {
    "bench collectives": Kind(_collectives_table, "algorithm"),
    "bench fused": Kind(_columns_table(_fused_columns)),
    "bench fused --step": Kind(_columns_table(_fused_step_columns)),
    "compare": Kind(_compare_table, "strategy"),
    "compare --fault-tolerant": Kind(_compare_ft_table, "run"),
    "bench strategies": Kind(_columns_table(lambda: _STRATEGIES_COLUMNS), "strategy"),
    "bench ddp": Kind(_ddp_table, "engine"),
    "bench pipeline": Kind(_columns_table(lambda: _PIPELINE_COLUMNS), "schedule"),
    "bench cli": Kind(_columns_table(lambda: _CLI_COLUMNS)),
    "simulate --scale": Kind(_scale_table),
    "simulate --validate": Kind(_validation_table),
    "train": Kind(lambda data, markdown: _table([data], _TRAIN_COLUMNS, markdown)),
    "train --fault-tolerant": Kind(
        lambda data, markdown: _table([data], _TRAIN_FT_COLUMNS, markdown)
    ),
    "gpu check": Kind(lambda data, markdown: _table(data["checks"], _GPU_CHECK_COLUMNS, markdown)),
    "tune": Kind(_profile_table),
    "tune calibration": Kind(_columns_table(lambda: _TUNE_CALIBRATION_COLUMNS)),
    "simulate": Kind(lambda data, markdown: _table([data], _SIMULATE_COLUMNS, markdown)),
}
assert set(KINDS) == set(RECORD_KINDS), "every kind of record has its table"


def control_line(data: Any) -> str | None:
    """The A/A control line the command that wrote ``data`` printed under its table (the
    noise floor, A'/A, and what a tie means); None when the run had no control.

    Raises:
        ValueError: when ``data`` is not a commfuse result.
    """
    from commfuse.bench.table import control_note

    kind = kind_of(data)
    if not isinstance(data, list):
        return None
    return control_note(data, KINDS[kind].control or "variant")


def _load(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from err
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from err


def _merged_records(paths: Sequence[str | Path]) -> list[Record]:
    """The records of every file, in order, as one list: runs of one command that could not
    share a job (several seeds of ``compare``, each its own run) made one result; rounds of
    ``compare --fault-tolerant`` split across files become one record per job over every
    round (``commfuse.bench.compare_ft.merge_rounds``).

    Raises:
        ValueError: a file that is not a list of records, or files of different commands.
    """
    records: list[Record] = []
    kinds: set[str] = set()
    files: list[list[Record]] = []
    for path in paths:
        data = _load(path)
        try:
            kinds.add(kind_of(data))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        if not isinstance(data, list):
            raise ValueError(f"{path}: one record (train, tune); only lists of records merge")
        records += data
        files.append(data)
    if len(kinds) > 1:
        raise ValueError(f"files of different commands do not merge: {', '.join(sorted(kinds))}")
    if kinds == {"compare --fault-tolerant"} and len(files) > 1:
        from commfuse.bench.compare_ft import merge_rounds

        # Rounds of the same jobs: one record per job, over every round.
        return merge_rounds(files)
    return records


def plot_bytes(paths: Sequence[str | Path], out: str | Path) -> None:
    """Plot held-out loss against bytes per step of the ``compare`` records in ``paths`` (one
    plot; a strategy in several files, runs of several seeds, at its medians).

    Raises:
        ValueError: a file that is not a ``compare`` result.
    """
    from commfuse.bench.compare import plot_loss_vs_bytes

    records = _merged_records(paths)
    if kind_of(records) != "compare":
        raise ValueError(f"--plot-bytes plots compare results, not {kind_of(records)}")
    plot_loss_vs_bytes(records, out)


def report(paths: Sequence[str | Path], *, markdown: bool = False) -> str:
    """Each file's table under a heading naming the file and the command that wrote it, with
    the A/A control's line under it where the run had one.

    Raises:
        ValueError: a file that is not JSON, or not a commfuse result (the message names it).
    """
    parts: list[str] = []
    for path in paths:
        data = _load(path)
        try:
            table = render_result(data, markdown=markdown)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        note = control_line(data)
        if note:
            table += ("\n\n" if markdown else "\n") + note
        heading = f"{Path(path).name} (commfuse {kind_of(data)})"
        parts.append(f"## {heading}\n\n{table}" if markdown else f"# {heading}\n{table}")
    return "\n\n".join(parts)


#: The table of a report ``X.md`` beside ``X.json``: the Markdown table right after
#: ``## Results`` and the A/A control's line under it as ``control_line`` writes it, if any (``benchmarks/README.md``
#: describes the layout); what follows them (a plot, a paragraph, the next section) stays.
_RESULTS_BLOCK = re.compile(
    r"(## Results\n\n)((?:\|[^\n]*(?:\n|$))+"
    # the lines render_result and control_line print under a table, nothing written by hand
    r"(?:\n(?:held-out configurations: |A/A control \(the baseline )[^\n]*(?:\n|$))*)"
)


def _setting(key: str) -> Callable[[dict[str, Any]], str]:
    """A run setting's cell (``-`` where the record has none: a constant rate)."""
    return lambda r: "-" if r.get(key) is None else str(r[key])


def update_report(path: str | Path) -> bool:
    """Rewrite the table in the report beside the result JSON ``path`` from that JSON, with
    the A/A control's line under it where the run had one; the rest of the report stays.

    Returns:
        Whether the report changed.

    Raises:
        ValueError: no report beside ``path``, no ``## Results`` table in it, or ``path`` not a
            result JSON.
    """
    report_path = Path(path).with_suffix(".md")
    if not report_path.exists():
        raise ValueError(f"{path}: no report {report_path.name} beside it")
    text = report_path.read_text()
    match = _RESULTS_BLOCK.search(text)
    if match is None:
        raise ValueError(f"{report_path}: no '## Results' table to update")
    data = json.loads(Path(path).read_text())
    block = render_result(data, markdown=True) + "\n"
    note = control_line(data)
    if note:
        block += "\n" + note + "\n"
    updated = text[: match.start(2)] + block + text[match.end(2) :]
    if updated != text:
        report_path.write_text(updated)
    return updated != text


def register(sub: Subparsers) -> None:
    parser = add_command(
        sub,
        "report",
        _run_report,
        help="print result JSON files as the tables their commands printed (--markdown: as Markdown)",
        doc=__doc__,
    )
    parser.add_argument("results", nargs="+", metavar="RESULTS.json", help="--json output files")
    add_output_arguments(
        parser,
        json="the records of every file in one list (runs of several seeds, one result)",
        markdown="the same tables",
    )
    parser.add_argument(
        "--plot-bytes",
        metavar="PATH",
        type=output_path,
        help="plot held-out loss against MB per step (log scale) of compare results, one "
        "marker per strategy (several seeds: at their medians), the frontier joined",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="rewrite the table of the report X.md beside each X.json instead of printing",
    )


def _run_report(args: argparse.Namespace) -> int:
    """Print every file's table; ``--markdown PATH`` writes the same tables as Markdown;
    ``--update`` rewrites the reports' tables instead, ``--json PATH`` writes the files' records
    as one, ``--plot-bytes PATH`` plots them (compare results)."""
    if args.update:
        for path in args.results:
            print(
                f"{Path(path).with_suffix('.md')}: {'updated' if update_report(path) else 'unchanged'}"
            )
        return 0
    if args.json:
        merged = _merged_records(args.results)
        written = write_output(args, args.json, to_text(kind_of(merged), merged))
        print(f"records of {len(args.results)} file(s) written to {written}")
        return 0
    if args.plot_bytes:
        plotted = write_file(args, args.plot_bytes, lambda path: plot_bytes(args.results, path))
        if plotted is not None:
            print(f"plot (held-out loss against MB per step) written to {plotted}")
        return 0
    print(report(args.results))
    if args.markdown:
        write_output(args, args.markdown, report(args.results, markdown=True) + "\n")
    return 0
