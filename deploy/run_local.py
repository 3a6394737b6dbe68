"""A real Flower deployment on loopback: SuperLink (TLS + SuperNode auth), one SuperNode per user
(FedGNN) or per domain (FPPDM), the neighbour service, each its own process; then `flwr run`.

    python deploy/run_local.py --work /tmp/fedrec-deploy [--algorithms fedgnn fppdm] [--rounds 2]

Every step is the one a real operator runs on separate machines (see README, "Deployment"):
certificates (deploy/make_certs.sh), per-node data files (fedrec_flwr.node_data), a SuperLink
with --enable-supernode-auth, `flwr supernode register` of each node's public key, SuperNodes
started with their private key and `--node-config data-path=...` (their own file only), and
`flwr run . <connection>`. It also starts a SuperNode whose key was never registered and checks
that the SuperLink refuses it, and (FedGNN) a registered SuperNode that is not in the operator's
node list and claims another device's user, and checks that the server refuses its registration. Exits non-zero, naming the step, if anything fails; prints the
results files it checked.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class DeployError(RuntimeError):
    """A deployment step failed; the message names it."""


def free_port() -> int:
    """An unused loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    """Block until something listens on `port` (or fail if `proc` died)."""
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise DeployError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise DeployError(f"{what} did not listen on port {port} within {timeout:.0f}s")


class Deployment:
    """Processes of one loopback deployment; `close()` stops them all."""

    def __init__(self, work: Path):
        self.work = work
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", FLWR_HOME=str(work / "flwr-home"),
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", PYTHONUNBUFFERED="1")

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start a long-running process; its output goes to work/logs/<name>.log."""
        log = open(self.work / "logs" / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
        proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def run(self, what: str, cmd: list[str], timeout: float = 120) -> str:
        """Run a command to completion; DeployError with its output if it fails."""
        res = subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        slug = "".join(c if c.isalnum() else "-" for c in what).strip("-")
        (self.work / "logs" / f"{slug}.log").write_text(res.stdout + res.stderr)
        if res.returncode != 0:
            raise DeployError(f"{what} failed (exit {res.returncode}): {res.stdout[-1500:]}{res.stderr[-1500:]}")
        return res.stdout

    def log(self, name: str) -> str:
        """What a started process has written so far."""
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def stop(self, name: str) -> None:
        """Stop one started process (SIGTERM, then SIGKILL)."""
        for n, proc in self.procs:
            if n == name and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop every process this deployment started."""
        for name, _ in reversed(self.procs):
            self.stop(name)


def deploy_and_run(algorithm: str, work: Path, rounds: int, nodes: int) -> dict:
    """Stand up one deployment for `algorithm`, run it through `flwr run`, return its results.json."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    certs, data = work / "certs", work / "data"
    # keys: node-0 .. node-{nodes-1} the devices, node-{nodes} never registered, node-{nodes+1} an impostor
    subprocess.run(["bash", str(ROOT / "deploy" / "make_certs.sh"), str(certs), str(nodes + 2)], check=True,
                   capture_output=True)
    if algorithm == "fedgnn":
        preset, dataset = "fedgnn_paper", "synthetic"
        data_set = [f"data.synthetic.num_users={nodes}", "data.synthetic.num_items=60", "data.synthetic.mean_degree=12",
                    "data.synthetic.test_fraction=0.3", "model.dim=16", "privacy.pseudo_items=20"]
        run_set = [*data_set, f"federation.rounds={rounds}", f"federation.clients_per_round={nodes}",
                   "federation.min_clients=2", f"deployment.min_nodes={nodes + 1}", "federation.eval_every=1",
                   "expansion.mode=fixed", "expansion.epoch=1", "faults.malformed=0.3"]
        files = [data / f"user-{i}.npz" for i in range(nodes)]
    else:
        preset, dataset = "fppdm", "synthetic-md3"
        data_set = []
        run_set = [f"federation.rounds={rounds}", "federation.eval_every=1", "fppdm.training.local_epochs=1",
                   "fppdm.model.dim=16"]
        files = [data / f"domain-{i}.npz" for i in range(nodes)]
    subprocess.run([sys.executable, "-m", "fedrec_flwr.node_data", "--preset", preset, "--dataset", dataset, "--out",
                    str(data), "--cache-dir", str(work / "cache"), "--set", *data_set], check=True, cwd=ROOT,
                   capture_output=True)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DeployError(f"node data export did not write {missing}")
    port, service = free_port(), free_port()  # Flower 1.42 serves the Fleet, Control and Runtime APIs on one HTTPS port
    (work / "flwr-home").mkdir(exist_ok=True)
    (work / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n')
    dep = Deployment(work)
    try:
        link = dep.start(f"{algorithm}-superlink", [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(port),
            "--database", str(work / f"{algorithm}-state.db"), "--disable-runtime-dependency-installation",
        ])
        wait_port(port, link, "SuperLink")
        node_ids = {}  # the operator registers each device's public key; node `nodes` is never registered
        for i in [*range(nodes), nodes + 1]:
            reply = dep.run(f"registering node {i}", [str(BIN / "flwr"), "supernode", "register",
                                                      str(certs / f"node-{i}.pub"), "deploy", "--format", "json"])
            node_ids[i] = int(json.loads(reply[reply.index("{"):])["node-id"])
        if algorithm == "fedgnn":  # the operator's node list: device i speaks for user i; the impostor for nobody
            node_list = work / "node-list.json"
            node_list.write_text(json.dumps({str(node_ids[i]): [i] for i in range(nodes)}))
            run_set.append(f"deployment.node_list={node_list}")
        if algorithm == "fedgnn":  # HTTPS with the SuperLink's certificate; runs opened with the operator's token
            token_file = certs / "neighbour-admin.token"
            token_file.touch(mode=0o600)
            token_file.chmod(0o600)  # before the token is in it
            token_file.write_text(secrets.token_hex(32))
            svc = dep.start("neighbour-service", [str(BIN / "fedrec-neighbour-service"), "--host", "127.0.0.1",
                                                  "--port", str(service), "--admin-token-file", str(token_file),
                                                  "--certfile", str(certs / "server.pem"),
                                                  "--keyfile", str(certs / "server.key")])
            wait_port(service, svc, "neighbour service")
            run_set += [f"expansion.service_address=127.0.0.1:{service}", f"expansion.ca_file={certs / 'ca.crt'}",
                        f"expansion.service_token_file={token_file}"]
        starts = [*range(nodes + 1), nodes + 1] if algorithm == "fedgnn" else range(nodes + 1)
        for i in starts:  # the impostor (registered, unlisted) holds device 0's file and claims its user
            node_config = f"data-path='{files[i if i < nodes else 0]}' state-dir='{work / 'devices' / str(i)}'"
            dep.start(f"{algorithm}-supernode-{i}", [
                str(BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
                "--superlink", f"127.0.0.1:{port}", "--auth-supernode-private-key", str(certs / f"node-{i}"),
                "--node-config", node_config,
                "--port", str(free_port()), "--max-retries", "3", "--max-wait-time", "30",
            ])
        out = work / f"out-{algorithm}"
        run_config = (f"preset='{preset}' dataset='{dataset}' output-dir='{out}' cache-dir='{work / 'server-cache'}' "
                      f"set='data.catalogue={data / 'catalogue.json'} {' '.join(run_set)}'")
        dep.run(f"flwr run ({algorithm})", [str(BIN / "flwr"), "run", str(ROOT), "deploy", "--stream",
                                            "--run-config", run_config], timeout=600)
        results = json.loads((out / "results.json").read_text())
        if results.get("status") != "finished":
            raise DeployError(f"{algorithm} run did not finish: {out / 'results.json'}")
        rogue_log = dep.log(f"{algorithm}-supernode-{nodes}")
        link_log = dep.log(f"{algorithm}-superlink")
        refused = ("Failed to activate SuperNode" in rogue_log
                   and "No SuperNode found with the given public key" in link_log)
        listing = dep.run("listing SuperNodes", [str(BIN / "flwr"), "supernode", "list", "deploy", "--format", "json"])
        impostor = [r["reason"] for r in results.get("rejections", []) if "not assigned to node" in r["reason"]]
        results["deploy"] = {"rogue_node_refused": refused, "rogue_log_tail": rogue_log[-600:], "impostor_refused": impostor,
                             "supernode_list": listing[-3000:], "results_file": str(out / "results.json")}
        return results
    finally:
        dep.close()


def main() -> None:
    """Run the deployment for each algorithm; print what was checked."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/deploy")
    ap.add_argument("--algorithms", nargs="+", default=["fedgnn", "fppdm"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fedgnn-nodes", type=int, default=4)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for algorithm in args.algorithms:
        nodes = args.fedgnn_nodes if algorithm == "fedgnn" else 3
        res = deploy_and_run(algorithm, work / algorithm, args.rounds, nodes)
        summary[algorithm] = {"final": res["final"], **res["deploy"]}
        print(f"[deploy] {algorithm}: {json.dumps(summary[algorithm]['final'])}", flush=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({a: {"final": s["final"], "rogue_node_refused": s["rogue_node_refused"]} for a, s in summary.items()}))


if __name__ == "__main__":
    main()
