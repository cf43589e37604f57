"""The documentation and the benchmark reports: they build, they link, their numbers are real.

- ``mkdocs build --strict`` runs here, so a broken link, a missing page or snippet, or an API
  name the reference cannot resolve fails the suite.
- ``benchmarks/`` follows its README: names ``{topic}_{setup}.{md,json,png}`` (never a date), every
  JSON and PNG beside its report, every report linked from the README or the docs, every report
  naming its command, machine, date and raw data.
- No page tells the history of its own making.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
README = ROOT / "README.md"
DOCS = ROOT / "docs"

NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*_[a-z0-9]+(?:-[a-z0-9]+)*\.(md|json|png)$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def reports() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.md") if p.name != "README.md")


def pages() -> list[Path]:
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "benchmarks" not in p.parts)]


@pytest.mark.e2e
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (pip install -e '.[dev]' provides mkdocs):\n"
        f"{proc.stdout}{proc.stderr}"
    )
    assert (tmp_path / "site" / "api" / "ddp" / "index.html").exists()


def test_benchmark_files_are_named_by_topic_and_setup() -> None:
    bad = [
        p.name
        for p in BENCH.iterdir()
        if p.is_file() and p.name != "README.md" and not NAME.match(p.name)
    ]
    assert not bad, f"not {{topic}}_{{setup}}.{{md,json,png}}: {bad}"


def test_benchmarks_hold_reports_and_device_scripts_only() -> None:
    folders = sorted(p.name for p in BENCH.iterdir() if p.is_dir())
    assert folders == ["device"], (
        f"benchmarks/ holds reports and device/ only (benchmarks/README.md), found {folders}"
    )


#: The largest file ``benchmarks/`` keeps: a larger raw trace stays out of git and its report
#: says how its command writes it again (``benchmarks/README.md``).
MAX_BENCHMARK_BYTES = 1 << 20


def test_no_benchmark_file_is_over_a_megabyte() -> None:
    big = [
        f"{p.relative_to(ROOT)} ({p.stat().st_size / 1e6:.1f} MB)"
        for p in BENCH.rglob("*")
        if p.is_file() and p.stat().st_size > MAX_BENCHMARK_BYTES
    ]
    assert not big, f"raw traces over 1 MB stay out of git (benchmarks/README.md): {big}"


def test_every_json_and_png_has_its_report() -> None:
    for data in [*BENCH.glob("*.json"), *BENCH.glob("*.png")]:
        report = data.with_suffix(".md")
        assert report.exists(), f"{data.name} has no report {report.name}"
        assert data.name in report.read_text(), f"{report.name} does not link {data.name}"
        if data.suffix == ".json":
            json.loads(data.read_text())  # raw data that parses


def test_every_report_names_its_command_machine_date_and_data() -> None:
    for report in reports():
        text = report.read_text()
        for field in ("Command:", "Machine:", "Date:"):
            assert field in text, f"{report.name} lacks {field!r}"
        assert report.with_suffix(".json").name in text, f"{report.name} lacks its raw JSON"
        assert re.search(r"Date: \d{4}-\d{2}-\d{2}", text), f"{report.name}: no date"


def test_every_strategy_a_page_tells_to_run_parses() -> None:
    # A report's command or a page's example that no longer parses cannot be rerun.
    from commfuse.cli.spec import strategy_from_spec

    pages = [*reports(), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    specs = {
        (page.name, spec)
        for page in pages
        for spec in re.findall(r"--strategy ([^\s`\"']+)", page.read_text())
        if not spec.split(":")[0].isupper()  # a placeholder (NAME, SPEC), not a spec
    }
    assert len(specs) > 10
    for name, spec in sorted(specs):
        try:
            strategy_from_spec(spec)
        except ValueError as err:
            raise AssertionError(f"{name}: --strategy {spec} does not parse: {err}") from None


def linked_targets(page: Path) -> set[Path]:
    found = set()
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        found.add((page.parent / target.split("#")[0]).resolve())
    return found


def test_every_report_is_linked_from_the_readme_or_the_docs() -> None:
    linked: set[Path] = set()
    for page in pages():
        linked |= linked_targets(page)
    # docs/benchmarks is a link to benchmarks/ (so the site renders the reports)
    unlinked = [r.name for r in reports() if r.resolve() not in linked]
    assert not unlinked, f"reports linked from neither README.md nor docs/: {unlinked}"


HISTORY = [
    re.compile(r"\bsession\s+\d", re.IGNORECASE),
    re.compile(r"\bissue\s+#?\d", re.IGNORECASE),
    re.compile(r"\btargets?\b[^.|\n]{0,40}\b(met|missed)\b", re.IGNORECASE),
    re.compile(r"\bbefore this (change|session)\b", re.IGNORECASE),
    re.compile(r"\bthis session\b", re.IGNORECASE),
]


def test_no_page_tells_the_history_of_its_making() -> None:
    for page in [*pages()[1:], *reports(), BENCH / "README.md"]:  # the README: test_readme.py
        for lineno, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in HISTORY:
                assert not pattern.search(line), f"{page.relative_to(ROOT)}:{lineno}: {line}"
