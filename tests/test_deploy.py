"""The deployment test: a real SuperLink with TLS and SuperNode auth, SuperNodes, the neighbour service.

6-8 minutes on 2 cores (FedGNN under LDP, FedGNN under user-level DP with SecAgg+, and FPPDM deploy at
the same time, one training round each, each `flwr run` allowed 15 minutes; deploy/run_local.py prints one
line per step with its wall time, shown here on failure), so it runs under `make deploy-test`
(FEDREC_DEPLOY_TEST=1), which CI calls after the main suite; plain `make test` skips it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert user_dp["status"] == "finished" and len(train) == 1 and all(r["applied"] and r["nodes"] == 3 for r in train), user_dp["rounds"]
    assert user_dp["privacy"]["mode"] == "user_dp" and 0 < user_dp["privacy"]["epsilon"] <= 8
    evaluated = [r for r in user_dp["rounds"] if r.get("phase") == "evaluate-sum"]  # through SecAgg+ too, charged
    assert len(evaluated) == 1 and evaluated[0]["nodes"] == 3 and user_dp["privacy"]["evaluations"] == 1
    assert summary["fedgnn_user_dp"]["impostor_refused"] and summary["fedgnn_user_dp"]["rogue_node_refused"]
    fppdm = json.loads(Path(summary["fppdm"]["results_file"]).read_text())
    assert fppdm["rounds"][0]["clients"] == 3 and 0 <= fppdm["final"]["hr@10"] <= 1
