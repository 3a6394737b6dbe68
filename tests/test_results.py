"""Run outputs: results.json/rounds.csv after every round, summary text and PNG charts."""

import json
from pathlib import Path

import numpy as np

from fedrec_flwr.reporting.plot import plot_runs
from fedrec_flwr.reporting.results import RunRecorder, report_round
from fedrec_flwr.reporting.summary import summarize
from tests.conftest import TEST_SECRET


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
    files = plot_runs([str(_run(tmp_path, "a", [1.2, 1.1])), str(_run(tmp_path, "b", [1.3, 1.0]))],
                      str(tmp_path / "plots"))
    names = sorted(p.name for p in files)
    assert names == ["rmse.png", "round_seconds.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in files)


def _charted(monkeypatch):
    """Every chart plot_runs draws, as {y label: legend labels}, through the real `draw_chart`."""
    from fedrec_flwr.reporting import plot

    drawn, draw = {}, plot.draw_chart

    def spy(metric, series, references):
        fig = draw(metric, series, references)
        drawn[metric] = fig.axes[0].get_legend_handles_labels()[1]
        return fig
    monkeypatch.setattr(plot, "draw_chart", spy)
    return drawn


def test_plot_draws_the_recorded_baselines_once_per_split(tmp_path, monkeypatch, capsys):
    from fedrec_flwr.reporting.plot import baseline_lines

    split = {"global_mean": 1.12, "user_mean": 1.03, "item_mean": 1.02, "bias": 0.95}
    runs = []
    for name, baselines in (("s0", split), ("s1", split), ("other", {**split, "bias": 0.9})):
        rec = RunRecorder(tmp_path / name, "fedgnn", "synthetic", {})
        rec.add_round({"round": 2, "rmse": 1.0})
        rec.finish({"rmse": 1.0}, {"baselines": baselines, "baseline_ratings": 10})
        runs.append(str(tmp_path / name))
    drawn = _charted(monkeypatch)
    plot_runs(runs[:2], str(tmp_path / "plots"))
    assert drawn["rmse"][2:] == ["global mean 1.1200", "user mean 1.0300", "item mean 1.0200", "bias model 0.9500"]
    assert drawn["rmse"][:2] == ["fedgnn/synthetic (s0)", "fedgnn/synthetic (s1)"]  # one set for the shared split
    assert capsys.readouterr().err == ""
    lines, bare = baseline_lines([(p, json.loads((Path(p) / "results.json").read_text())) for p in runs])
    assert len(lines) == 8 and not bare
    assert ("bias", "bias model 0.9500 (s0, s1)", 0.95) in lines and ("bias", "bias model 0.9000 (other)", 0.9) in lines


def test_plot_without_recorded_baselines_draws_the_curve_alone(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, "old", [1.2, 1.1])  # no baselines recorded, as older runs
    ranking = RunRecorder(tmp_path / "fppdm", "fppdm", "synthetic", {})  # HR/NDCG only: no note for it
    ranking.add_round({"round": 1, "hr@10": 0.4})
    ranking.finish({"hr@10": 0.4})
    drawn = _charted(monkeypatch)
    files = plot_runs([str(run), str(tmp_path / "fppdm")], str(tmp_path / "plots"))
    assert {p.name for p in files} == {"rmse.png", "hr_at_10.png", "round_seconds.png"}
    assert drawn["rmse"] == ["fedgnn/synthetic (old)"] and drawn["hr@10"] == ["fppdm/synthetic (fppdm)"]
    assert capsys.readouterr().err.splitlines() == [
        f"fedrec plot: {run} recorded no baselines; its RMSE curve is drawn alone"]


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


def _lines(capsys, tag="[fedgnn]"):
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith(tag)]


def test_the_console_shows_one_line_per_round_with_its_evaluation(tmp_path, capsys):
    """A training round that evaluates prints once, after its evaluation, with both; files keep every record."""
    rec = RunRecorder(tmp_path, "fedgnn", "synthetic", {})
    report_round(rec, "fedgnn", {"round": 1, "phase": "register", "clients": 4})
    assert _lines(capsys) == ["[fedgnn] round=1 phase=register clients=4"]
    report_round(rec, "fedgnn", {"round": 2, "phase": "train", "round_seconds": 0.5})  # no evaluation: printed now
    assert _lines(capsys) == ["[fedgnn] round=2 phase=train round_seconds=0.5000"]
    report_round(rec, "fedgnn", {"round": 3, "phase": "train", "round_seconds": 0.25}, complete=False)
    assert _lines(capsys) == []  # its evaluation is still to come
    report_round(rec, "fedgnn", {"round": 3, "rmse": 1.0, "mae": 0.75})
    assert _lines(capsys) == ["[fedgnn] round=3 phase=train round_seconds=0.2500 rmse=1.0000 mae=0.7500"]
    report_round(rec, "fedgnn", {"round": 4, "phase": "train"}, complete=False)
    report_round(rec, "fedgnn", {"round": 5, "phase": "train"})  # round 4's evaluation never came
    assert _lines(capsys) == ["[fedgnn] round=4 phase=train", "[fedgnn] round=5 phase=train"]
    report_round(rec, "fedgnn", {"round": 6, "phase": "train"}, complete=False)
    rec.finish({"rmse": 1.0})  # the run ends (or fails) with a round held: it is printed first
    assert _lines(capsys) == ["[fedgnn] round=6 phase=train"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3, 4, 5, 6] and doc["rounds"][2]["rmse"] == 1.0
    header, *rows = (tmp_path / "rounds.csv").read_text().splitlines()
    assert header == "round,phase,clients,round_seconds,rmse,mae" and rows[2] == "3,train,,0.25,1.0,0.75"


def test_a_fedgnn_run_prints_one_line_per_round(tiny_cfg, capsys):
    """Registration, 4 training rounds evaluating every 2nd: five `[fedgnn]` round lines, then FINAL."""
    from flwr.app import RecordDict
    from inprocess import drive

    from clients.fedgnn import FedGNNClient
    from clients.user_store import NodeStateStore
    from fedrec_flwr.data import UserPartitions, prepare_partitions
    from strategies.fedgnn import FedGNNStrategy

    cfg = tiny_cfg("federation.rounds=4", "federation.eval_every=2", "federation.clients_per_round=12")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    strategy = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, RunRecorder(cfg.output_dir, "fedgnn", "s", {}),
                              meta.num_users, rating_span=4.0)
    clients = {u: FedGNNClient(cfg, meta, [u], parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET)
               for u in range(meta.num_users)}
    capsys.readouterr()
    drive(strategy, clients)
    lines = _lines(capsys)
    assert [line.split()[1] for line in lines] == ["round=1", "round=2", "round=3", "round=4", "round=5", "FINAL"]
    assert [("rmse=" in line) for line in lines[:-1]] == [False, False, True, False, True]
    assert all("phase=train" in line for line in lines[1:-1])
    doc = json.loads((Path(cfg.output_dir) / "results.json").read_text())
    assert len(doc["rounds"]) == 5 and "rmse" in doc["rounds"][2] and "rmse" not in doc["rounds"][1]


def test_an_fppdm_round_that_evaluates_prints_one_line(tmp_path, capsys):
    """FPPDM's round core holds an evaluating round's training record until its HR/NDCG arrive."""
    from fedrec_flwr.config import load_config
    from fedrec_flwr.fppdm.rounds import FPPDMRounds
    from fedrec_flwr.messages import NodeReply

    cfg = load_config("fppdm", None, ["federation.rounds=3", "federation.eval_every=2", "federation.min_clients=1",
                                      "fppdm.evaluation.topk=[10]", f"output_dir={tmp_path}"])
    recorder = RunRecorder(tmp_path, "fppdm", "s", {})
    rounds = FPPDMRounds.from_config(cfg, 10, recorder)
    evaluation = [NodeReply(0, metrics={"n": 3, "domain": "a", "hr@10": 0.5, "ndcg@10": 0.25})]
    dim = cfg.fppdm.model.dim
    upload = [NodeReply(0, [np.arange(3), np.zeros((3, dim), np.float32), np.full((3, dim), 0.5, np.float32)])]
    capsys.readouterr()
    for rnd in (1, 2, 3):
        rounds.train(rnd, upload, [], 0.0)
        if rounds.is_eval_round(rnd):
            rounds.evaluate(rnd, evaluation)
    rounds.finish()
    lines = _lines(capsys, "[fppdm]")
    assert [line.split()[1] for line in lines] == ["round=1", "round=2", "round=3", "FINAL"]
    assert ["hr@10=0.5000" in line and "phase=train" in line for line in lines[:3]] == [False, True, True]
    assert len(json.loads((tmp_path / "results.json").read_text())["rounds"]) == 3


def test_summary_says_when_a_run_was_scored_on_the_validation_holdout(tmp_path):
    """A run with data.holdout=validation is not presented as a test result."""
    rec = RunRecorder(tmp_path, "fedgnn", "synthetic", {"data": {"holdout": "validation", "validation_fraction": 0.1}})
    rec.set_baselines({"global_mean": 1.0, "user_mean": 0.99, "item_mean": 0.97, "bias": 0.93})
    rec.finish({"rmse": 0.9, "eval_ratings": 50, "test_ratings": 50})
    text = summarize(str(tmp_path))
    assert "scored on the validation holdout (0.1 of each user's training ratings" in text
    assert "validation ratings scored: 50 of the split's 50" in text and "test ratings scored" not in text
    assert "validation RMSE of centralized baselines" in text


def test_a_model_worse_than_the_baseline_is_worded_as_worse(tmp_path):
    rec = RunRecorder(tmp_path, "fedgnn", "synthetic", {"privacy": {"ldp": True}})
    rec.set_baselines({"global_mean": 1.0, "user_mean": 0.99, "item_mean": 0.95, "bias": 0.93})
    rec.add_round({"round": 2, "phase": "train", "bytes_up": 1e6, "bytes_down": 2e6})
    rec.finish({"rmse": 0.99, "mae": 0.7})
    text = summarize(str(tmp_path))
    assert "model 0.9900 is 4.2% above (worse than) the best trivial baseline (0.9500)" in text and "below" not in text
