"""Run outputs: results.json/rounds.csv after every round, summary text and PNG charts."""

import json

import numpy as np

from fedrec_flwr.plot import plot_runs
from fedrec_flwr.results import RunRecorder
from fedrec_flwr.summary import summarize


def _run(tmp_path, name, rmses):
    rec = RunRecorder(tmp_path / name, "fedgnn", "synthetic", {"seed": 0})
    for i, r in enumerate(rmses, start=2):
        rec.add_round({"round": i, "phase": "train", "bytes_up": 1000, "bytes_down": 2000, "round_seconds": 0.5})
        rec.add_round({"round": i, "rmse": r})
        assert json.loads((tmp_path / name / "results.json").read_text())["rounds"][-1]["round"] == i
    rec.finish({"rmse": rmses[-1]})
    return tmp_path / name


def test_recorder_merges_records_of_a_round_and_writes_csv(tmp_path):
    out = _run(tmp_path, "a", [1.2, 1.1])
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "finished" and len(doc["rounds"]) == 2 and doc["rounds"][0]["rmse"] == 1.2
    header, *rows = (out / "rounds.csv").read_text().splitlines()
    assert header.split(",")[:2] == ["round", "phase"] and len(rows) == 2
    text = summarize(str(out))
    assert "rmse=1.1000" in text and "0.001 MB up, 0.002 MB down" in text


def test_plot_writes_one_png_per_metric(tmp_path):
    files = plot_runs([str(_run(tmp_path, "a", [1.2, 1.1])), str(_run(tmp_path, "b", [1.3, 1.0]))], str(tmp_path / "plots"))
    names = sorted(p.name for p in files)
    assert names == ["rmse.png", "round_seconds.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in files)


def test_summary_shows_the_baselines_and_the_accounted_budget(tmp_path):
    from fedrec_flwr.fedgnn.accounting import budget

    rec = RunRecorder(tmp_path, "fedgnn", "synthetic", {"privacy": {"ldp": True}})
    rec.set_baselines({"global_mean": 1.0, "user_mean": 0.99, "item_mean": 0.97, "bias": 0.93})
    rec.add_round({"round": 2, "phase": "train", "bytes_up": 1e6, "bytes_down": 2e6})
    rec.finish({"rmse": 0.8, "mae": 0.6}, {"privacy": budget(0.1, 0.2, np.array([1000, 1000]), np.array([3, 5]), 1e-5)})
    text = summarize(str(tmp_path))
    assert "item mean                        0.9700" in text
    assert "model 0.8000 is 17.5% below the best trivial baseline (0.9700)" in text
    assert "epsilon 1 per coordinate of one upload" in text and "one upload (1,000 coordinates): 1000 basic" in text
    assert "max user over the run (5 uploads): 5000 basic" in text
    assert "1.000 MB up, 2.000 MB down" in text
