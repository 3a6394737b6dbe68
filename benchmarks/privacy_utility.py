"""The privacy-utility curve: test RMSE against the privacy budget each user has spent.

    python -m benchmarks.privacy_utility --data-dir DATA [--datasets ml-100k douban] [--preset fedgnn_tuned]
        [--lambdas 0.1 0.2 0.4] [--epochs 6] [--uploads delta]

One in-process run (the round core and user code of `flwr run`, `fedrec_flwr.cli.inprocess`) per dataset and
Laplace scale lambda, for `--epochs` epochs (an epoch: users / clients_per_round rounds, so each user
uploads about once per epoch). Every evaluation records the RMSE beside the accounted budget up to that
round (`fedrec_flwr.fedgnn.accounting`): the median user's uploads and its total epsilon, basic and
tight (RDP at privacy.delta). Budget points come from longer runs (more uploads per user) and from
lambda (less noise per upload). The paper's budget is 3 epochs at epsilon 1 per coordinate per upload
(lambda = 0.2 at clip 0.1): the point of the lambda = 0.2 curve after 3 epochs. `--uploads delta` adds
runs with local training per upload (local.upload = delta). Writes
benchmarks/results/privacy_utility.json and benchmarks/results/privacy_utility.png.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.common import add_data_dir
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions

PAPER = {"ml-100k": 0.920, "douban": 0.790}  # FedGNN's RMSE with its privacy (Wu et al. 2022, Table 2)


def curve(preset: str, dataset: str, data_dir: str, noise_lambda: float, epochs: int, extra: list[str]) -> dict:
    """One run; its evaluations as (round, uploads, epsilon, RMSE) points."""
    base = [f"data.data_dir={data_dir}", f"privacy.noise_lambda={noise_lambda}", *extra]
    cfg = load_config(preset, dataset, base)
    users = UserPartitions(prepare_partitions(cfg.data)).meta.num_users
    per_epoch = math.ceil(users / cfg.federation.clients_per_round)
    rounds = epochs * per_epoch
    cfg = load_config(preset, dataset, [*base, f"federation.rounds={rounds}", f"federation.eval_every={per_epoch}"])
    t0 = time.time()
    out = run_in_process(cfg, log_every=0)
    points = []
    for h in out["history"]:
        if "rmse" not in h:
            continue
        run = h["privacy"]["per_user_run"]["median"]
        points.append({"round": h["round"], "epochs": h["round"] / per_epoch, "uploads_median": run["uploads"],
                       "epsilon_basic": run["basic"], "epsilon_tight": run["tight"], "rmse": h["rmse"],
                       "epsilon_per_coordinate": h["privacy"]["epsilon_per_coordinate_per_upload"]})
    return {"dataset": dataset, "preset": preset, "noise_lambda": noise_lambda, "extra": extra, "rounds": rounds,
            "rounds_per_epoch": per_epoch, "wall_seconds": time.time() - t0, "points": points}


def plot(runs: list[dict], path: Path) -> None:
    """RMSE against the median user's tight epsilon, one panel per dataset, the paper's budget marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for r in (r for r in runs if r["dataset"] == dataset):
            pts = r["points"]
            label = f"lambda = {r['noise_lambda']:g} (eps/coord {pts[0]['epsilon_per_coordinate']:g})"
            if r["extra"]:
                label += ", " + " ".join(e.split("=", 1)[1] for e in r["extra"] if e.startswith("local.upload"))
            ax.plot([p["epsilon_tight"] for p in pts], [p["rmse"] for p in pts], marker="o", label=label)
            paper_point = paper_budget_point(r)
            if paper_point is not None and not r["extra"]:
                ax.scatter([paper_point["epsilon_tight"]], [paper_point["rmse"]], s=160, facecolors="none",
                           edgecolors="red", zorder=5, label="paper's budget: 3 epochs at eps 1 per coordinate")
        if dataset in PAPER:
            ax.axhline(PAPER[dataset], color="grey", ls="--", lw=1, label=f"paper's RMSE {PAPER[dataset]}")
        ax.set_xscale("log")
        ax.set_xlabel("median user's total epsilon over the run (RDP, delta = 1e-5)")
        ax.set_ylabel("test RMSE")
        ax.set_title(dataset)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def paper_budget_point(run: dict) -> dict | None:
    """The point after 3 epochs of the lambda = 0.2 (eps 1 per coordinate) curve, or None for other curves."""
    if run["noise_lambda"] != 0.2:
        return None
    return next((p for p in run["points"] if abs(p["epochs"] - 3) < 1e-9), None)


def main() -> None:
    """Run the grid, write the JSON record and the plot, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--lambdas", nargs="+", type=float, default=[0.1, 0.2, 0.4])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--uploads", nargs="*", default=[], choices=["delta"],
                    help="also run these local.upload modes at lambda 0.2")
    ap.add_argument("--out", default="benchmarks/results/privacy_utility.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out_path = Path(args.out)
    runs = json.loads(out_path.read_text())["runs"] if out_path.is_file() else []
    done = {(r["dataset"], r["noise_lambda"], tuple(r["extra"])) for r in runs}
    jobs = [(d, lam, ()) for d in args.datasets for lam in args.lambdas]
    jobs += [(d, 0.2, (f"local.upload={mode}", "local.steps=3")) for d in args.datasets for mode in args.uploads]
    for dataset, lam, extra in jobs:
        if (dataset, lam, extra) in done:
            continue
        r = curve(args.preset, dataset, args.data_dir, lam, args.epochs, list(extra))
        runs.append(r)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "epochs": args.epochs, "runs": runs},
                                       indent=1))
        last = r["points"][-1]
        print(f"{dataset} lambda={lam:g} {' '.join(extra)}: rmse {last['rmse']:.4f} at eps {last['epsilon_tight']:.3g} "
              f"({r['wall_seconds']:.0f}s)", flush=True)
    plot(runs, out_path.with_suffix(".png"))
    print("| dataset | lambda | upload | epochs | uploads (median user) | epsilon per user (tight) | RMSE |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        for p in r["points"]:
            print(f"| {r['dataset']} | {r['noise_lambda']:g} | {' '.join(r['extra']) or 'gradient'} | {p['epochs']:g} "
                  f"| {p['uploads_median']} | {p['epsilon_tight']:.3g} | {p['rmse']:.4f} |")


if __name__ == "__main__":
    main()
