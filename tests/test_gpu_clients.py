"""The GPU benchmark (benchmarks/gpu_clients.py), run as a script without a GPU: it runs where flwr and ray
are not installed (a GPU machine may lack both), its numbers are those of its code and not of the moment
(the same measurement twice gives the same RMSE and loss), speed-ups are ratios against the CPU, and a
device torch cannot see is reported as skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the script as `python -m benchmarks.gpu_clients`, with flwr and ray unimportable
BLOCK = "import sys; sys.modules['flwr'] = None; sys.modules['ray'] = None; import runpy; sys.argv = sys.argv[1:]; " \
        "runpy.run_module('benchmarks.gpu_clients', run_name='__main__')"

# small enough for a second or two per device on one core: 24 users over 200 items, an FPPDM domain of 40 users
SMALL_FEDGNN = ["model.dim=16", "privacy.pseudo_items=50", "federation.clients_per_round=4",
                "data.synthetic.num_items=200", "data.synthetic.mean_degree=20"]


@pytest.fixture(scope="module")
def devices(tmp_path_factory) -> dict:
    """One run of the script measuring `cpu` twice (as `cpu` and `cpu:0`, the same device under two names)
    and `cuda` hidden from torch (CUDA_VISIBLE_DEVICES empty); the JSON's per-device rows."""
    tmp = tmp_path_factory.mktemp("gpu_clients")
    out = tmp / "gpu.json"
    cmd = [sys.executable, "-c", BLOCK, "gpu_clients", "--devices", "cpu", "cpu:0", "cuda", "--users", "24",
           "--rounds", "1", "--fppdm-users", "40", "--fppdm-items", "30", "--fppdm-epochs", "1",
           "--fppdm-round-devices", "cpu", "--fppdm-round-users", "30", "--fppdm-round-items", "40",
           "--data-dir", str(tmp / "no-data"), "--cache-dir", str(tmp / "cache"), "--out", str(out), "--set",
           *SMALL_FEDGNN]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["devices"]


def test_gpu_benchmark_runs_with_flwr_and_ray_unimportable(devices):
    cpu = devices["cpu"]
    assert cpu["fedgnn"]["clients_per_second"] > 0 and 0 < cpu["fedgnn"]["rmse"] < 4
    assert cpu["fppdm"]["epoch_s"] > 0 and cpu["fppdm"]["loss"] > 0 and cpu["fppdm"]["interactions"] > 0
    paper = cpu["fppdm_paper_round"]  # the paper-settings round, on a synthetic pair where no data is given
    assert paper["data"].startswith("synthetic pair") and paper["round_seconds"] > 0
    assert sorted(paper["steps"]) == ["domain0", "domain1"] and all(v > 0 for v in paper["train_loss"].values())
    assert "fppdm_paper_round" not in devices["cpu:0"]  # only the devices asked for


def test_the_benchmark_measures_the_same_numbers_twice(devices):
    """Timings vary; what was trained must not: the same RMSE (FedGNN) and loss (FPPDM) on a second run."""
    first, second = devices["cpu"], devices["cpu:0"]
    assert second["fedgnn"]["rmse"] == first["fedgnn"]["rmse"]
    assert second["fppdm"]["loss"] == first["fppdm"]["loss"]
    assert second["fppdm"]["interactions"] == first["fppdm"]["interactions"]


def test_speedups_are_ratios_against_cpu_and_an_absent_device_is_skipped(devices):
    cpu, other = devices["cpu"], devices["cpu:0"]
    assert other["fedgnn_speedup_vs_cpu"] == pytest.approx(
        other["fedgnn"]["clients_per_second"] / cpu["fedgnn"]["clients_per_second"])
    assert other["fppdm_speedup_vs_cpu"] == pytest.approx(cpu["fppdm"]["epoch_s"] / other["fppdm"]["epoch_s"])
    assert "fedgnn_speedup_vs_cpu" not in cpu
    assert devices["cuda"] == {"skipped": "torch sees no CUDA device"}
