"""Benchmark sweeps resume where they stopped and record each cell's command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.sweep as sweep
from benchmarks.expansion_table import cell_record, command, table


def _fake_runs(monkeypatch, calls: list, fail_at: int | None = None):
    def fake_run_main(argv):
        calls.append(argv)
        if fail_at is not None and len(calls) == fail_at:
            raise SystemExit("federated run failed")
        out = Path(argv[argv.index("--out") + 1])
        rmse = 1.0 + 0.01 * int(argv[argv.index("--seed") + 1])
        (out / "results.json").write_text(json.dumps({"final": {"rmse": rmse}, "rounds": []}))
    monkeypatch.setattr(sweep, "fedrec_run", fake_run_main)


def _cells(seeds):
    return [({"dataset": "ml-100k", "gnn": "gat", "mode": m, "seed": s}, command("ml-100k", "gat", m, s, "data"))
            for s in seeds for m in ("none", "fixed")]


def test_interrupted_sweep_continues_without_rerunning_finished_cells(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    calls: list = []
    _fake_runs(monkeypatch, calls, fail_at=3)
    doc = sweep.load_sweep(out, ["ml-100k"], {})
    with pytest.raises(SystemExit):
        sweep.run_missing(doc, out, _cells([0, 1]), "t")
    assert len(json.loads(out.read_text())["runs"]) == 2  # the two finished cells were saved
    calls.clear()
    _fake_runs(monkeypatch, calls)
    doc = sweep.run_missing(sweep.load_sweep(out, ["ml-100k"], {}), out, _cells([0, 1]), "t")
    assert len(calls) == 2 and all("1" == c[c.index("--seed") + 1] for c in calls)
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["mode"], r["seed"]) for r in runs) == [("fixed", 0), ("fixed", 1), ("none", 0), ("none", 1)]
    assert all(r["command"].startswith("fedrec run --preset fedgnn_paper") and "expansion.mode=" in r["command"]
               for r in runs)
    text = table(doc)
    assert "| gat | 1.0050 ± 0.0071 [2] | - | 1.0050 ± 0.0071 [2] | +0.0000 |" in text


def test_converged_cells_run_the_tuned_preset_and_keep_each_curve_and_budget():
    argv = command("douban", "ggnn", "fixed", 2, "data", protocol="converged")
    assert argv[:2] == ["--preset", "fedgnn_tuned"] and "federation.rounds=40" not in argv  # the preset's own schedule
    assert {"model.gnn=ggnn", "expansion.mode=fixed"} <= set(argv) and argv[argv.index("--seed") + 1] == "2"
    budget = {"neighbouring": "user", "per_user_run": {"median": {"tight": 3.0}}}
    rounds = [{"round": 1, "phase": "register"}, {"round": 2, "phase": "train", "rmse": 0.9},
              {"round": 3, "phase": "expand-fetch", "mean_neighbours": 9.5}, {"round": 4, "phase": "train"},
              {"round": 5, "phase": "train", "rmse": 0.8}]
    record = cell_record({"rounds": rounds, "privacy": budget})  # keyed by training rounds done: 1 and 3
    assert record == {"neighbours_mean": 9.5, "rmse_by_round": {"1": 0.9, "3": 0.8}, "privacy": budget}
    assert cell_record({"rounds": []}) == {"neighbours_mean": 0.0, "rmse_by_round": {}}
