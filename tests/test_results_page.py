"""BENCHMARKS.md and README.md as a results page: the headline tables are what `fedrec results-page`
(fedrec_flwr.reporting.results_page) generates from the committed results JSONs, every row names a JSON that exists,
and the pages describe the project rather than its development. Reads files only (no training)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedrec_flwr.cli.commands import main
from fedrec_flwr.reporting import results_page

ROOT = results_page.ROOT

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


@pytest.mark.parametrize("name, start, end, which", results_page.BLOCKS)
def test_the_headline_block_is_the_generated_table(name, start, end, which):
    text = _text(name)
    assert text.count(start) == 1 and text.count(end) == 1, f"{name}: one pair of headline markers"
    assert results_page.current_block(text, start, end) == results_page.block(start, end, which), (
        f"{name}: the headline table differs from `fedrec results-page` "
        "(a number edited by hand or a stale table): run `fedrec results-page --write`")


def test_every_headline_row_names_an_existing_json_and_selects_one_run_per_seed():
    assert results_page.ROWS
    for row in results_page.ROWS:
        assert (results_page.RESULTS / row.source).is_file(), row.source
        vals = results_page.values(row)  # raises on an empty selection or a seed counted twice
        assert vals and all(v == v for v in vals), row
        assert f"`{row.source}`" in results_page.cells(row)["source"]


# A headline number is one plain driver command: preset, dataset, the DATA placeholder, a seed; no
# --out (the driver's default folder) and no --set (a dataset's settings live in conf/datasets/).
HEADLINE_COMMAND = re.compile(
    r"fedrec run --preset [a-z_]+ --dataset [a-z0-9:_-]+ --data-dir DATA( --centralized)?( --seed S)?")


def test_headline_commands_are_plain_driver_commands_with_the_data_placeholder():
    for row in results_page.ROWS:
        cmd = results_page.command(row)
        assert HEADLINE_COMMAND.fullmatch(cmd), cmd


# fppdm_table.json records its runs' settings under the flat key names its runs were launched with; the
# config's keys for them (a record's vocabulary, not config aliases: the config knows only its own names)
FPPDM_RECORDED_AS = {
    **{f"fppdm.{k}": f"fppdm.model.{k}" for k in ("dim", "layers", "gaussian", "shared_user_init")},
    **{f"fppdm.{k}": f"fppdm.training.{k}" for k in ("lr", "batch_size", "local_epochs", "margin", "lambda_p")},
    **{f"fppdm.{k}": f"fppdm.coclustering.{k}" for k in ("lambda_c", "clusters", "knn", "epsilon", "eta")},
    **{f"fppdm.{k}": f"fppdm.evaluation.{k}" for k in ("negatives", "topk")},
    **{f"fppdm.{k}": f"fppdm.server.{k}" for k in ("aggregate", "max_abs_mu", "max_sigma")},
}


def _fppdm_rows():
    return [row for row in results_page.ROWS if row.source == "fppdm_table.json"]


def test_fppdm_commands_without_set_run_the_settings_the_table_was_recorded_with():
    """Each recorded `--set key=value` of fppdm_table.json (old flat keys mapped to their new names)
    is what the row's preset resolves to on that dataset, so the plain command reproduces the row."""
    import yaml

    from fedrec_flwr.config import load_config

    recorded = results_page.load("fppdm_table.json")["settings"]
    rows = _fppdm_rows()
    assert rows
    for row in rows:
        dataset, preset = row.where["dataset"], row.where["preset"]
        cfg = load_config(preset, dataset)
        for item in recorded[dataset]:
            key, value = item.split("=", 1)
            got = cfg
            for part in FPPDM_RECORDED_AS.get(key, key).split("."):
                got = getattr(got, part)
            assert got == yaml.safe_load(value), (preset, dataset, item, got)


def test_the_generated_table_is_in_the_page_and_has_every_row():
    page = _text("BENCHMARKS.md")
    table = results_page.table("full")
    assert table in page
    assert len(table.splitlines()) == 2 + len(results_page.ROWS)
    assert 0 < len(results_page.table("readme").splitlines()) - 2 < len(results_page.ROWS)


def test_results_page_command_prints_the_table_and_writes_only_stale_blocks(tmp_path, monkeypatch, capsys):
    """`fedrec results-page` prints the page's table; `--write` leaves current pages alone and replaces a
    stale block (here in copies of the pages: the checkout's files are never written by a test)."""
    main(["results-page"])
    assert capsys.readouterr().out == results_page.table("full") + "\n"

    for name in ("BENCHMARKS.md", "README.md"):
        (tmp_path / name).write_text(_text(name))
    monkeypatch.setattr(results_page, "ROOT", tmp_path)
    main(["results-page", "--write"])
    assert capsys.readouterr().out == ""
    assert all((tmp_path / name).read_text() == _text(name) for name in ("BENCHMARKS.md", "README.md"))

    stale = _text("README.md").replace(results_page.table("readme"), "| a table edited by hand |")
    (tmp_path / "README.md").write_text(stale)
    main(["results-page", "--write"])
    assert capsys.readouterr().out == "wrote README.md\n"
    assert (tmp_path / "README.md").read_text() == _text("README.md")


@pytest.mark.parametrize("pattern", FORBIDDEN)
def test_the_pages_do_not_read_like_a_development_log(pattern):
    subpages = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "benchmarks").glob("*.md"))
    for name in ("BENCHMARKS.md", "README.md", *subpages):
        found = re.search(pattern, _text(name), re.IGNORECASE)
        assert not found, (name, pattern, found)


def test_benchmarks_opens_with_the_headline_and_keeps_the_section_order():
    page = _text("BENCHMARKS.md")
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Headline"
    subjects = ["FedGNN accuracy", "Graph expansion", "Privacy measurements", "FPPDM", "Performance", "Scale",
                "Reliability"]
    found = [next(i for i, h in enumerate(headings) if subject in h) for subject in subjects]
    assert found == sorted(found), headings
    assert sum(h.startswith("## Appendix") for h in headings) <= 1


# keys that moved to their own section after these runs were recorded (README, "Configuration")
FEDGNN_MOVED = {"federation.user_steps": "local.user_steps", "federation.loss": "local.loss"}


def test_fedgnn_headline_commands_run_the_settings_their_runs_were_recorded_with():
    """Every `--set key=value` recorded beside a FedGNN headline run is what the plain command resolves to
    (runs recorded before the settings moved into conf/ files), and the in-process runs are of the preset as it
    is, so that command reproduces the row."""
    import shlex

    import yaml

    from fedrec_flwr.config import load_config

    def resolved(cfg, key: str):
        got = cfg
        for part in FEDGNN_MOVED.get(key, key).split("."):
            got = getattr(got, part)
        return got

    checked = 0
    # benchmarks.converged_runs
    for row in (r for r in results_page.ROWS if Path(r.source).name.startswith("converged-")):
        preset, dataset = (row.command.split(f"--{flag} ")[1].split()[0] for flag in ("preset", "dataset"))
        cfg = load_config(preset, dataset)
        for run in results_page.selected(row):
            for item in run["overrides"]:  # the schedule it was given is the preset's own
                key, value = item.split("=", 1)
                assert resolved(cfg, key) == yaml.safe_load(value), (row.source, item)
                checked += 1
    for row in (r for r in results_page.ROWS if r.source in ("fedgnn_tuned.json", "fedgnn_features.json")):
        preset = row.command.split("--preset ")[1].split()[0]
        for run in results_page.selected(row):
            if "benchmarks.fedgnn_tuned_runs" in run["command"]:  # in-process runs of the preset as it is
                assert "--set" not in run["command"] and run["extra"] == [], run["command"]
                checked += 1
                continue
            if "benchmarks.run" not in run["command"] and "fedrec run" not in run["command"]:  # flwr runs only
                continue
            args = shlex.split(run["command"])
            overrides = args[args.index("--set") + 1:] if "--set" in args else []
            cfg = load_config(preset, row.where["dataset"])
            for item in overrides:
                key, value = item.split("=", 1)
                assert resolved(cfg, key) == yaml.safe_load(value), (row.source, run["command"], item)
                checked += 1
    assert checked >= 4  # the converged fedgnn_tuned seeds' schedules, and fedgnn_features' runs
