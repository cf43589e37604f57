"""The docs quote what the reports hold, and say what the README says.

- A number the README's results quote, where a docs page quotes it too, sits next to a link to
  a report that holds it (the README's own report, or one that measured the same).
- The quick start quotes reports of the strategies its command runs today
  (``commfuse compare``'s ``DEFAULT_STRATEGIES``), not of an earlier default.
- Counts and limits stated in several places agree: the compressors against the table that
  lists them, the GPU statement against the README's.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: A decimal as the pages write a measurement: 0.708, 2.75x, 5.1%.
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?:x|%)?(?![\w.])")
REPORT = re.compile(r"benchmarks/([a-z0-9_.-]+\.md)")
IMAGE = re.compile(r"!\[[^\]]*\]\(benchmarks/([a-z0-9_.-]+)\.png\)")


def significant_digits(number: str) -> int:
    return len(number.replace(".", "").lstrip("0"))


def blocks(text: str) -> list[str]:
    """A page cut where a claim and its link sit together: paragraphs, and table rows one by one
    (each with the table's header row, whose link holds for every row)."""
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("|"):
            header, *rows = paragraph.splitlines()
            links = " ".join(f"benchmarks/{name}" for name in REPORT.findall(header))
            out.extend(f"{row}\n{links}" for row in rows[1:])
        else:
            out.append(paragraph)
    return out


def report_text(name: str) -> str:
    report = BENCH / name
    return report.read_text() if report.exists() else ""


def holds(name: str, number: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", report_text(name)) is not None


def readme_claims() -> dict[str, set[str]]:
    """Each number of three or more significant digits in the README's results -> its reports
    (shorter ones, 1.05 or 0.99, recur by chance across unrelated results, as does 1.000)."""
    text = README.read_text()
    results = text[text.index("## Results") : text.index("## Limits")]
    claims: dict[str, set[str]] = {}
    for row in results.splitlines():
        if not row.startswith("|") or "benchmarks/" not in row:
            continue
        cells = row.split("|")
        for match in NUMBER.finditer(cells[2]):  # the ratio measured
            if significant_digits(match.group(1)) >= 3 and float(match.group(1)) != 1.0:
                claims.setdefault(match.group(1), set()).update(REPORT.findall(cells[-2]))
    return claims


def docs_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_the_readme_has_results_to_hold_the_docs_to() -> None:
    claims = readme_claims()
    assert len(claims) > 30, "the README's results table moved: readme_claims() reads no numbers"
    assert all(claims.values()), "a README result with no report in its row"


def test_each_number_the_readme_quotes_sits_beside_a_report_that_holds_it_in_the_docs() -> None:
    claims = readme_claims()
    wrong = []
    for page in docs_pages():
        for block in blocks(page.read_text()):
            linked = set(REPORT.findall(block))
            for match in NUMBER.finditer(block):
                number = match.group(1)
                if number not in claims:
                    continue
                if not any(holds(r, number) for r in linked):
                    wrong.append(
                        f"{page.name}: {match.group(0)} (the README's "
                        f"{sorted(claims[number])}) beside {sorted(linked) or 'no report'}"
                    )
    assert not wrong, "docs numbers no linked report holds:\n" + "\n".join(wrong)


def test_the_quick_start_quotes_reports_of_the_strategies_its_command_runs() -> None:
    from commfuse.bench.compare import DEFAULT_STRATEGIES

    text = (DOCS / "quickstart.md").read_text()
    # The compressed strategies are what its results are about.
    specs = [spec for spec in DEFAULT_STRATEGIES if ":" in spec]

    def of_today(name: str) -> bool:
        return all(spec in report_text(name) for spec in specs)

    for image in IMAGE.findall(text):
        assert of_today(f"{image}.md"), (
            f"quickstart.md shows {image}.png, a run without today's strategies {specs}"
        )
    quoted = 0
    for block in re.split(r"\n\s*\n", text):  # paragraphs, a table whole
        linked = REPORT.findall(block)
        for match in NUMBER.finditer(block) if linked else ():
            holders = [name for name in linked if holds(name, match.group(1))]
            assert holders, f"quickstart.md: {match.group(0)} is in none of {linked}"
            assert any(of_today(name) for name in holders), (
                f"quickstart.md quotes {match.group(0)} from {holders}, which did not run "
                f"`commfuse compare`'s strategies of today: {specs}"
            )
            quoted += 1
    assert quoted, "the quick start quotes no measurement beside its report"


NUMBER_WORDS = {
    word: n
    for n, word in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}


def compressor_table_count() -> int:
    """The compressor classes data-parallel.md's table lists, ``NoCompression`` aside."""
    text = (DOCS / "data-parallel.md").read_text()
    section = text[text.index("## Compressors") :]
    table = section[section.index("| class |") :].split("\n\n")[0]
    names = [
        name
        for row in table.splitlines()[2:]
        for name in re.findall(r"`(\w+)`", row.split("|")[1])
        if name != "NoCompression"
    ]
    return len(names)


def test_every_count_of_the_compressors_matches_the_table() -> None:
    listed = compressor_table_count()
    assert listed >= 10
    said = []
    for page in [README, *docs_pages()]:
        for word in re.findall(r"\b(\w+)(?: gradient)? compressors\b", page.read_text()):
            n = NUMBER_WORDS.get(word.lower(), int(word) if word.isdigit() else None)
            if n is not None and n != listed:
                said.append(f"{page.name}: {word} compressors")
    assert not said, f"data-parallel.md's table lists {listed} compressors, but: {said}"


def test_the_home_page_and_quick_start_state_gpus_as_the_readme_does() -> None:
    limits = README.read_text().split("## Limits", 1)[1]
    lead = re.search(r"\*\*GPU: ([^*]+?)\.?\*\*", limits)
    assert lead, "the README's limits have no **GPU: ...** statement"
    for page in (DOCS / "index.md", DOCS / "quickstart.md"):
        text = " ".join(page.read_text().split())
        assert lead.group(1).lower() in text.lower(), (
            f"{page.name} does not say what the README says of GPUs: {lead.group(1)!r}"
        )
        assert "written but untested" not in text, f"{page.name} calls the GPU paths untested"
