"""The GPU benchmark drives client and server code without flwr or ray (a GPU machine may lack both)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

BLOCK = "import sys; sys.modules['flwr'] = None; sys.modules['ray'] = None; import runpy; sys.argv = sys.argv[1:]; " \
        "runpy.run_module('benchmarks.gpu_clients', run_name='__main__')"


def test_gpu_benchmark_runs_with_flwr_and_ray_unimportable(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-c", BLOCK, "gpu_clients", "--users", "40", "--rounds", "2", "--fppdm-users", "60",
           "--fppdm-items", "50", "--fppdm-epochs", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
           "--set", "model.dim=16", "privacy.pseudo_items=50", "federation.clients_per_round=8"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    cpu = doc["devices"]["cpu"]
    assert cpu["fedgnn"]["clients_per_second"] > 0 and cpu["fppdm"]["epoch_s"] > 0
    assert 0 < cpu["fedgnn"]["rmse"] < 4
    cuda = doc["devices"]["cuda"]
    if torch.cuda.is_available():
        assert cuda["fedgnn_speedup_vs_cpu"] > 0
    else:
        assert cuda == {"skipped": "torch sees no CUDA device"}
