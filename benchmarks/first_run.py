"""The first run's check over run seeds: `make run`'s preset against its split's baselines.

    python -m benchmarks.first_run [--seeds 0 1 2 3 4] [--out benchmarks/results/first_run.json]

Trains the `quickstart` preset (what `make run` trains, through the same round core as `flwr run`)
in-process once per run seed on the embedded synthetic data, and records each seed's final test
RMSE beside the split's centralized baselines (global, user and item mean; the regularised bias
model) and how far below the best trivial baseline it ends. The data are the same for every run
seed (data.seed); the run seed moves the model's initialisation, sampling and privacy noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reference.baselines import baseline_rmses, best_trivial


def main() -> None:
    """Run every seed, print one line each, write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default="benchmarks/results/first_run.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("quickstart", None, [])
    baselines = baseline_rmses(UserPartitions(prepare_partitions(cfg.data)).ratings())
    best = best_trivial(baselines)
    runs = []
    for seed in args.seeds:
        t0 = time.time()
        out = run_in_process(load_config("quickstart", None, [f"seed={seed}"]), log_every=0)
        runs.append({"seed": seed, "rmse": out["rmse"], "below_best_trivial": 1.0 - out["rmse"] / best,
                     "wall_seconds": time.time() - t0, "privacy": out["history"][-1]["privacy"]})
        print(f"[first_run] seed {seed}: rmse {out['rmse']:.4f}, {100 * runs[-1]['below_best_trivial']:.1f}% below "
              f"the best trivial baseline ({best:.4f}), {runs[-1]['wall_seconds']:.0f} s", flush=True)
    record = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {torch.get_num_threads()} thread",
              "command": "python -m benchmarks.first_run --seeds " + " ".join(map(str, args.seeds)),
              "preset": "quickstart", "rounds": cfg.federation.rounds, "baselines": baselines,
              "best_trivial": best, "runs": runs}
    atomic_write(Path(args.out), json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
