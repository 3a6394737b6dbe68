"""End to end: a small FedGNN job through `flwr run` (local SuperLink, Ray virtual clients)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedrec_flwr.cli.commands import main as cli_main
from tests.conftest import fixed_secrets

needs_superlink = pytest.mark.skipif(
    shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
    reason="flower-superlink not installed next to this Python",
)


def run_main(argv: list[str]) -> None:
    """`fedrec run ARGV`."""
    cli_main(["run", *argv])


ROOT = Path(__file__).resolve().parents[1]
# one small FedGNN run, checkpointing every 2 training rounds: the results test reads it, and the kill-and-resume
# test compares its resumed run with it (one flwr run fewer: each costs ~40 s on 2 busy cores)
SMALL_RUN = ["--preset", "fedgnn_paper", "--dataset", "synthetic", "--set", "data.synthetic.num_users=24",
             "data.synthetic.num_items=60", "data.synthetic.mean_degree=10", "model.dim=16", "privacy.pseudo_items=20",
             "federation.rounds=6", "federation.clients_per_round=8", "federation.eval_every=3", "checkpoint.every=2"]


def _env() -> dict:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def _small_job(out: Path, cache: Path, *extra: str) -> list[str]:
    """`fedrec run` of SMALL_RUN into `out`, with more overrides; its devices' secrets fixed (TEST_SECRET), so that
    a resumed run draws what the uninterrupted one drew."""
    return [sys.executable, "-m", "fedrec_flwr.cli.commands", "run", "--out", str(out), "--cache-dir", str(cache),
            "--device-secrets", str(fixed_secrets(cache)), *SMALL_RUN, *extra]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, str]:
    """SMALL_RUN through flwr run, uninterrupted: its output folder and console output."""
    base = tmp_path_factory.mktemp("small-run")
    proc = subprocess.run(_small_job(base / "out", base / "cache"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base / "out", proc.stdout


@needs_superlink
def test_flwr_run_writes_results(small_run):
    out, console = small_run
    final = json.loads(console.strip().splitlines()[-1])
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "finished" and doc["algorithm"] == "fedgnn" and doc["dataset"] == "synthetic"
    assert final["rmse"] == doc["final"]["rmse"] and 0 < final["rmse"] < 4
    train = [r for r in doc["rounds"] if r.get("phase") == "train"]
    assert len(train) == 6 and all(r["accepted"] == 8 and r["rejected"] == 0 for r in train)
    assert [r["round"] for r in train if "rmse" in r] == [4, 7]  # evaluated every 3 training rounds
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in train)
    # traffic is O((K+M) d), far below the full item table per client
    assert all(r["bytes_down"] < 60 * 16 * 4 + 16 * 16 * 4 * 8 for r in train)
    assert doc["rounds"][0]["phase"] == "register" and doc["rounds"][0]["accepted"] == 24
    assert doc["config"]["privacy"]["ldp"] is True and doc["wall_seconds"] > 0


@needs_superlink
def test_flwr_run_with_graph_expansion(tmp_path, capsys):
    """The neighbour service starts as its own process; every user expands, then trains with neighbours."""
    out = tmp_path / "out"
    run_main([
        "--preset", "fedgnn_paper", "--dataset", "synthetic", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
        "--set", "data.synthetic.num_users=20", "data.synthetic.num_items=50", "data.synthetic.mean_degree=8",
        "model.dim=8", "privacy.pseudo_items=10", "federation.rounds=2", "federation.clients_per_round=8",
        "federation.eval_every=2", "expansion.mode=trainable", "expansion.epoch=0", "expansion.max_neighbours=3",
    ])
    doc = json.loads((out / "results.json").read_text())
    phases = [r.get("phase") for r in doc["rounds"]]
    assert phases[:3] == ["register", "expand-submit", "expand-fetch"] and phases.count("train") == 2
    fetch = doc["rounds"][2]
    assert fetch["accepted"] == 20 and 0 < fetch["mean_neighbours"] <= 3
    assert doc["status"] == "finished" and 0 < doc["final"]["rmse"] < 4


@needs_superlink
def test_flwr_run_fppdm_one_supernode_per_domain_in_plaintext_and_under_paillier(tmp_path, capsys):
    """One SuperNode per domain; then the domains share a key the server never gets, and the run through flwr
    ends as the plaintext one does (one plaintext run serves both checks: a flwr run costs ~25 s to start)."""
    from fedrec_flwr.privacy.paillier_pack import DomainKeys

    common = ["--preset", "fppdm", "--dataset", "synthetic-md3", "--cache-dir", str(tmp_path / "cache"), "--set",
              "federation.rounds=1", "federation.eval_every=1", "fppdm.model.dim=8", "fppdm.training.local_epochs=1"]
    run_main(["--out", str(tmp_path / "plain"), *common])
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())
    assert plain["status"] == "finished" and plain["algorithm"] == "fppdm"
    assert {"hr@5", "ndcg@5", "hr@10", "ndcg@10", "domain0/hr@10"} <= set(final)
    train = [r for r in plain["rounds"] if r.get("phase") == "train"]
    assert len(train) == 1 and all(r["accepted"] == 3 and r["overlapping_users"] > 0 for r in train)

    key_file = tmp_path / "domains.key.json"
    DomainKeys.generate(1024).save(key_file)
    run_main(["--out", str(tmp_path / "secure"), *common, "fppdm.secure.enabled=true",
              f"fppdm.secure.key_file={key_file}", "fppdm.secure.key_bits=1024"])
    secure = json.loads((tmp_path / "secure" / "results.json").read_text())
    assert secure["status"] == "finished" and all(r["accepted"] == 3 for r in secure["rounds"] if "accepted" in r)
    up = lambda doc: [r["bytes_up"] for r in doc["rounds"] if "bytes_up" in r]  # noqa: E731
    assert min(up(secure)) > max(up(plain))  # ciphertexts, not floats, went to the server
    # fixed-point encryption changes the barycenters by < 2^-16: the rankings end (almost) the same
    assert abs(secure["final"]["hr@10"] - plain["final"]["hr@10"]) <= 0.02


@needs_superlink
def test_flwr_run_killed_midway_and_resumed_ends_as_the_uninterrupted_run(small_run, tmp_path):
    """SIGKILL the ServerApp's process after a checkpoint, rerun with checkpoint.resume=true: same final RMSE. The
    process is the one the run's own `serverapp.pid` names (checked to be a Flower simulation), never one found by
    name on the machine; the run is then stopped on the SuperLink by its own id."""
    root, env = ROOT, _env()

    def job(out, *extra):
        return _small_job(out, tmp_path / "cache", *extra)

    killed = tmp_path / "killed"
    log = tmp_path / "killed.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(job(killed), cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not (killed / "checkpoint" / "server.pt").is_file():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        pid = int((killed / "serverapp.pid").read_text())
        assert any("flwr-simulation" in part for part in psutil.Process(pid).cmdline()[:2])
        os.kill(pid, signal.SIGKILL)  # the ServerApp's process dies mid-run, as in a crash
        run_id = log.read_text().split("run_id `")[1].split("`")[0]
        subprocess.run([str(Path(sys.executable).parent / "flwr"), "stop", run_id, "local"], cwd=root,
                       env=env, capture_output=True, text=True)
        proc.wait(timeout=120)
    interrupted = json.loads((killed / "results.json").read_text())
    assert interrupted["status"] != "finished"
    resumed = subprocess.run(job(killed, "checkpoint.resume=true"), cwd=root, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:]
    clean = json.loads((small_run[0] / "results.json").read_text())
    doc = json.loads((killed / "results.json").read_text())
    assert doc["status"] == "finished" and 1 < doc["resumed_from"] < 7
    assert doc["final"]["rmse"] == pytest.approx(clean["final"]["rmse"], abs=1e-9)
    train = [r["round"] for r in doc["rounds"] if r.get("phase") == "train"]
    assert train == list(range(2, 8))  # history from the checkpoint, then the resumed rounds


@needs_superlink
def test_plain_flwr_run_spreads_every_user_over_the_federation_it_is_given_or_stops_in_one_line(tmp_path):
    """`flwr run .` as a Flower user runs it, with Flower's federation of two SuperNodes: the default
    (simulation.users_per_node = 0) spreads all 24 users over the two nodes and scores every test rating. A fixed
    users_per_node the two nodes cannot hold (5 users each, 24 users) stops at the first round, in one line naming
    the SuperNodes it needs and the command that sets it, instead of training on part of the users."""
    flwr = str(Path(sys.executable).parent / "flwr")
    small = ("data.synthetic.num_users=24 data.synthetic.num_items=60 data.synthetic.mean_degree=10 model.dim=16 "
             "privacy.pseudo_items=20 federation.rounds=2 federation.eval_every=2 federation.clients_per_round=8")

    def plain_run(out: Path, extra: str = "") -> subprocess.CompletedProcess:
        config = f"output-dir='{out}' cache-dir='{tmp_path / 'cache'}' set='{small} {extra}'"
        return subprocess.run([flwr, "run", ".", "--stream", "--federation-config", "num-supernodes=2",
                               "--run-config", config], cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=600)

    spread = plain_run(tmp_path / "spread")
    doc = json.loads((tmp_path / "spread" / "results.json").read_text())
    assert doc["status"] == "finished", spread.stdout[-3000:] + spread.stderr[-3000:]
    register = next(r for r in doc["rounds"] if r.get("phase") == "register")
    assert register["accepted"] == 24 and register["nodes"] == 2
    assert doc["final"]["eval_ratings"] == doc["final"]["test_ratings"] > 0  # every test rating scored

    plain_run(tmp_path / "short", "simulation.users_per_node=5")
    failed = json.loads((tmp_path / "short" / "results.json").read_text())
    assert failed["status"] == "failed" and not any(r.get("phase") == "train" for r in failed.get("rounds", []))
    why = failed["error"]
    assert "this run needs 5" in why and 'num-supernodes=5' in why, why
