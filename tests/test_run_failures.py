"""Runs fail loudly: a failed run exits non-zero with its reason and never reports an older run's results."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.run import main as run_main
from fedrec_flwr.fedgnn.protocol import ExpansionLink
from fedrec_flwr.neighbours import new_run_key
from fedrec_flwr.results import RunRecorder, load_results
from strategies.fedgnn import FedGNNStrategy

needs_superlink = pytest.mark.skipif(
    shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
    reason="flower-superlink not installed next to this Python",
)


def test_results_say_running_from_the_start_and_failed_with_the_reason(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"status": "finished", "final": {"rmse": 0.5}, "rounds": []}))
    (tmp_path / "rounds.csv").write_text("round\n1\n")
    recorder = RunRecorder(tmp_path, "fedgnn", "synthetic", {})
    assert load_results(tmp_path)["status"] == "running" and not (tmp_path / "rounds.csv").exists()
    recorder.fail("RuntimeError: boom")
    doc = load_results(tmp_path)
    assert doc["status"] == "failed" and doc["error"] == "RuntimeError: boom" and doc["final"] == {}


def test_a_strategy_that_fails_mid_run_marks_the_run_failed(tiny_cfg, tmp_path):
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.epoch=0")
    recorder = RunRecorder(tmp_path, "fedgnn", "synthetic", {})
    strategy = FedGNNStrategy(cfg, 80, 3.0, recorder, 60, ExpansionLink(new_run_key(), "127.0.0.1:9", "r"),
                              rating_span=4.0)
    with pytest.raises(RuntimeError, match="graph expansion"):
        strategy.aggregate_fit(2, [], [ConnectionError("neighbour service unreachable")])
    doc = load_results(tmp_path)
    assert doc["status"] == "failed" and "neighbour service unreachable" in doc["error"]


@needs_superlink
def test_a_server_app_that_fails_at_start_exits_non_zero_with_the_reason(tmp_path, capsys):
    """checkpoint.resume without a checkpoint makes the ServerApp raise at start; `flwr run` itself
    exits 0 there, so the driver must read the reason from results.json and never an older file."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"status": "finished", "final": {"rmse": 0.123}, "rounds": []}))
    with pytest.raises(SystemExit) as stop:
        run_main([
            "--preset", "fedgnn_paper", "--dataset", "synthetic", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--set", "data.synthetic.num_users=12", "data.synthetic.num_items=40", "data.synthetic.mean_degree=8",
            "model.dim=8", "privacy.pseudo_items=10", "federation.rounds=1", "federation.clients_per_round=4",
            "checkpoint.resume=true",
        ])
    assert "federated run failed" in str(stop.value) and "no checkpoint at" in str(stop.value)
    assert "0.123" not in capsys.readouterr().out
    assert load_results(out)["status"] == "failed"
