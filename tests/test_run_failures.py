"""Runs fail loudly: a failed run exits non-zero with its reason and never reports an older run's results."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from fedrec_flwr.cli.commands import main as cli_main
from fedrec_flwr.fedgnn.protocol import ExpansionLink
from fedrec_flwr.neighbours import new_run_key
from fedrec_flwr.reporting.results import RunRecorder, load_results
from strategies.fedgnn import FedGNNStrategy

needs_superlink = pytest.mark.skipif(
    shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
    reason="flower-superlink not installed next to this Python",
)


def run_main(argv: list[str]) -> None:
    """`fedrec run ARGV`."""
    cli_main(["run", *argv])


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
            "--preset", "fedgnn_paper", "--dataset", "synthetic", "--out", str(out), "--cache-dir",
            str(tmp_path / "cache"), "--set", "data.synthetic.num_users=12", "data.synthetic.num_items=40",
            "data.synthetic.mean_degree=8", "model.dim=8", "privacy.pseudo_items=10", "federation.rounds=1",
            "federation.clients_per_round=4", "checkpoint.resume=true",
        ])
    assert "federated run failed" in str(stop.value) and "no checkpoint at" in str(stop.value)
    assert "0.123" not in capsys.readouterr().out
    assert load_results(out)["status"] == "failed"


def _crashing_run(tiny_cfg, tmp_path, *overrides: str) -> FedGNNStrategy:
    """A small FedGNN run, one node per user, whose nodes crash in training as `faults.crash` draws."""
    from inprocess import drive
    from test_fedgnn_protocol import _nodes

    from fedrec_flwr.data import UserPartitions, prepare_partitions

    cfg = tiny_cfg("federation.rounds=4", "federation.clients_per_round=8", "federation.eval_every=2",
                   "simulation.users_per_node=1", *overrides)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint,
                              RunRecorder(cfg.output_dir, "fedgnn", "synthetic", {}), parts.meta.num_users,
                              rating_span=4.0, test_ratings=parts.meta.num_test)
    drive(strategy, _nodes(cfg, parts, 1, 1))
    return strategy


def test_a_run_in_which_no_round_trained_fails_with_the_reason(tiny_cfg, tmp_path, capsys):
    """Every node crashes in every training round: the evaluations score the untrained model, but the run
    reports no result: status failed, the reason, no FINAL line."""
    strategy = _crashing_run(tiny_cfg, tmp_path, "faults.crash=1.0")
    doc = load_results(strategy.cfg.output_dir)
    assert doc["status"] == "failed" and doc["final"] == {}
    assert "no training round was applied: all 4" in doc["error"] and "injected crash" in doc["error"]
    printed = capsys.readouterr().out
    assert "[fedgnn] FAILED: no training round was applied" in printed and "FINAL" not in printed
    from fedrec_flwr.reporting.summary import summarize

    assert summarize(strategy.cfg.output_dir).endswith(doc["error"])


def test_a_run_with_some_rounds_not_applied_says_how_many(tiny_cfg, tmp_path):
    """A round whose uploads fall below min_clients leaves the model unchanged; the run still finishes, and
    results.json and the summary say how many training rounds were not applied."""
    strategy = _crashing_run(tiny_cfg, tmp_path, "faults.crash=0.1", "federation.min_clients=8")
    doc = load_results(strategy.cfg.output_dir)
    not_applied = [r["round"] for r in doc["rounds"] if r.get("phase") == "train" and not r["applied"]]
    assert doc["status"] == "finished" and 0 < len(not_applied) < 4
    assert doc["rounds_not_applied"] == len(not_applied)
    from fedrec_flwr.reporting.summary import summarize

    assert f"{len(not_applied)} of 4 training rounds were not applied" in summarize(strategy.cfg.output_dir)


@needs_superlink
def test_the_all_crash_run_through_flwr_run_exits_non_zero_with_its_reason(tmp_path, capsys):
    """`fedrec run --preset quickstart --set federation.rounds=2 faults.crash=1.0`, made small:
    the driver exits non-zero and its last words are the reason; no RMSE is printed as a result."""
    with pytest.raises(SystemExit) as stop:
        run_main([
            "--preset", "quickstart", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
            "--set", "data.synthetic.num_users=12", "data.synthetic.num_items=40", "data.synthetic.mean_degree=8",
            "model.dim=8", "privacy.pseudo_items=10", "federation.rounds=2", "federation.clients_per_round=4",
            "faults.crash=1.0",
        ])
    assert str(stop.value).startswith("federated run failed") and "no training round was applied" in str(stop.value)
    assert not capsys.readouterr().out.strip().splitlines()[-1].startswith("{")  # no final metrics line
