"""Wall time of the first run (`make run`): the whole command, and where its time goes.

    python -m benchmarks.make_run_time [--repeats 3] [--out benchmarks/results/make_run_time.json]

Runs `make run` `--repeats` times one after another and records, per run: the command's wall
time, the run's own wall time (results.json), the rounds before training (popularity reports and
registration; the ClientApp processes' start is in them), the median training round, how much longer the last
tenth of the training rounds take than the first tenth (a state that grows with the rounds shows here) and the
final RMSE; then the medians. Run it on an otherwise idle machine: the number it measures is what a newcomer waits.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from fedrec_flwr.reporting.results import load_results

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "outputs" / "latest"


def one_run() -> dict:
    """`make run` once; its wall time and the phases read back from its results."""
    t0 = time.perf_counter()
    proc = subprocess.run(["make", "run"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"make run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    doc = load_results(OUT)
    with (OUT / "rounds.csv").open() as f:
        rows = list(csv.DictReader(f))
    train = [float(r["round_seconds"]) for r in rows if r["phase"] == "train"]
    # the rounds before training (popularity reports, if any, then registration): the ClientApp processes start in them
    before = sum(float(r["round_seconds"]) for r in rows if r["phase"] in ("popularity", "register"))
    return {"make_run_seconds": wall, "run_wall_seconds": doc["wall_seconds"], "rounds_before_training_seconds": before,
            "train_round_median_seconds": statistics.median(train), "train_rounds": len(train),
            "late_over_early_rounds": _late_over_early(train),
            "outside_the_run_seconds": wall - doc["wall_seconds"], "rmse": doc["final"]["rmse"]}


def _late_over_early(seconds: list[float]) -> float:
    """The median of the last tenth of the training rounds over that of the first tenth: about 1 when a round's
    cost does not grow with the rounds before it."""
    tenth = max(len(seconds) // 10, 1)
    return statistics.median(seconds[-tenth:]) / statistics.median(seconds[:tenth])


def main(argv: list[str] | None = None) -> None:
    """Time `make run` several times and write the runs and their medians as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "make_run_time.json"))
    args = ap.parse_args(argv)
    runs = []
    for k in range(args.repeats):
        runs.append(one_run())
        print(f"run {k + 1}/{args.repeats}: " + ", ".join(f"{key}={v:.4g}" for key, v in runs[-1].items()), flush=True)
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    doc = {"command": "make run", "date": date.today().isoformat(), "machine": machine, "repeats": args.repeats,
           "median": medians, "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(medians), file=sys.stdout)


if __name__ == "__main__":
    main()
