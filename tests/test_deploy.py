"""The deployment tests: a real SuperLink with TLS and SuperNode auth, SuperNodes, the neighbour service;
and a simulation on a two-node Ray cluster on loopback through deploy/ray_cluster_run.sh.

6-8 minutes on 2 cores (FedGNN under LDP, FedGNN under user-level DP with SecAgg+, and FPPDM deploy at
the same time, one training round each, each `flwr run` allowed 15 minutes; deploy/run_local.py prints one
line per step with its wall time, shown here on failure; the Ray cluster case about 1 minute), so they run
under `make deploy-test` (FEDREC_DEPLOY_TEST=1), which CI calls after the main suite; plain `make test`
skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.conftest import fixed_secrets

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("FEDREC_DEPLOY_TEST") != "1", reason="deployment test: run `make deploy-test`")
def test_fedgnn_user_dp_and_fppdm_on_a_real_superlink_with_authenticated_supernodes(tmp_path):
    work = tmp_path / "deploy"
    proc = subprocess.run([sys.executable, str(ROOT / "deploy" / "run_local.py"), "--work", str(work)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    for algorithm in ("fedgnn", "fppdm"):
        s = summary[algorithm]
        doc = json.loads(Path(s["results_file"]).read_text())
        train = [r for r in doc["rounds"] if r.get("phase") == "train"]
        assert doc["status"] == "finished" and len(train) == 1, algorithm
        assert s["rogue_node_refused"], s["rogue_log_tail"]  # an unregistered key cannot join
    fedgnn = json.loads(Path(summary["fedgnn"]["results_file"]).read_text())
    phases = [r.get("phase") for r in fedgnn["rounds"]]
    assert phases[:3] == ["register", "expand-submit", "expand-fetch"] and 0 < fedgnn["final"]["rmse"] < 4
    why = json.dumps({"registration": fedgnn["rounds"][0], "rejections": fedgnn["rejections"][:6],
                      "devices_exited": summary["fedgnn"]["devices_exited"]})[-3000:]
    assert not summary["fedgnn"]["devices_exited"] and not summary["fppdm"]["devices_exited"], why
    assert fedgnn["rounds"][0]["accepted"] == 3, why  # the three listed devices, not the rogue or the impostor
    assert summary["fedgnn"]["impostor_refused"]  # a registered but unlisted node claiming user 0 was refused
    assert any("NaN" in r["reason"] for r in fedgnn["rejections"])  # a malformed upload was rejected, not averaged
    user_dp = json.loads(Path(summary["fedgnn_user_dp"]["results_file"]).read_text())  # SecAgg+ on real SuperNodes
    train = [r for r in user_dp["rounds"] if r.get("phase") == "train"]
    devices = 5  # run_local.py's --user-dp-nodes: enough users for a positive noisy evaluation count
    assert user_dp["status"] == "finished" and len(train) == 1 and all(r["applied"] and r["nodes"] == devices
                                                                       for r in train), user_dp["rounds"]
    assert user_dp["privacy"]["mode"] == "user_dp" and 0 < user_dp["privacy"]["epsilon"] <= 8
    evaluated = [r for r in user_dp["rounds"] if r.get("phase") == "evaluate-sum"]  # through SecAgg+ too, charged
    assert len(evaluated) == 1 and evaluated[0]["nodes"] == devices and user_dp["privacy"]["evaluations"] == 1
    assert summary["fedgnn_user_dp"]["impostor_refused"] and summary["fedgnn_user_dp"]["rogue_node_refused"]
    fppdm = json.loads(Path(summary["fppdm"]["results_file"]).read_text())
    assert fppdm["rounds"][0]["clients"] == 3 and 0 <= fppdm["final"]["hr@10"] <= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("FEDREC_DEPLOY_TEST") != "1", reason="deployment test: run `make deploy-test`")
def test_ray_cluster_script_runs_clientapps_on_both_nodes_matches_a_plain_run_and_stops_only_its_own(tmp_path, request):
    """deploy/ray_cluster_run.sh --local-cluster, as docs/deployment.md gives it: two Ray nodes on loopback."""
    run_args = ["--preset", "quickstart", "--device-secrets", str(fixed_secrets(tmp_path)), "--set",
                "federation.rounds=2", "federation.eval_every=2", "simulation.users_per_node=150"]
    plain_home = tmp_path / "plain-flwr-home"
    # a Flower home and SuperLink ports of its own: its SuperLink is ours to stop, and no other takes the run
    env = {**os.environ, "FLWR_HOME": str(plain_home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    try:
        plain = subprocess.run([str(ROOT / ".venv" / "bin" / "fedrec"), "run", *run_args, "--out",
                                str(tmp_path / "plain")],
                               env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run([sys.executable, "-m", "fedrec_flwr.flower.local_superlink"], env=env, cwd=ROOT, timeout=60,
                       check=False)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]

    work = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))  # short: Ray's socket paths live under it
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    env = {**os.environ, "FEDREC_RAY_WORK": str(work), "RAY_PORT": str(_free_port())}
    cluster = subprocess.run([str(ROOT / "deploy" / "ray_cluster_run.sh"), "--local-cluster", *run_args,
                              "--out", str(tmp_path / "cluster")], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=900)
    assert cluster.returncode == 0, cluster.stdout[-3000:] + cluster.stderr[-3000:]
    assert "2 nodes" in cluster.stdout, cluster.stdout[-2000:]
    # each ClientApp logs the Ray node it ran on into that node's worker logs: both nodes served SuperNodes
    logs = "".join(p.read_text(errors="replace") for p in (work / "ray").glob("session_*/logs/worker-*.err"))
    assert len(set(re.findall(r"on Ray node ([0-9a-f]+)", logs))) == 2, logs[-2000:]
    finals = [json.loads((tmp_path / name / "results.json").read_text())["final"] for name in ("plain", "cluster")]
    assert finals[0]["test_ratings"] == finals[1]["test_ratings"] == finals[0]["eval_ratings"]
    assert finals[1]["rmse"] == pytest.approx(finals[0]["rmse"], rel=1e-9, abs=1e-12)  # same devices, same draws
    # the script stopped what it started (its SuperLink, both Ray nodes and their workers), and only that
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd, environ = " ".join(proc.info.get("cmdline") or []), proc.info.get("environ") or {}
        except psutil.Error:
            continue
        if str(work) in cmd or str(work) in environ.get("FLWR_HOME", ""):
            left.append((proc.info["pid"], cmd[:200]))
    assert not left, left
