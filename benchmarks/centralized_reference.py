"""Centralized reference RMSE and run time over several seeds, per dataset.

    python -m benchmarks.centralized_reference --data-dir ../shared/data --datasets ml-100k douban --seeds 0 1 2
    python -m benchmarks.centralized_reference --data-dir ../shared/data --preset fedgnn_tuned --datasets ml-100k \
        --out benchmarks/results/centralized_fedgnn_tuned.json

The model is the preset's (default `fedgnn_paper`: FedGNN's GAT), trained by `fedrec run --centralized`.

Writes benchmarks/results/centralized.json and prints a Markdown table row per dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

from benchmarks.common import add_data_dir
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.reference.centralized import run_centralized


def main() -> None:
    """Run the centralized reference for each dataset and seed; record medians."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--preset", default="fedgnn_paper", help="whose model to train centrally (default: fedgnn_paper)")
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/centralized.json")
    args = ap.parse_args()
    rows = []
    for ds in args.datasets:
        runs = []
        for seed in args.seeds:
            cfg = load_config(args.preset, ds, [f"data.data_dir={args.data_dir}", f"seed={seed}",
                                             f"output_dir=outputs/centralized/{ds}-s{seed}",
                                             *parse_overrides(" ".join(args.set))])
            t0 = time.time()
            with contextlib.redirect_stdout(io.StringIO()):
                final = run_centralized(cfg)
            runs.append({"seed": seed, **final, "seconds": time.time() - t0})
            print(f"{ds} seed {seed}: rmse {final['rmse']:.4f} ({runs[-1]['seconds']:.1f}s)", flush=True)
        rmses = [r["rmse"] for r in runs]
        rows.append({
            "dataset": ds, "runs": runs, "rmse_median": statistics.median(rmses),
            "rmse_mean": statistics.mean(rmses), "rmse_std": statistics.stdev(rmses) if len(rmses) > 1 else 0.0,
            "seconds_median": statistics.median(r["seconds"] for r in runs),
            "global_mean_rmse": runs[0]["global_mean_rmse"], "epochs": cfg.centralized.epochs,
        })
    doc = {"preset": args.preset, "date": date.today().isoformat(),
           "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
           "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("| dataset | RMSE median (mean ± std) | global-mean RMSE | seconds (median) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['rmse_median']:.4f} ({r['rmse_mean']:.4f} ± {r['rmse_std']:.4f}) | "
              f"{r['global_mean_rmse']:.4f} | {r['seconds_median']:.1f} |")


if __name__ == "__main__":
    main()
