"""Launch one run: federated through `flwr run` (the simulated federation sized from the data), or the
centralized reference; the `fedrec run` command (`fedrec_flwr.cli`) is its front end.

A run's results.json and rounds.csv go to its output folder, by default
outputs/<preset>-<dataset>-s<seed> (with -centralized appended for the centralized reference). A run
that fails (flwr's exit code, or the status its results.json records) raises SystemExit with the
reason; an earlier run's results in the same folder are removed first, so they are never reported.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.app_source import staged_app
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import DataError
from fedrec_flwr.results import load_results

ROOT = Path(__file__).resolve().parent.parent
STARTED_RUN = re.compile(r"started run (\d+)")
UNSAFE_IN_PATH = re.compile(r"[^A-Za-z0-9._-]+")


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _flwr_binary() -> str:
    local = Path(sys.executable).parent / "flwr"
    return str(local) if local.exists() else (shutil.which("flwr") or "flwr")


def federation_config(num_nodes: int, cfg) -> str:
    """flwr run's --federation-config: SuperNode count and each ClientApp's Ray resources (config keys
    simulation.num_cpus / simulation.num_gpus; a fractional GPU lets several clients share one)."""
    sim = cfg.simulation
    return (f"num-supernodes={num_nodes} client-resources-num-cpus={sim.num_cpus:g} "
            f"client-resources-num-gpus={sim.num_gpus:g}")


def stream_flwr_run(cmd: list[str], env: dict[str, str]) -> int:
    """Run `flwr run --stream`, echoing its output, and return its exit code.

    `flwr run` hands the run to a background SuperLink, so killing this process alone would leave the
    simulation training. On SIGTERM or SIGINT this stops the run on the SuperLink (`flwr stop RUN_ID`),
    ends `flwr run`, and exits with 128 + the signal number.
    """
    def interrupted(signum, _frame):
        raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    run_id = None
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if run_id is None and (m := STARTED_RUN.search(line)):
                run_id = m.group(1)
        return proc.wait()
    except _Interrupted as stop:
        if run_id is not None:
            print(f"stopping run {run_id} on the SuperLink", flush=True)
            try:
                subprocess.run([cmd[0], "stop", run_id, "local"], env=env, cwd=ROOT, timeout=120, check=False)
            except subprocess.TimeoutExpired:
                print(f"flwr stop {run_id} did not answer in 120 s: check `flwr ls local`", flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise SystemExit(128 + stop.signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()


@dataclass(frozen=True)
class RunRequest:
    """What one run is asked for: preset, dataset ("" = the preset's own), seed, where the data and the cache
    are, and the overrides (`key=value`)."""

    preset: str
    dataset: str = ""
    seed: int = 0
    data_dir: str = "data"
    cache_dir: str = str(ROOT / ".cache" / "fedrec")
    overrides: tuple[str, ...] = ()

    def config(self, *extra: str):
        """The run's validated AppConfig (data and cache folders, the overrides, then `extra`)."""
        return load_config(self.preset, self.dataset or None, [f"data.data_dir={self.data_dir}",
                                                               f"data.cache_dir={self.cache_dir}", *self.overrides, *extra])

    def default_out(self, centralized: bool = False) -> Path:
        """outputs/<preset>-<dataset>-s<seed>[-centralized] for this request (`default_out`)."""
        dataset = self.dataset or load_config(self.preset, None, list(self.overrides)).data.name
        return default_out(self.preset, dataset, self.seed, centralized)


def run_centralized_reference(request: RunRequest, out: Path) -> dict:
    """Train the centralized reference of `request` into `out`; returns its final metrics."""
    from fedrec_flwr.centralized import run_centralized

    return run_centralized(request.config(f"output_dir={out}", f"seed={request.seed}"))


def run_federated(request: RunRequest, out: Path) -> dict:
    """Run the app through `flwr run` with one virtual SuperNode per `simulation.users_per_node` users (one per
    domain for FPPDM); returns results.json, or raises SystemExit with the reason when the run failed."""
    cfg = request.config()
    num_nodes = get_algorithm(cfg.algorithm).part("nodes")(cfg)  # data prepared once here, read by every client
    run_config = " ".join([
        f"preset='{request.preset}'", f"dataset='{request.dataset}'", f"seed={request.seed}",
        f"data-dir='{Path(request.data_dir).resolve()}'", f"cache-dir='{Path(request.cache_dir).resolve()}'",
        f"output-dir='{out.resolve()}'", f"set='{' '.join(request.overrides)}'",
    ])
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    for stale in ("results.json", "rounds.csv"):  # an earlier run's results must never be reported as this one's
        (out / stale).unlink(missing_ok=True)
    with staged_app(ROOT, ROOT / ".cache") as app:  # the app's own files: Flower's FAB build then skips .venv
        cmd = [_flwr_binary(), "run", str(app), "local", "--stream",
               "--federation-config", federation_config(num_nodes, cfg), "--run-config", run_config]
        print("+", " ".join(cmd), flush=True)
        returncode = stream_flwr_run(cmd, env)
    results = out / "results.json"
    doc = load_results(out) if results.is_file() else {}
    if returncode != 0 or doc.get("status") != "finished":
        why = doc.get("error") or (f"{results} says status {doc['status']!r}" if doc else f"no {results} was written")
        raise SystemExit(f"federated run failed (flwr exit {returncode}): {why}")
    return doc


def default_out(preset: str, dataset: str, seed: int, centralized: bool = False) -> Path:
    """outputs/<preset>-<dataset>-s<seed>[-centralized], each name reduced to a safe folder name
    ('disencdr:phone_elec' -> 'disencdr-phone_elec')."""
    name = "-".join(UNSAFE_IN_PATH.sub("-", part).strip("-") for part in (preset, dataset))
    return Path("outputs") / f"{name}-s{seed}{'-centralized' if centralized else ''}"


@contextmanager
def input_errors_exit():
    """Print a ConfigError (as one line) or DataError on stderr without a traceback, and exit with status 2."""
    try:
        yield
    except (ConfigError, DataError) as exc:
        message = " ".join(str(exc).split()) if isinstance(exc, ConfigError) else str(exc)
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
