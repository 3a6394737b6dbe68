"""The user-level privacy curve: test RMSE against user-level epsilon (privacy.mode = user_dp), beside the baselines.

    python -m benchmarks.user_dp_curve --data-dir DATA [--datasets ml-100k douban] [--epsilons 1 2 4 8 16]
        [--rounds 100] [--seed 0] [--set KEY=VALUE ...]

One in-process run (`fedrec_flwr.cli.inprocess`: the round core and device code of `flwr run`, the SecAgg+ sum
taken directly) of the `fedgnn_user_dp` preset per dataset and target epsilon, with sigma calibrated so the
run's rounds spend exactly that epsilon at delta = 1e-5 (add or remove one user; Poisson-subsampled
Gaussian, RDP; the one evaluation it releases, at the end, is charged in the same budget). Each point keeps
the run's final RMSE (exact, every test rating: what only a simulation can compute) beside the released one
(the noisy, clipped sum the server learns), its budget and the split's baselines on the same test ratings
(global, user and item mean, the bias model). Resumable: finished cells are kept in
benchmarks/results/user_dp_curve.json and skipped on a rerun. `--plot` draws user_dp_curve.png from it,
with the LDP mode's RMSE at its own accounted per-user epsilon (benchmarks/results/privacy_utility.json).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from datetime import date
from pathlib import Path

import torch

from benchmarks.common import add_data_dir, add_resume, results_file
from benchmarks.privacy_utility import paper_budget_point
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.cli.sweep import finished
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reference.baselines import baseline_rmses

OUT = Path("benchmarks/results/user_dp_curve.json")
LDP = Path("benchmarks/results/privacy_utility.json")


def run_cell(dataset: str, eps: float, rounds: int, seed: int, data_dir: str, extra: list[str]) -> dict:
    """One in-process run: final RMSE, its curve, its user-level budget, and the split's baselines."""
    overrides = [f"data.data_dir={data_dir}", f"seed={seed}", f"privacy.target_epsilon={eps}",
                 f"federation.rounds={rounds}", f"federation.eval_every={rounds}", *extra]  # one released evaluation
    cfg = load_config("fedgnn_user_dp", dataset, overrides)
    torch.set_num_threads(1)
    started = time.time()
    out = run_in_process(cfg, log_every=0)
    evals = [h for h in out["history"] if "rmse" in h]
    last = out["history"][-1]
    return {"final": {"rmse": out["rmse"], "eval_ratings": out["eval_ratings"], "test_ratings": out["test_ratings"],
                      "released_rmse": last.get("released_rmse"), "rmse_is": last.get("rmse_is")},
            "rmse_by_round": {str(h["round"]): h["rmse"] for h in evals}, "privacy": evals[-1]["privacy"],
            "baselines": baseline_rmses(UserPartitions(prepare_partitions(cfg.data)).ratings()),
            "median_round_seconds": out["median_round_seconds"], "wall_seconds": round(time.time() - started, 1),
            "device_secrets": "fresh: every simulated device drew its own from the OS (a rerun draws anew)",
            "command": "python -m benchmarks.user_dp_curve --data-dir DATA --datasets " + dataset
                       + f" --epsilons {eps:g} --rounds {rounds} --seed {seed}"
                       + (" --set " + " ".join(extra) if extra else ""),
            "date": date.today().isoformat()}


def plot(doc: dict, path: Path) -> None:
    """RMSE against user-level epsilon per dataset, the baselines as lines, the LDP mode's point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ldp = json.loads(LDP.read_text()) if LDP.is_file() else {"runs": []}
    datasets = list(dict.fromkeys(r["dataset"] for r in doc["runs"]))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        mine = [r for r in doc["runs"] if r["dataset"] == dataset]
        usual = Counter(r["rounds"] for r in mine).most_common(1)[0][0]  # the curve's schedule; shorter runs aside
        shorter = sorted((r for r in mine if r["rounds"] < usual and not r["extra"] and r["seed"] == 0),
                         key=lambda r: r["target_epsilon"])
        mine = [r for r in mine if r["rounds"] == usual]
        if shorter:  # the same preset over fewer rounds (less noise a round): what small epsilons prefer
            ax.plot([r["privacy"]["epsilon"] for r in shorter], [r["final"]["rmse"] for r in shorter], "s--",
                    color="C3", label=f"over {shorter[0]['rounds']} rounds, seed 0")
        runs = sorted((r for r in mine if not r["extra"] and r["seed"] == 0), key=lambda r: r["target_epsilon"])
        ax.plot([r["privacy"]["epsilon"] for r in runs], [r["final"]["rmse"] for r in runs], "o-",
                label="user-level DP (fedgnn_user_dp), seed 0")
        seeds = [r for r in mine if not r["extra"] and r["seed"] != 0]
        ax.plot([r["privacy"]["epsilon"] for r in seeds], [r["final"]["rmse"] for r in seeds], "x", color="C0",
                label="other seeds")
        for r in mine:  # the references without noise (and without clipping): where the error comes from
            if r["extra"] and r["privacy"]["noise_multiplier"] < 1e-3:
                clipped = not any(e.startswith("privacy.clip_norm") for e in r["extra"])
                ax.axhline(r["final"]["rmse"], color="C1" if clipped else "C2",
                           label=f"no noise, {'clipped' if clipped else 'no clip'}: {r['final']['rmse']:.3f}")
        for (name, value), style in zip(runs[-1]["baselines"].items(), ("--", "-.", ":", (0, (1, 3)))):
            ax.axhline(value, color="grey", linestyle=style, label=f"{name} baseline {value:.3f}")
        for r in ldp.get("runs", []):
            p = paper_budget_point(r) if r["dataset"] == dataset and not r["extra"] else None
            if p is not None:
                ax.annotate(f"LDP (paper's budget): RMSE {p['rmse']:.3f} at user-level eps {p['epsilon_tight']:.1e}",
                            xy=(0.02, 0.02), xycoords="axes fraction", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("user-level epsilon at delta = 1e-5")
        ax.set_ylabel("test RMSE")
        ax.set_title(dataset)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Run the missing cells, then (or with --plot alone) draw the curve."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="further config overrides of every run")
    ap.add_argument("--plot", action="store_true", help="only draw the PNG from the recorded runs")
    ap.add_argument("--out", type=Path, default=OUT)
    add_resume(ap)
    args = ap.parse_args()
    args.out = results_file(args.out, args.resume)
    if not args.plot:  # resumable: a cell already in the file is skipped, the file is saved after each run
        doc = json.loads(args.out.read_text()) if args.out.is_file() else {"preset": "fedgnn_user_dp", "runs": []}
        for dataset in args.datasets:
            for eps in args.epsilons:
                fields = {"dataset": dataset, "target_epsilon": eps, "rounds": args.rounds, "seed": args.seed,
                          "extra": args.extra}
                if finished(doc, fields):
                    continue
                print(f"[user_dp_curve] {dataset} epsilon {eps:g} ...", flush=True)
                doc["runs"].append({**fields, **run_cell(dataset, eps, args.rounds, args.seed, args.data_dir,
                                                         args.extra)})
                r = doc["runs"][-1]
                print(f"[user_dp_curve] {dataset} epsilon {r['privacy']['epsilon']:.3f}: RMSE {r['final']['rmse']:.4f} "
                      f"(sigma {r['privacy']['noise_multiplier']:.3f}, {r['wall_seconds']:.0f}s)", flush=True)
                atomic_write(args.out, json.dumps(doc, indent=1))
    doc = json.loads(args.out.read_text())
    if any(not r["extra"] for r in doc["runs"]):  # a file of probes (every run with --set) has no curve to draw
        plot(doc, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
