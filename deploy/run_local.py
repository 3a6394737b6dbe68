"""A real Flower deployment on loopback: SuperLink (TLS + SuperNode auth), one SuperNode per user
(FedGNN under LDP, and under user-level DP with SecAgg+) or per domain (FPPDM), the neighbour service, each
its own process; then `flwr run`.

    python deploy/run_local.py --work /tmp/fedrec-deploy [--algorithms fedgnn fedgnn_user_dp fppdm] [--rounds N]

Every step is the one a real operator runs on separate machines (see README, "Deployment"):
certificates (deploy/make_certs.sh), per-node data files (fedrec_flwr.deployment.node_data), a SuperLink
with --enable-supernode-auth, `flwr supernode register` of each node's public key, SuperNodes
started with their private key and `--node-config data-path=...` (their own file only), and
`flwr run . <connection>`. It also starts a SuperNode whose key was never registered and checks
that the SuperLink refuses it, and (FedGNN) a registered SuperNode that is not in the operator's
node list and claims another device's user, and checks that the server refuses its registration.
Exits non-zero, naming the step, if anything fails; prints the results files it checked.

The algorithms' deployments are independent (each its own SuperLink, ports, FLWR_HOME and
SuperNodes; one CA and set of node keys) and run at the same time; within one, the SuperLink and
the neighbour service start while the node data is written, and the node keys are registered
together. Each step prints one line when it ends: `[deploy HH:MM:SS +T] algorithm: step  seconds`
(T: seconds since the script started). `logs/flwr-run--<algorithm>.log` has each `flwr run`
line with the seconds since the run started, the other logs each process's output.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
from fedrec_flwr.flower.app_source import staged_app  # noqa: E402  (the project's root is on the path only now)


class DeployError(RuntimeError):
    """A deployment step failed; the message names it."""


T0 = time.monotonic()


def progress(scope: str, what: str) -> None:
    """One line of progress: the clock, the seconds since the script started, the algorithm, the step."""
    print(f"[deploy {time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {scope}: {what}", flush=True)


class Phase:
    """`with Phase("fedgnn", "SuperLink start"):` prints one line when the step ends, with its wall time
    (counted from `since` where given: a process started earlier)."""

    def __init__(self, scope: str, what: str, since: float | None = None):
        self.scope, self.what, self.since = scope, what, since

    def __enter__(self) -> Phase:
        self.start = time.monotonic() if self.since is None else self.since
        return self

    def __exit__(self, exc_type, *_) -> None:
        status = "" if exc_type is None else " FAILED"
        progress(self.scope, f"{self.what}{status}  {time.monotonic() - self.start:.1f}s")


_PORTS: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """An unused loopback TCP port, never one this script handed out before (deployments start concurrently)."""
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _PORTS:
                _PORTS.add(port)
                return port


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    """Block until something listens on `port` (or fail if `proc` died)."""
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise DeployError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise DeployError(f"{what} did not listen on port {port} within {timeout:.0f}s")


class Deployment:
    """Processes of one loopback deployment; `close()` stops them all."""

    def __init__(self, work: Path):
        self.work = work
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.lock = threading.RLock()
        self.closed = False
        self.env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", FLWR_HOME=str(work / "flwr-home"),
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", PYTHONUNBUFFERED="1",
                        # each SuperExec looks for a message to launch a ClientApp / ServerApp for every 0.2 s
                        # instead of every 1 s: a loopback test's rounds are mostly such waits
                        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2",
                        # a loopback test: no usage events to Flower's server from each of its ~40 processes
                        FLWR_TELEMETRY_ENABLED=os.environ.get("FLWR_TELEMETRY_ENABLED", "0"))
        # one BLAS / OpenMP thread per process: a dozen processes share the cores (the ClientApp sets torch's
        # own thread count to 1 too); idle worker threads spinning would take their CPU time
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env.setdefault(var, "1")

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start a long-running process; its output goes to work/logs/<name>.log."""
        log = open(self.work / "logs" / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
        with self.lock:
            if self.closed:
                raise DeployError(f"not starting {name}: the deployment was stopped")
            proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs.append((name, proc))
        return proc

    def run(self, what: str, cmd: list[str], timeout: float = 120, stamp: bool = False) -> str:
        """Run a command to completion; DeployError with its output if it fails. With `stamp`, each line
        of its log gets the seconds since the command started (where a `flwr run` spends its time)."""
        slug = "".join(c if c.isalnum() else "-" for c in what).strip("-")
        if not stamp:
            res = subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            (self.work / "logs" / f"{slug}.log").write_text(res.stdout + res.stderr)
            if res.returncode != 0:
                raise DeployError(f"{what} failed (exit {res.returncode}): {res.stdout[-1500:]}{res.stderr[-1500:]}")
            return res.stdout
        start, lines = time.monotonic(), []
        with self.lock:
            if self.closed:
                raise DeployError(f"not running {what}: the deployment was stopped")
            proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            self.procs.append((slug, proc))  # close() from another thread stops it too
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        killer.start()
        try:
            with open(self.work / "logs" / f"{slug}.log", "w") as log:
                for line in proc.stdout:
                    lines.append(line)
                    log.write(f"[+{time.monotonic() - start:6.1f}s] {line}")
                    log.flush()
            proc.wait()
        finally:
            killer.cancel()
        out = "".join(lines)
        if proc.returncode != 0:
            raise DeployError(f"{what} failed (exit {proc.returncode}): {out[-3000:]}")
        return out

    def exited(self, prefix: str) -> dict[str, str]:
        """{name: log tail} of the started processes named `prefix`... that have already exited."""
        with self.lock:
            gone = [name for name, proc in self.procs if name.startswith(prefix) and proc.poll() is not None]
        return {name: self.log(name)[-600:] for name in gone}

    def log(self, name: str) -> str:
        """What a started process has written so far."""
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def close(self) -> None:
        """Stop every process this deployment started: SIGTERM to all (SuperNodes first), then SIGKILL to any
        process group still alive after 10 s. Safe to call more than once and from another thread."""
        with self.lock:
            self.closed = True
            live = [proc for _, proc in reversed(self.procs) if proc.poll() is None]
            for proc in live:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 10
            for proc in live:
                try:
                    proc.wait(max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for proc in live:  # the group too: a process's children (e.g. a SuperNode's ClientApp)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


PER_USER = ("fedgnn", "fedgnn_user_dp")  # deployments with one SuperNode per user (the others: one per domain)
ALGORITHMS = ("fedgnn", "fedgnn_user_dp", "fppdm")


def deploy_and_run(algorithm: str, dep: Deployment, certs: Path, rounds: int, nodes: int) -> dict:
    """Stand up one deployment for `algorithm` in `dep.work`, run it through `flwr run`, return its results.json.
    `certs` holds the CA, the SuperLink's certificate and keys node-0 .. node-{nodes+1}: node-0 .. node-{nodes-1}
    the devices, node-{nodes} never registered, node-{nodes+1} an impostor."""
    work = dep.work
    data = work / "data"
    per_user = algorithm in PER_USER
    if per_user:  # FedGNN with LDP, graph expansion and malformed uploads; or under user-level DP with SecAgg+
        preset, dataset = ("fedgnn_paper" if algorithm == "fedgnn" else "fedgnn_user_dp"), "synthetic"
        data_set = [f"data.synthetic.num_users={nodes}", "data.synthetic.num_items=60", "data.synthetic.mean_degree=12",
                    "data.synthetic.test_fraction=0.3", "model.dim=16", "privacy.pseudo_items=20"]
        run_set = [*data_set, f"federation.rounds={rounds}", f"federation.clients_per_round={nodes}",
                   "federation.min_clients=2", f"deployment.min_nodes={nodes + 1}", f"federation.eval_every={rounds}"]
        if algorithm == "fedgnn":
            # expansion right after registration, so one training round follows it; seed 0's fault draws make
            # device 2 upload NaN in that round (the other two are applied)
            run_set += ["expansion.mode=fixed", "expansion.epoch=0", "faults.malformed=0.3"]
        else:  # a handful of users can release an evaluation only with little noise: each counts one rating's
            # weight (1 / sqrt 3 of the count), and sigma_e = 0.7 spends 7.2 of the devices' epsilon 8, so that 5
            # users' noisy count (2.9, noise 0.78 with all 5 above the floor of 4) is positive but 1 in 10^4 runs
            run_set += ["privacy.eval_noise_multiplier=0.7", "privacy.eval_max_ratings=1"]
        files = [data / f"user-{i}.npz" for i in range(nodes)]
    else:
        preset, dataset = "fppdm", "synthetic-md3"
        data_set = []
        run_set = [f"federation.rounds={rounds}", f"federation.eval_every={rounds}", "fppdm.training.local_epochs=1",
                   "fppdm.model.dim=16"]
        files = [data / f"domain-{i}.npz" for i in range(nodes)]
    port, service = free_port(), free_port()  # Flower 1.42 serves the Fleet, Control and Runtime APIs on one HTTPS port
    (work / "flwr-home").mkdir(exist_ok=True)
    (work / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n')
    try:
        started = time.monotonic()  # the SuperLink and the neighbour service start while the node data is written
        link = dep.start(f"{algorithm}-superlink", [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(port),
            "--database", str(work / f"{algorithm}-state.db"), "--disable-runtime-dependency-installation",
        ])
        if algorithm == "fedgnn":  # HTTPS with the SuperLink's certificate; runs opened with the operator's token
            token_file = work / "neighbour-admin.token"
            token_file.touch(mode=0o600)
            token_file.chmod(0o600)  # before the token is in it
            token_file.write_text(secrets.token_hex(32))
            svc = dep.start("neighbour-service", [str(BIN / "fedrec-neighbour-service"), "--host", "127.0.0.1",
                                                  "--port", str(service), "--admin-token-file", str(token_file),
                                                  "--certfile", str(certs / "server.pem"),
                                                  "--keyfile", str(certs / "server.key")])
            run_set += [f"expansion.service_address=127.0.0.1:{service}", f"expansion.ca_file={certs / 'ca.crt'}",
                        f"expansion.service_token_file={token_file}"]
        with Phase(algorithm, "per-node data files"):
            dep.run("node data", [sys.executable, "-m", "fedrec_flwr.deployment.node_data", "--preset", preset,
                                  "--dataset", dataset, "--out", str(data), "--cache-dir", str(work / "cache"), "--set",
                                  *data_set])
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise DeployError(f"node data export did not write {missing}")
        with Phase(algorithm, "SuperLink start (listening)", since=started):
            wait_port(port, link, "SuperLink")
        registered = [*range(nodes), nodes + 1]  # the operator registers each device's public key, not node `nodes`
        with Phase(algorithm, f"registering {len(registered)} node keys"), ThreadPoolExecutor(len(registered)) as pool:
            replies = pool.map(lambda i: dep.run(f"registering node {i}", [
                str(BIN / "flwr"), "supernode", "register", str(certs / f"node-{i}.pub"), "deploy", "--format",
                "json"]),
                registered)
            node_ids = {i: int(json.loads(reply[reply.index("{"):])["node-id"])
                        for i, reply in zip(registered, replies)}
        if per_user:  # the operator's node list: device i speaks for user i; the impostor for nobody
            node_list = work / "node-list.json"
            node_list.write_text(json.dumps({str(node_ids[i]): [i] for i in range(nodes)}))
            run_set.append(f"deployment.node_list={node_list}")
        if algorithm == "fedgnn":
            with Phase(algorithm, "neighbour service start (listening)", since=started):
                wait_port(service, svc, "neighbour service")
        starts = [*range(nodes + 1), nodes + 1] if per_user else range(nodes + 1)
        for i in starts:  # the impostor (registered, unlisted) holds device 0's file and claims its user
            node_config = f"data-path='{files[i if i < nodes else 0]}' state-dir='{work / 'devices' / str(i)}'"
            if algorithm != "fppdm":  # the device's own privacy mode: user-level DP unless its operator opts into LDP
                node_config += f" privacy-mode='{'user_dp' if preset == 'fedgnn_user_dp' else 'ldp'}'"
            if algorithm == "fedgnn":  # the LDP devices: the one neighbour service each may contact, the pseudo
                # items they accept (20: the test's 60-item catalogue), and this demo's opt-in to plain evaluation
                # (its exact error sums go to the server, which the operator here also runs; off by default)
                node_config += (f" neighbour-service='127.0.0.1:{service}' neighbour-ca-file='{certs / 'ca.crt'}'"
                                " privacy-min-pseudo-items=20")
                if preset != "fedgnn_user_dp":
                    node_config += " privacy-plain-evaluation='true'"
            # only the never-registered node gives up (it is refused at activation); the others retry as long
            # as Flower's default, so a SuperLink slowed by a loaded machine does not lose a device
            give_up = ["--max-retries", "3", "--max-wait-time", "30"] if i == nodes else []
            dep.start(f"{algorithm}-supernode-{i}", [
                str(BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
                "--superlink", f"127.0.0.1:{port}", "--auth-supernode-private-key", str(certs / f"node-{i}"),
                "--node-config", node_config, "--port", str(free_port()), *give_up,
            ])
        progress(algorithm, f"{len(starts)} SuperNodes started")
        out = work / f"out-{algorithm}"
        run_config = (f"preset='{preset}' dataset='{dataset}' output-dir='{out}' cache-dir='{work / 'server-cache'}' "
                      f"set='data.catalogue={data / 'catalogue.json'} {' '.join(run_set)}'")
        with (Phase(algorithm, f"flwr run ({rounds} rounds; log: logs/flwr-run--{algorithm}.log)"),
              staged_app(ROOT, work / "app") as app):  # the app's own files: the FAB build skips .venv
            dep.run(f"flwr run ({algorithm})", [str(BIN / "flwr"), "run", str(app), "deploy", "--stream",
                                                "--run-config", run_config], timeout=900, stamp=True)
        results = json.loads((out / "results.json").read_text())
        if results.get("status") != "finished":
            raise DeployError(f"{algorithm} run did not finish ({results.get('status')}: "
                              f"{results.get('error', 'no error recorded')}): {out / 'results.json'}")
        rogue_log = dep.log(f"{algorithm}-supernode-{nodes}")
        link_log = dep.log(f"{algorithm}-superlink")
        refused = ("Failed to activate SuperNode" in rogue_log
                   and "No SuperNode found with the given public key" in link_log)
        with Phase(algorithm, "listing SuperNodes"):
            listing = dep.run("listing SuperNodes", [str(BIN / "flwr"), "supernode", "list", "deploy", "--format",
                                                     "json"])
        impostor = [r["reason"] for r in results.get("rejections", []) if "not assigned to node" in r["reason"]]
        rogue = f"{algorithm}-supernode-{nodes}"
        devices_exited = {n: tail for n, tail in dep.exited(f"{algorithm}-supernode-").items() if n != rogue}
        results["deploy"] = {"rogue_node_refused": refused, "rogue_log_tail": rogue_log[-600:],
                             "impostor_refused": impostor, "devices_exited": devices_exited,
                             "supernode_list": listing[-3000:], "results_file": str(out / "results.json")}
        return results
    finally:
        with Phase(algorithm, "stopping processes"):
            dep.close()


def main() -> None:
    """Run the deployment for each algorithm (at the same time unless --one-at-a-time); print what was checked."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/deploy")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    ap.add_argument("--rounds", type=int, default=1, help="training rounds of each deployment (default: 1, which runs "
                    "each protocol whole: graph expansion, SecAgg+'s four stages, FPPDM's barycenter)")
    ap.add_argument("--fedgnn-nodes", type=int, default=3, help="devices of the LDP deployment (default: 3)")
    ap.add_argument("--user-dp-nodes", type=int, default=5, help="devices of the user-level DP deployment (default: "
                    "5, the fewest whose released evaluation has a positive noisy count in all but 1 in 10^4 runs)")
    ap.add_argument("--one-at-a-time", action="store_true", help="deploy the algorithms one after the other")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    nodes = {a: {"fedgnn": args.fedgnn_nodes, "fedgnn_user_dp": args.user_dp_nodes}.get(a, 3) for a in args.algorithms}
    certs = work / "certs"  # one CA, SuperLink certificate and set of node keys; each SuperLink registers its own
    with Phase("all", "certificates and node keys"):
        subprocess.run(["bash", str(ROOT / "deploy" / "make_certs.sh"), str(certs), str(max(nodes.values()) + 2)],
                       check=True, capture_output=True)
    deps = {}
    for algorithm in args.algorithms:
        (work / algorithm / "logs").mkdir(parents=True)
        deps[algorithm] = Deployment(work / algorithm)
    results, errors = {}, []

    def one(algorithm: str) -> None:
        try:
            results[algorithm] = deploy_and_run(algorithm, deps[algorithm], certs, args.rounds, nodes[algorithm])
        except BaseException as exc:
            errors.append(exc)
            for dep in deps.values():  # a failed deployment stops the others at once, not after their runs
                dep.close()
            raise

    signal.signal(signal.SIGTERM, lambda *_: sys.exit("run_local.py: terminated"))  # to the cleanup below
    pool = ThreadPoolExecutor(1 if args.one_at_a_time else len(deps))
    try:
        with Phase("all", "deployments"):
            for future in [pool.submit(one, a) for a in args.algorithms]:
                future.exception()
    except BaseException:  # interrupted: stop every process now, not after the runs
        for dep in deps.values():
            dep.close()
        raise
    finally:
        pool.shutdown(cancel_futures=True)
    if errors:
        raise errors[0]
    summary = {}
    for algorithm in args.algorithms:
        summary[algorithm] = {"final": results[algorithm]["final"], **results[algorithm]["deploy"]}
        print(f"[deploy] {algorithm}: {json.dumps(summary[algorithm]['final'])}", flush=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({a: {"final": s["final"], "rogue_node_refused": s["rogue_node_refused"]}
                      for a, s in summary.items()}))


if __name__ == "__main__":
    main()
