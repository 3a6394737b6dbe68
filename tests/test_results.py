"""Run outputs: results.json/rounds.csv after every round, summary text and PNG charts."""

import json

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
