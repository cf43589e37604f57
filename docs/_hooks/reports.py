"""An mkdocs hook: the benchmark reports in the navigation, and a way back from each.

The reports live in ``benchmarks/`` (``docs/benchmarks`` links to it), one per measurement, and
new ones arrive with the changes that measure them. Listing them by hand in ``mkdocs.yml``
would go stale, so this hook fills the navigation's "Benchmarks > Reports" section from the
folder: each report under the first page that cites it, in the navigation's order, the home
page aside (the others under "Other"). It also opens each report with the pages that cite it and the
Benchmarking page, so a reader who arrives at a report from a link can get back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
BENCH = DOCS / "benchmarks"
SECTION = "Benchmarks"
LINK = re.compile(r"\]\((?:\./)?benchmarks/([a-z0-9_.-]+\.md)")

#: report file name -> [(page title, page path relative to docs/)], filled by on_config.
_CITED: dict[str, list[tuple[str, str]]] = {}


def _pages(nav: list[Any]) -> list[tuple[str, str]]:
    """The (title, path) of every page in the navigation, in its order."""
    out: list[tuple[str, str]] = []
    for item in nav:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, str):
                    out.append((title, value))
                elif isinstance(value, list):
                    out.extend(_pages(value))
        elif isinstance(item, str):
            out.append((item, item))
    return out


def _title(report: Path) -> str:
    # The file name says the topic and the setup: powersgd-peer_netlab-4x100mbit-2core.md.
    topic, _, setup = report.stem.partition("_")
    return f"{topic} ({setup})"


def on_config(config: Any) -> Any:
    nav = config["nav"]
    pages = [
        (title, path)
        for title, path in _pages(nav)
        if not path.startswith(("benchmarks/", "api/")) and (DOCS / path).is_file()
    ]
    _CITED.clear()
    for title, path in pages:
        for name in LINK.findall((DOCS / path).read_text(encoding="utf-8")):
            cited = _CITED.setdefault(name, [])
            if (title, path) not in cited:
                cited.append((title, path))
    groups: dict[str, list[dict[str, str]]] = {}
    for report in sorted(BENCH.glob("*.md")):
        if report.name == "README.md":
            continue
        # The home page cites a few headline reports; they belong with their topic's page.
        citing = [title for title, path in _CITED.get(report.name, []) if path != "index.md"]
        group = citing[0] if citing else "Other"
        groups.setdefault(group, []).append({_title(report): f"benchmarks/{report.name}"})
    order = [title for title, _ in pages] + ["Other"]
    reports = [{group: groups[group]} for group in order if group in groups]
    for item in nav:
        if isinstance(item, dict) and SECTION in item:
            item[SECTION] = [entry for entry in item[SECTION] if "Reports" not in entry]
            item[SECTION].append({"Reports": reports})
            break
    else:
        raise ValueError(f"mkdocs.yml's nav has no {SECTION!r} section for the reports")
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    src = page.file.src_uri
    if not src.startswith("benchmarks/"):
        return markdown
    name = src.removeprefix("benchmarks/")
    # docs/benchmarks links to benchmarks/: edit the file where it lives.
    if page.edit_url:
        page.edit_url = page.edit_url.replace("/docs/benchmarks/", "/benchmarks/")
    links = [
        f"[{title}](../{path})"
        for title, path in _CITED.get(name, [])
        if path != "benchmarking.md"  # linked as "All reports" below
    ]
    back = "Cited on: " + ", ".join(links) + ". " if links else ""
    line = (
        f'<p class="report-back" markdown>{back}All reports: '
        "[Benchmarking](../benchmarking.md#the-reports).</p>"
    )
    title, sep, rest = markdown.partition("\n")
    return f"{title}\n\n{line}\n{sep}{rest}" if title.startswith("# ") else f"{line}\n\n{markdown}"
