"""The README and docs/ as readers meet them: short enough, every link leading somewhere, and about the
project only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.paths import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but hyphens and underscores dropped,
    spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_and_every_docs_page_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    long = {p.name: n for p in (ROOT / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, f"docs pages of 400 lines or more: {long}"


def test_the_docs_speak_of_the_project_not_of_its_development():
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\bsessions?\b", text, re.I), f"{page.name} speaks of work sessions"
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), (
            f"{page.name} holds a date: history goes in benchmarks/results"
        )


def test_the_strategy_table_names_every_strategy_of_the_library():
    """docs/strategies.md's table of the library, row by row, against the registry."""
    from megatron_paradyse.strategies import strategy_names

    text = (ROOT / "docs" / "strategies.md").read_text()
    table = text[text.index("| strategy | sublayer |") :].split("\n\n")[0]
    rows = {
        re.match(r"\| `(\w+)` \| ([\w, ]+) \|", row).groups() for row in table.splitlines()[2:] if row.startswith("| `")
    }
    listed = {(name, sub.strip().lower()) for name, subs in rows for sub in subs.split(",")}
    registered = {(name, sublayer) for sublayer in ("attention", "mlp") for name in strategy_names(sublayer)}
    assert listed == registered
