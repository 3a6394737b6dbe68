"""Benchmark driver: launch one real run (federated through `flwr run`, or centralized) and report.

    python -m benchmarks.run --preset fedgnn_paper --dataset ml-100k --data-dir DATA \
        [--out DIR] [--centralized] [--seed 0] [--set key=value ...]

DATA is the folder holding the datasets. The run's results.json and rounds.csv go to --out, by
default outputs/<preset>-<dataset>-s<seed> (with -centralized appended for --centralized; the
dataset is the preset's own when --dataset is not given). The last line printed is the final
metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from benchmarks.app_source import staged_app
from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.config import ConfigError, load_config, parse_overrides
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


def run_federated(args: argparse.Namespace, out: Path, overrides: list[str]) -> dict:
    """Run the app through `flwr run` with one virtual SuperNode per user; returns results.json."""
    cfg = load_config(args.preset, args.dataset, [f"data.data_dir={args.data_dir}", f"data.cache_dir={args.cache_dir}", *overrides])
    num_nodes = get_algorithm(cfg.algorithm).part("nodes")(cfg)  # data prepared once here, read by every client
    run_config = " ".join([
        f"preset='{args.preset}'", f"dataset='{args.dataset or ''}'", f"seed={args.seed}",
        f"data-dir='{Path(args.data_dir).resolve()}'", f"cache-dir='{Path(args.cache_dir).resolve()}'",
        f"output-dir='{out.resolve()}'", f"set='{' '.join(overrides)}'",
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


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print the final metrics as the last line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fedgnn_paper")
    ap.add_argument("--dataset", default="", help="registry name; default: the preset's own")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "fedrec"))
    ap.add_argument("--out", default="", help="output folder; default: outputs/<preset>-<dataset>-s<seed>")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--centralized", action="store_true", help="train the centralized reference instead")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value")
    args = ap.parse_args(argv)
    with input_errors_exit():
        overrides = parse_overrides(" ".join(args.set))
        if args.out:
            out = Path(args.out)
        else:
            dataset = args.dataset or load_config(args.preset, None, overrides).data.name
            out = default_out(args.preset, dataset, args.seed, args.centralized)
            print(f"output folder: {out}", flush=True)
        if args.centralized:
            from fedrec_flwr.centralized import run_centralized

            cfg = load_config(args.preset, args.dataset, [
                f"data.data_dir={args.data_dir}", f"data.cache_dir={args.cache_dir}", f"output_dir={out}",
                f"seed={args.seed}", *overrides,
            ])
            final = run_centralized(cfg)
        else:
            final = run_federated(args, out, overrides)["final"]
    print(json.dumps(final))


if __name__ == "__main__":
    main()
