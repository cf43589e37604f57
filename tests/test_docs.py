"""The documentation and the benchmark reports: they build, they link, their numbers are real.

- ``mkdocs build --strict`` runs here, so a broken link, a missing page or snippet, or an API
  name the reference cannot resolve fails the suite.
- ``benchmarks/`` follows its README: names ``{topic}_{setup}.{md,json,png}`` (never a date), every
  JSON and PNG beside its report, every report linked from the README or the docs, every report
  naming its command, machine, date and raw data.
- No page tells the history of its own making.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site ``mkdocs build --strict`` writes, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (pip install -e '.[dev]' provides mkdocs):\n"
        f"{proc.stdout}{proc.stderr}"
    )
    return out


@pytest.mark.e2e
def test_mkdocs_build_strict(site: Path) -> None:
    assert (site / "api" / "ddp" / "index.html").exists()
    assert (site / "404.html").exists()


#: Packages the API reference leaves out: the command line's parsers (its reference is
#: ``--help``) and the measuring commands, documented by their own functions on ``api/bench.md``.
NOT_IN_API = {"cli", "bench"}
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.MULTILINE)


def api_pages() -> dict[str, list[str]]:
    """Each API reference page (``docs/api/NAME.md``) -> the modules it documents whole."""
    out: dict[str, list[str]] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        modules = []
        for target in DIRECTIVE.findall(page.read_text()):
            try:
                modules.append(importlib.import_module(target).__name__)
            except ImportError:  # a function or class of a module: commfuse.bench.compare.X
                continue
        out[page.stem] = modules
    return out


def public_names(module: ModuleType) -> list[str]:
    """What a module exports: its ``__all__``, or else what it defines without an underscore."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and getattr(obj, "__module__", None) == module.__name__
        and (inspect.isclass(obj) or inspect.isfunction(obj))
    ]


def anchors(obj: object, module: str, name: str) -> set[str]:
    """The ids a name's entry may have: where its package exports it, or where it is defined
    (``commfuse.localsgd.diloco.diloco``: the function shares its name with its submodule, so
    the package's entry would be the module's)."""
    found = {f"{module}.{name}"}
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and hasattr(obj, "__qualname__"):
        found.add(f"{obj.__module__}.{obj.__qualname__}")
    return found


def test_every_package_has_an_api_page() -> None:
    packages = {
        p.parent.name for p in (ROOT / "src" / "commfuse").glob("*/__init__.py")
    } - NOT_IN_API
    documented = {m.split(".")[1] for modules in api_pages().values() for m in modules if "." in m}
    assert packages <= documented, f"packages without an API page: {sorted(packages - documented)}"
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [page for page in api_pages() if f"api/{page}.md" not in nav]
    assert not missing, f"API pages missing from mkdocs.yml's nav: {missing}"


@pytest.mark.e2e
def test_every_exported_name_has_an_anchor_on_its_api_page(site: Path) -> None:
    missing = []
    for page, modules in api_pages().items():
        html = (site / "api" / page / "index.html").read_text()
        ids = set(re.findall(r'id="([^"]+)"', html))
        for module_name in modules:
            module = importlib.import_module(module_name)
            for name in public_names(module):
                if not anchors(getattr(module, name), module_name, name) & ids:
                    missing.append(f"api/{page}.md: {module_name}.{name}")
    assert not missing, (
        "exported names with no entry in the API reference (a public name needs a docstring, "
        f"and one that shares its submodule's name an explicit ::: block): {missing}"
    )


@pytest.mark.e2e
def test_every_api_page_has_one_title(site: Path) -> None:
    for page in api_pages():
        html = (site / "api" / page / "index.html").read_text()
        main = html[html.index('role="main"') :]
        titles = re.findall(r"<h1\b", main)
        assert len(titles) == 1, f"api/{page}.md renders {len(titles)} <h1>"
        heads = re.findall(r"<h[12][^>]*>(.*?)</h[12]>", main, re.DOTALL)
        text = [re.sub(r"<[^>]+>|&para;", "", h).strip() for h in heads]
        repeated = {t for t in text if text.count(t) > 1}
        assert not repeated, f"api/{page}.md repeats the heading(s) {repeated}"


@pytest.mark.e2e
def test_the_site_loads_code_colours_and_lists_every_report(site: Path) -> None:
    home = (site / "index.html").read_text()
    for css in ("css/pygments.css", "css/extra.css"):
        assert css in home and (site / css).exists(), f"the site does not load {css}"
    quick = (site / "quickstart" / "index.html").read_text()
    assert '<div class="highlight"><pre>' in quick and "<span class=" in quick, "no coloured code"
    assert ".highlight .k " in (site / "css" / "pygments.css").read_text()
    not_in_nav = [r.stem for r in reports() if f"benchmarks/{r.stem}/" not in home]
    assert not not_in_nav, f"reports missing from the navigation: {not_in_nav}"
    one = (site / "benchmarks" / reports()[0].stem / "index.html").read_text()
    assert "../../benchmarking/#the-reports" in one, "a report with no link back"
    assert "/edit/main/benchmarks/" in one, "a report's edit link goes through docs/benchmarks"
    # 404.html is served at any depth: its links must be absolute (site_url's path), or it
    # loads no style and no navigation.
    assert 'href="/commfuse/css/base.css"' in (site / "404.html").read_text()
    assert "edit/main/docs/" in quick, "Edit on GitHub does not point at main"


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


#: The top navigation's budget: at 1280 px the theme's container is 1140 px wide, and the
#: search, previous, next and edit links take about 400 of them. Five short entries fit in one
#: row; the guides, the reports and the API reference are menus.
MAX_TOP_NAV_ENTRIES = 5
MAX_TOP_NAV_CHARS = 40


def test_the_top_navigation_fits_one_row() -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    titles = [next(iter(item)) if isinstance(item, dict) else str(item) for item in nav]
    assert len(titles) <= MAX_TOP_NAV_ENTRIES, f"{len(titles)} top entries: {titles}"
    assert sum(map(len, titles)) <= MAX_TOP_NAV_CHARS, f"top entries too long: {titles}"


#: A link to a file of this repository on GitHub (mkdocs cannot check it: it is absolute).
REPO_LINK = re.compile(r"https://github\.com/commfuse/commfuse/(?:blob|tree)/main/([^)\s#\]]+)")


def test_every_link_to_a_repository_file_names_one_that_exists() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages()
        for path in REPO_LINK.findall(page.read_text())
        if not (ROOT / path).exists()
    ]
    assert not missing, f"links to files this repository does not have: {missing}"


#: Guide pages that explain rather than turn a feature on.
EXPLAINERS = {"torch-hooks-on-gloo.md", "design.md"}


def test_every_guide_opens_with_how_to_turn_it_on_and_gives_results_before_the_internals() -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    guides = next(item["Guides"] for item in nav if isinstance(item, dict) and "Guides" in item)
    for entry in guides:
        (path,) = entry.values()
        if path in EXPLAINERS:
            continue
        text = (DOCS / path).read_text()
        heads = [(m.group(1), m.start()) for m in re.finditer(r"(?m)^## (.+)$", text)]
        second = heads[1][1] if len(heads) > 1 else len(text)
        assert re.search(r"```(python|bash)|--8<--", text[:second]), (
            f"{path}: no snippet (python or a command) before its second section"
        )
        at = {title: start for title, start in heads}
        for internals in ("How it works", "How it is measured", "Design notes"):
            if "Results" in at and internals in at:
                assert at["Results"] < at[internals], f"{path}: {internals} before Results"
