"""FedGNN at convergence: the number of rounds chosen on a validation holdout, then test runs on three seeds.

    python -m benchmarks.converged_runs --data-dir DATA --dataset ml-100k --max-rounds 800
    python -m benchmarks.converged_runs --data-dir DATA --dataset douban --max-rounds 400

1. Validation: one run of the preset (seed `--validation-seed`) with `data.holdout=validation` (a per-user
   10% of the training ratings held out of training, `fedrec_flwr.data.holdout`), `--max-rounds` long, its
   RMSE on the held-out ratings every `--eval-every` rounds. The test ratings are not read.
2. The number of rounds R: the first evaluation at which the best validation RMSE so far improved by
   less than 0.001 over the last 10% of the rounds (`fedrec_flwr.convergence.rounds_to_flatten`); the
   whole run if it never flattened (then the record says so).
3. Test: one run per seed on the full training ratings, R rounds, scored on every test rating; its
   accounted privacy budget is that of R rounds.

In-process (the round core and device code of `flwr run`), one torch thread per process, so two datasets
can run side by side on two cores (or one dataset's test seeds, split by `--seeds`). Resumable: each finished phase is saved to
benchmarks/results/converged-<preset>-<dataset>.json and skipped on a rerun with the same settings.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch

from benchmarks.common import add_data_dir
from fedrec_flwr.config import load_config
from fedrec_flwr.convergence import FLATTEN_TOLERANCE, FLATTEN_WINDOW, rounds_to_flatten
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.inprocess import run_in_process
from fedrec_flwr.sweep import finished


def one_run(preset: str, dataset: str, seed: int, data_dir: str, overrides: list[str]) -> dict:
    """One in-process run; its curve, final metrics, budget and time."""
    cfg = load_config(preset, dataset, [f"data.data_dir={data_dir}", f"seed={seed}", *overrides])
    torch.set_num_threads(1)
    started = time.time()
    out = run_in_process(cfg, log_every=1)
    evals = [h for h in out["history"] if "rmse" in h]
    return {"seed": seed, "holdout": cfg.data.holdout, "rounds": cfg.federation.rounds,
            "sampler": cfg.privacy.pseudo_sampler, "overrides": overrides,
            "final": {"rmse": out["rmse"], "eval_ratings": out["eval_ratings"], "test_ratings": out["test_ratings"]},
            "rmse_by_round": {str(h["round"]): h["rmse"] for h in evals}, "budget": evals[-1]["privacy"],
            "median_round_seconds": out["median_round_seconds"], "wall_seconds": round(time.time() - started, 1),
            "date": date.today().isoformat()}


def main() -> None:
    """Run whichever phase is not in the results file yet."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--max-rounds", type=int, required=True, help="length of the validation run")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--validation-seed", type=int, default=0)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the test runs")
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="further config overrides of every run")
    args = ap.parse_args()
    out = Path(f"benchmarks/results/converged-{args.preset}-{args.dataset}.json")
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    doc.update(preset=args.preset, dataset=args.dataset, rule={"tolerance": FLATTEN_TOLERANCE, "window": FLATTEN_WINDOW},
               command=f"python -m benchmarks.converged_runs --data-dir DATA --dataset {args.dataset} --max-rounds "
                       f"{args.max_rounds}" + (f" --preset {args.preset}" if args.preset != "fedgnn_tuned" else "")
                       + (" --set " + " ".join(args.extra) if args.extra else ""))
    schedule = [f"federation.eval_every={args.eval_every}", *args.extra]

    def run_once(seed: int, overrides: list[str]) -> dict:
        key = {"seed": seed, "overrides": overrides}
        done = [r for r in doc["runs"] if finished({"runs": [r]}, key)]
        if done:
            return done[0]
        print(f"[converged_runs] {args.dataset} seed {seed}: {' '.join(overrides)}", flush=True)
        record = one_run(args.preset, args.dataset, seed, args.data_dir, overrides)
        if out.is_file():  # another process may have added a seed meanwhile (`--seeds` split over two cores)
            doc["runs"] = json.loads(out.read_text())["runs"]
        doc["runs"].append(record)
        atomic_write(out, json.dumps(doc, indent=1))
        return record

    val = run_once(args.validation_seed, ["data.holdout=validation", f"federation.rounds={args.max_rounds}", *schedule])
    chosen, flat = rounds_to_flatten({int(r): v for r, v in val["rmse_by_round"].items()})
    doc["chosen_rounds"], doc["flattened"] = chosen, flat
    atomic_write(out, json.dumps(doc, indent=1))
    print(f"[converged_runs] {args.dataset}: {chosen} rounds ({'flattened' if flat else 'NOT flattened'}; "
          f"validation RMSE {val['rmse_by_round'][str(chosen)]:.4f})", flush=True)
    for seed in args.seeds:
        r = run_once(seed, ["data.holdout=test", f"federation.rounds={chosen}", *schedule])
        print(f"[converged_runs] {args.dataset} seed {seed}: test RMSE {r['final']['rmse']:.4f} after {chosen} rounds",
              flush=True)


if __name__ == "__main__":
    main()
