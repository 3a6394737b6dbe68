"""The user-level privacy curve: test RMSE against user-level epsilon (privacy.mode = user_dp), beside the baselines.

    python -m benchmarks.user_dp_curve --data-dir DATA [--datasets ml-100k douban] [--epsilons 1 2 4 8 16]
        [--rounds 100] [--seed 0] [--set KEY=VALUE ...]

One in-process run (`fedrec run --in-process`: the round core and device code of `flwr run`, the SecAgg+ sum
taken directly) of the `fedgnn_user_dp` preset per dataset and target epsilon, with sigma calibrated so the
run's rounds spend exactly that epsilon at delta = 1e-5 (add or remove one user; Poisson-subsampled
Gaussian, RDP). Each point keeps the run's final RMSE, its curve, its budget and the split's baselines on
the same test ratings (global, user and item mean, the bias model). Resumable: finished cells are kept in
benchmarks/results/user_dp_curve.json and skipped on a rerun. `--plot` draws user_dp_curve.png from it,
with the LDP mode's RMSE at its own accounted per-user epsilon (benchmarks/results/privacy_utility.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import add_data_dir
from fedrec_flwr.sweep import load_sweep, run_missing, run_record

OUT = Path("benchmarks/results/user_dp_curve.json")
LDP = Path("benchmarks/results/privacy_utility.json")


def cells(datasets: list[str], epsilons: list[float], rounds: int, seed: int, data_dir: str,
          extra: list[str]) -> list[tuple[dict, list[str]]]:
    """One (fields, fedrec run argv) cell per dataset and target epsilon."""
    out = []
    for dataset in datasets:
        for eps in epsilons:
            fields = {"dataset": dataset, "target_epsilon": eps, "rounds": rounds, "seed": seed, "extra": extra}
            argv = ["--in-process", "--preset", "fedgnn_user_dp", "--dataset", dataset, "--data-dir", data_dir,
                    "--seed", str(seed), "--set", f"privacy.target_epsilon={eps}", f"federation.rounds={rounds}",
                    f"federation.eval_every={max(rounds // 5, 1)}", *extra]
            out.append((fields, argv))
    return out


def with_baselines(res: dict) -> dict:
    """`run_record`, plus the split's baselines on the scored ratings."""
    return {**run_record(res), "baselines": res.get("baselines"), "baseline_ratings": res.get("baseline_ratings")}


def plot(doc: dict, path: Path) -> None:
    """RMSE against user-level epsilon per dataset, the baselines as lines, the LDP mode's point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ldp = json.loads(LDP.read_text()) if LDP.is_file() else {"runs": []}
    datasets = list(dict.fromkeys(r["dataset"] for r in doc["runs"]))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        runs = sorted((r for r in doc["runs"] if r["dataset"] == dataset), key=lambda r: r["target_epsilon"])
        eps = [r["privacy"]["epsilon"] for r in runs]
        ax.plot(eps, [r["final"]["rmse"] for r in runs], "o-", label="user-level DP (fedgnn_user_dp)")
        for (name, value), style in zip((runs[-1].get("baselines") or {}).items(), ("--", "-.", ":", (0, (1, 3)))):
            ax.axhline(value, color="grey", linestyle=style, label=f"{name} baseline {value:.3f}")
        for r in ldp.get("runs", []):
            if r["dataset"] == dataset and r["noise_lambda"] == 0.2 and not r["extra"]:
                p = next(p for p in r["points"] if round(p["epochs"]) == 3)
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
    args = ap.parse_args()
    if not args.plot:
        doc = load_sweep(args.out, args.datasets, {"preset": "fedgnn_user_dp", "delta": 1e-5})
        run_missing(doc, args.out, cells(args.datasets, args.epsilons, args.rounds, args.seed, args.data_dir, args.extra),
                    "user_dp_curve", with_baselines)
    plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
