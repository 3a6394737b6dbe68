"""Resumable sweeps (fedrec_flwr.cli.sweep): an interrupted sweep continues without rerunning finished cells and
records each cell's command; a FedGNN run's record keeps its curve by training rounds, neighbours and budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedrec_flwr.cli import sweep


def _fake_runs(monkeypatch, calls: list, fail_at: int | None = None):
    """`fedrec run` replaced by a stub writing a results.json whose RMSE is 1 + seed / 100."""
    def fake_run(argv):
        calls.append(argv)
        if fail_at is not None and len(calls) == fail_at:
            raise SystemExit("federated run failed")
        out = Path(argv[argv.index("--out") + 1])
        rmse = 1.0 + 0.01 * int(argv[argv.index("--seed") + 1])
        (out / "results.json").write_text(json.dumps({"final": {"rmse": rmse}, "rounds": []}))
    monkeypatch.setattr(sweep, "fedrec_run", fake_run)


def _cells(seeds):
    return [({"dataset": "ml-100k", "mode": mode, "seed": seed},
             ["--preset", "fedgnn_paper", "--dataset", "ml-100k", "--data-dir", "data", "--seed", str(seed),
              "--set", f"expansion.mode={mode}"])
            for seed in seeds for mode in ("none", "fixed")]


def test_interrupted_sweep_continues_without_rerunning_finished_cells(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    calls: list = []
    _fake_runs(monkeypatch, calls, fail_at=3)
    doc = sweep.load_sweep(out, ["ml-100k"], {"preset": "fedgnn_paper"})
    with pytest.raises(SystemExit):
        sweep.run_missing(doc, out, _cells([0, 1]), "t")
    saved = json.loads(out.read_text())
    assert [(r["mode"], r["seed"]) for r in saved["runs"]] == [("none", 0), ("fixed", 0)]  # saved before the failure
    assert saved["datasets"] == ["ml-100k"] and saved["settings"] == {"preset": "fedgnn_paper"}

    calls.clear()
    _fake_runs(monkeypatch, calls)
    doc = sweep.run_missing(sweep.load_sweep(out, ["ml-100k", "douban"], {}), out, _cells([0, 1]), "t")
    assert len(calls) == 2 and all(c[c.index("--seed") + 1] == "1" for c in calls)  # only the unfinished cells
    runs = json.loads(out.read_text())["runs"]
    assert runs == doc["runs"] and json.loads(out.read_text())["datasets"] == ["ml-100k", "douban"]
    assert sorted((r["mode"], r["seed"]) for r in runs) == [("fixed", 0), ("fixed", 1), ("none", 0), ("none", 1)]
    for r, (fields, argv) in zip(runs, _cells([0, 1])):
        assert {k: r[k] for k in fields} == fields
        assert r["final"] == {"rmse": 1.0 + 0.01 * fields["seed"]} and r["wall_seconds"] >= 0
        assert r["command"] == "fedrec run " + " ".join(argv)  # the cell's own arguments, without the temporary --out

    calls.clear()
    sweep.run_missing(doc, out, _cells([0, 1]), "t")
    assert calls == []  # a finished sweep runs nothing


def test_a_sweep_keeps_each_runs_extra_record(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    _fake_runs(monkeypatch, [])
    doc = sweep.run_missing(sweep.load_sweep(out, ["ml-100k"], {}), out, _cells([0]), "t", extra=sweep.run_record)
    assert all(r["neighbours_mean"] == 0.0 and r["rmse_by_round"] == {} for r in doc["runs"])


def test_run_record_keys_the_curve_by_training_rounds_and_keeps_neighbours_and_budget():
    budget = {"neighbouring": "user", "per_user_run": {"median": {"tight": 3.0}}}
    rounds = [{"round": 1, "phase": "register"}, {"round": 2, "phase": "train", "rmse": 0.9},
              {"round": 3, "phase": "expand-fetch", "mean_neighbours": 9.5}, {"round": 4, "phase": "train"},
              {"round": 5, "phase": "train", "rmse": 0.8}]
    record = sweep.run_record({"rounds": rounds, "privacy": budget})  # keyed by training rounds done: 1 and 3
    assert record == {"neighbours_mean": 9.5, "rmse_by_round": {"1": 0.9, "3": 0.8}, "privacy": budget}
    assert sweep.run_record({"rounds": []}) == {"neighbours_mean": 0.0, "rmse_by_round": {}}
