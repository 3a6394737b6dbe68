"""benchmarks/converged_runs.py, run as a user runs it on the synthetic data: the validation run reads only
the held-out training ratings, the test runs use the round it chose and score every test rating, a rerun with
--resume resumes instead of training again (without it, a fresh file), and the table shows what the file holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fedrec_flwr.reporting.convergence import rounds_to_flatten

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.dim=8", "federation.clients_per_round=32", "simulation.user_batch=32"]


def _script(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.converged_runs", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_rounds_are_chosen_on_validation_and_the_test_runs_use_them(tmp_path):
    argv = ["--dataset", "synthetic", "--preset", "quickstart", "--max-rounds", "14", "--eval-every", "2",
            "--seeds", "0", "1", "--out-dir", str(tmp_path), "--set", f"data.cache_dir={tmp_path / 'cache'}", *TINY]
    _script(*argv)
    doc = json.loads((tmp_path / "converged-quickstart-synthetic.json").read_text())
    val = [r for r in doc["runs"] if r["holdout"] == "validation"]
    tests = [r for r in doc["runs"] if r["holdout"] == "test"]
    assert len(val) == 1 and sorted(r["seed"] for r in tests) == [0, 1]
    chosen, flat = rounds_to_flatten({int(k): v for k, v in val[0]["rmse_by_round"].items()})
    assert (doc["chosen_rounds"], doc["flattened"]) == (chosen, flat)
    assert all(r["rounds"] == chosen and max(map(int, r["rmse_by_round"])) == chosen for r in tests)
    # the validation run scored its held-out training ratings, the test runs every test rating
    assert all(r["final"]["eval_ratings"] == r["final"]["test_ratings"] for r in doc["runs"])
    assert val[0]["final"]["test_ratings"] != tests[0]["final"]["test_ratings"]
    assert "data.holdout=" not in _script(*argv, "--resume")  # resumed, it finds every phase done and starts no run
    assert "data.holdout=validation" in _script(*argv)  # without --resume a rerun reruns, into a fresh file
    assert len(list(tmp_path.glob("converged-quickstart-synthetic*.json"))) == 2
    table = _script("--table", str(tmp_path / "converged-quickstart-synthetic.json"))
    assert "validation, seed 0" in table and "test, seed 1" in table and f"Chosen: {chosen} rounds" in table
