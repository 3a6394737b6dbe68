"""What each lever gives `fedgnn_user_dp` at a fixed user-level budget, and where its distance to the bias model goes.

    python -m benchmarks.user_dp_levers --data-dir DATA [--datasets ml-100k douban] [--epsilon 8] [--seed 0]
        [--levers NAME ...] [--resume]

One in-process run (`benchmarks.user_dp_curve.run_cell`: the round core and device code of `flwr run`, sigma
calibrated so that the run spends the target epsilon at delta = 1e-5, its one released evaluation charged) per
dataset and lever, each lever a set of config overrides of the preset. The references switch the privacy off in
steps (noise off; noise and clip off; each user's influence equalised without noise), so that the table shows which
part of the mechanism the distance to the bias model comes from. Resumable: finished cells are kept in
benchmarks/results/user_dp_levers.json (a fresh dated file when it exists, unless --resume). Prints one Markdown row
per cell beside the split's baselines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import add_data_dir, add_resume, markdown_table, results_file
from benchmarks.user_dp_curve import run_cell
from fedrec_flwr.fsutil import atomic_write

OUT = Path("benchmarks/results/user_dp_levers.json")
NO_NOISE = ["privacy.noise_multiplier=1e-6", "privacy.target_epsilon=0", "privacy.eval_noise_multiplier=1e-6"]
SLOW = ["server_opt.lr=0.003", "server_opt.item_lr=0.015", "server_opt.population_lr=0.015"]  # 0.3 of the preset's
SLOW_200 = [*SLOW, "federation.rounds=200", "federation.eval_every=200"]
# name -> (config overrides of fedgnn_user_dp, what the lever tries)
LEVERS: dict[str, tuple[list[str], str]] = {
    "preset": ([], "fedgnn_user_dp as shipped"),
    "no_sparse_switches": (["model.population_bias=false", "model.personal_shrink=0", "model.user_offset_reg=0",
                            "server_opt.population_lr=0"],
                           "without b_pop, the offset's shrinkage and the own part's weight (the earlier preset)"),
    "user_steps_5": (["local.user_steps=5"], "5 private steps a round instead of 2 (free personalisation)"),
    "clip_3": (["privacy.clip_norm=3"], "clip C = 3 (noise grows with it)"),
    "clip_10": (["privacy.clip_norm=10"], "clip C = 10: about the median user's update norm"),
    "pick_20": (["local.batch_size=20"], "each user's update from 20 of its ratings a round"),
    "no_noise": (NO_NOISE, "reference: the clip (C = 1) without noise"),
    "no_noise_clip_10": ([*NO_NOISE, "privacy.clip_norm=10"], "reference: the clip C = 10 without noise"),
    "no_noise_no_clip": ([*NO_NOISE, "privacy.clip_norm=1e6"], "reference: neither noise nor clip"),
    "no_noise_no_clip_pick_20": ([*NO_NOISE, "privacy.clip_norm=1e6", "local.batch_size=20"],
                                 "reference: neither, every user's update from 20 of its ratings a round"),
    "public_genres": (["data.item_features=true"], "public item features (ML-100K's 19 genres) mapped into the rows"),
    "clip_30": (["privacy.clip_norm=30"], "clip C = 30: above most users' update norms (what adaptive clipping "
                "at a high quantile would pick)"),
    "no_noise_clip_30": ([*NO_NOISE, "privacy.clip_norm=30"], "reference: the clip C = 30 without noise"),
    "no_noise_slow": ([*NO_NOISE, *SLOW],
                      "reference: the clip without noise, server rates at 0.3 of the preset's"),
    "slow": (SLOW,
             "server rates at 0.3 of the preset's, with the noise"),
    "slow_200_rounds": (SLOW_200,
                        "server rates at 0.3 of the preset's over 200 rounds (sigma calibrated to them)"),
    "slow_200_rounds_all_users": (["federation.clients_per_round=4096", *SLOW_200],
                                  "every user in every round with server rates at 0.3 of the preset's over 200 rounds"),
    "all_users": (["federation.clients_per_round=1000000"],
                  "every user in every round (q = 1): no sampling amplification, all N users in each release"),
}
# levers that need what only some datasets have
ONLY_ON = {"public_genres": {"ml-100k"}}


def main() -> None:
    """Run the missing (dataset, lever) cells and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--out", type=Path, default=OUT)
    add_resume(ap)
    args = ap.parse_args()
    path = results_file(args.out, args.resume)
    doc = json.loads(path.read_text()) if path.is_file() else {"preset": "fedgnn_user_dp", "runs": []}
    rows = []
    for dataset in args.datasets:
        for name in args.levers:
            if dataset not in ONLY_ON.get(name, {dataset}):
                continue
            extra, what = LEVERS[name]
            key = {"dataset": dataset, "lever": name, "target_epsilon": args.epsilon, "seed": args.seed,
                   "rounds": args.rounds}
            run = next((r for r in doc["runs"] if all(r.get(k) == v for k, v in key.items())), None)
            if run is None:
                print(f"[user_dp_levers] {dataset} {name} ...", flush=True)
                run = {**key, "what": what, "extra": extra,
                       **run_cell(dataset, args.epsilon, args.rounds, args.seed, args.data_dir, extra)}
                doc["runs"].append(run)
                atomic_write(path, json.dumps(doc, indent=1) + "\n")
            b = run["baselines"]
            spent = run["privacy"]["epsilon"]
            rows.append([dataset, name, what, f"{spent:.2f}" if spent < 1e3 else "none", f"{run['final']['rmse']:.4f}",
                         f"{b['item_mean']:.4f} / {b['bias']:.4f}"])
    print(markdown_table(["dataset", "lever", "what", "epsilon spent", "test RMSE", "item mean / bias model"], rows))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
