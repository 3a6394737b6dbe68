"""BENCHMARKS.md and README.md as a results page: the headline tables are what benchmarks.headline
generates from the committed results JSONs, every row names a JSON that exists, and the pages
describe the project rather than its development. Reads files only (no training)."""

from __future__ import annotations

import re

import pytest

from benchmarks import headline

ROOT = headline.ROOT

# Words of a development log, not of a results page. Word boundaries keep legitimate text out
# ("possession"; a file name such as fedgnn_sweep_<...>.json is not prose).
FORBIDDEN = (
    r"\bsessions?\b",
    r"\bissues? ?#",
    r"\bissues? \d",
    r"local code",
    r"throw-?away",
    r"\.\./shared",
    r"earlier (run|preset)",
    r"before the change",
    r"\bpatch(es|ed)?\b",
)


def _text(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize("name, start, end, which", headline.BLOCKS)
def test_the_headline_block_is_the_generated_table(name, start, end, which):
    text = _text(name)
    assert text.count(start) == 1 and text.count(end) == 1, f"{name}: one pair of headline markers"
    assert headline.current_block(text, start, end) == headline.block(start, end, which), (
        f"{name}: the headline table differs from `python -m benchmarks.headline` "
        "(a number edited by hand or a stale table): run `python -m benchmarks.headline --write`")


def test_every_headline_row_names_an_existing_json_and_selects_one_run_per_seed():
    assert headline.ROWS
    for row in headline.ROWS:
        assert (headline.RESULTS / row.source).is_file(), row.source
        vals = headline.values(row)  # raises on an empty selection or a seed counted twice
        assert vals and all(v == v for v in vals), row
        assert f"`{row.source}`" in headline.cells(row)["source"]


def test_headline_commands_use_the_data_placeholder():
    for row in headline.ROWS:
        cmd = headline.command(row)
        assert cmd.startswith("python -m benchmarks.run --preset ") and "--data-dir DATA" in cmd, cmd
        assert "{" not in cmd, cmd


def test_the_generated_table_is_in_the_page_and_has_every_row():
    page = _text("BENCHMARKS.md")
    table = headline.table("full")
    assert table in page
    assert len(table.splitlines()) == 2 + len(headline.ROWS)
    assert 0 < len(headline.table("readme").splitlines()) - 2 < len(headline.ROWS)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:] if nxt < 0 else text[start:nxt]


@pytest.mark.parametrize("pattern", FORBIDDEN)
def test_the_pages_do_not_read_like_a_development_log(pattern):
    bench = _text("BENCHMARKS.md")
    readme = _text("README.md")
    assert not re.search(pattern, bench, re.IGNORECASE), (pattern, re.search(pattern, bench, re.IGNORECASE))
    # README's configuration section belongs to its own page owner and still shows a local data
    # path in its examples; the data path is checked in README's results section only.
    scope = _section(readme, "## Results") if pattern == r"\.\./shared" else readme
    assert not re.search(pattern, scope, re.IGNORECASE), (pattern, re.search(pattern, scope, re.IGNORECASE))


def test_benchmarks_opens_with_the_headline_and_keeps_the_section_order():
    page = _text("BENCHMARKS.md")
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Headline"
    subjects = ["FedGNN accuracy", "Graph expansion", "Privacy measurements", "FPPDM", "Performance", "Scale",
                "Reliability"]
    found = [next(i for i, h in enumerate(headings) if subject in h) for subject in subjects]
    assert found == sorted(found), headings
    assert sum(h.startswith("## Appendix") for h in headings) <= 1
