"""The GPU benchmark (benchmarks/gpu_clients.py), checked without a GPU: its numbers are those of its code
and not of the moment (the same run twice gives the same RMSE and loss), speed-ups are ratios against the
CPU, and it runs where flwr and ray are not installed (a GPU machine may lack both)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import gpu_clients
from fedrec_flwr.config import load_config

ROOT = Path(__file__).resolve().parents[2]

BLOCK = "import sys; sys.modules['flwr'] = None; sys.modules['ray'] = None; import runpy; sys.argv = sys.argv[1:]; " \
        "runpy.run_module('benchmarks.gpu_clients', run_name='__main__')"

# small enough for a second or two per run on one core: 24 users over 200 items, an FPPDM domain of 40 users
SMALL_FEDGNN = ["model.dim=16", "privacy.pseudo_items=50", "federation.clients_per_round=4",
                "data.synthetic.num_items=200", "data.synthetic.mean_degree=20"]


def _cfg(*overrides: str):
    return load_config("fedgnn_paper", "synthetic", list(overrides))


def test_an_absent_device_is_reported_as_skipped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_clients.device_row("cuda", argparse.Namespace()) == {"skipped": "torch sees no CUDA device"}


def test_speedups_are_ratios_against_cpu():
    rows = {"cpu": {"fedgnn": {"clients_per_second": 10.0}, "fppdm": {"epoch_s": 6.0}},
            "cuda": {"fedgnn": {"clients_per_second": 40.0}, "fppdm": {"epoch_s": 2.0}},
            "mps": {"skipped": "absent"}}
    gpu_clients.add_speedups(rows)
    assert rows["cuda"]["fedgnn_speedup_vs_cpu"] == 4.0 and rows["cuda"]["fppdm_speedup_vs_cpu"] == 3.0
    assert "fedgnn_speedup_vs_cpu" not in rows["cpu"] and rows["mps"] == {"skipped": "absent"}


def test_the_benchmark_measures_the_same_numbers_twice(tmp_path):
    """Timings vary; what was trained must not: the same RMSE (FedGNN) and loss (FPPDM) on a second run."""
    cpu = torch.device("cpu")
    runs = [gpu_clients.fedgnn_clients_per_second(cpu, 24, 1, str(tmp_path / "cache"), SMALL_FEDGNN) for _ in range(2)]
    assert runs[0]["rmse"] == runs[1]["rmse"] and 0 < runs[0]["rmse"] < 4
    assert all(r["clients_per_second"] > 0 for r in runs)
    fppdm = [gpu_clients.fppdm_epoch_seconds(cpu, 40, 30, 1) for _ in range(2)]
    assert fppdm[0]["loss"] == fppdm[1]["loss"] > 0 and fppdm[0]["interactions"] == fppdm[1]["interactions"] > 0


def test_gpu_benchmark_runs_with_flwr_and_ray_unimportable(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-c", BLOCK, "gpu_clients", "--devices", "cpu", "--users", "24", "--rounds", "1",
           "--fppdm-users", "40", "--fppdm-items", "30", "--fppdm-epochs", "1", "--cache-dir", str(tmp_path / "cache"),
           "--out", str(out), "--set", *SMALL_FEDGNN]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu = json.loads(out.read_text())["devices"]["cpu"]
    assert cpu["fedgnn"]["clients_per_second"] > 0 and 0 < cpu["fedgnn"]["rmse"] < 4
    assert cpu["fppdm"]["epoch_s"] > 0 and cpu["fppdm"]["loss"] > 0
