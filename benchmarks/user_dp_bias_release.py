"""The lever "a private item-bias estimate released first": what one user-level-DP release of the item biases gives.

    python -m benchmarks.user_dp_bias_release --data-dir DATA [--datasets ml-100k douban] [--epsilons 1 4 8]
    python -m benchmarks.user_dp_bias_release --data-dir DATA --targets 9 3.5 --epsilons 8 \
        --out benchmarks/results/user_dp_bias_release_sparse.json   # the sparse and cold variants

The mechanism, computed centrally as SecAgg+ would deliver its sum: every user sends one vector over the whole item
table, w_u * clip(r_ui - m - b_u, +-c) / span on its rated items and alpha * w_u on a second copy (its counts), with
w_u = n_u^-p, scaled down by the user's own count where needed so that no user's vector passes L2 norm
sqrt(c^2 + alpha^2) (the sensitivity: add or remove one user). The sum carries Gaussian noise of that norm times
sigma, sigma calibrated by dp-accounting (RDP) so that the one release spends epsilon at delta = 1e-5. m is the
scale's midpoint (public), b_u the user's own shrunk offset (on its device, free). The server shifts the global
mean by the noisy sums' ratio and sets b_i = S_i / (N_i + lambda); every device then refits its own offset against
them. The prediction is m + g + b_u + b_i: the bias model under user-level DP.

The grid over (c, alpha, lambda, p) is scored on the test ratings and the best cell is reported: an optimistic
bound on what the lever can give, spending the whole epsilon on it before any training. Mean of --seeds noise
draws. On the sparse and cold variants (`--targets`, `--cold`, as `benchmarks.sparse_variants` builds them) it is
the bias model under the guarantee `fedgnn_user_dp` gives, beside the centralized bias model that has none; the
best cell's RMSE is also reported per user group (cold: no training rating; light: 1-5; rest).
Writes benchmarks/results/user_dp_bias_release.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common import add_data_dir, markdown_table
from benchmarks.sparse_variants import group_rmses, load_variant
from fedrec_flwr.fedgnn.accounting import gaussian_releases_sigma
from fedrec_flwr.fsutil import atomic_write

OUT = Path("benchmarks/results/user_dp_bias_release.json")
GRID = {"c": (0.25, 0.5, 1.0), "alpha": (0.5, 1.0), "lam": (0.5, 2.0, 5.0, 20.0, 100.0), "p": (0.0, 0.5, 1.0)}
USER_REG = 5.0  # the offset's shrinkage, as the bias model's


def released_bias_predictions(ds, sigma: float, c: float, alpha: float, lam: float, p: float,
                               rng: np.random.Generator) -> np.ndarray:
    """Predictions on every test rating of the bias model whose item biases come from one noisy release (see the
    module docstring); a user without training ratings gets the global part and the item's bias alone."""
    tr, te = ds.train, ds.test
    low, high = ds.scale.low, ds.scale.high
    m, span = (low + high) / 2, high - low
    v = tr.values.astype(np.float64)
    n_u = np.bincount(tr.users, minlength=ds.num_users).astype(np.float64)
    # each user's own weight, so that its count vector has L2 norm at most 1 (alpha after scaling): w sqrt(n) <= 1,
    # from its own count alone (a normaliser over all users would let one user rescale everyone's)
    w = np.maximum(n_u, 1) ** -p / np.maximum(1.0, np.maximum(n_u, 1) ** (0.5 - p))
    b_u = np.bincount(tr.users, weights=v - m, minlength=ds.num_users) / (n_u + USER_REG)
    res = np.clip((v - m - b_u[tr.users]) / span, -c, c)
    noise = sigma * np.sqrt(c ** 2 + alpha ** 2)
    s = np.bincount(tr.items, weights=w[tr.users] * res, minlength=ds.num_items) + rng.normal(0, noise, ds.num_items)
    cnt = (alpha * np.bincount(tr.items, weights=w[tr.users], minlength=ds.num_items)
           + rng.normal(0, noise, ds.num_items)) / alpha
    shift = s.sum() / cnt.sum()
    reg = lam  # in units of the weight of one user's rating at w = 1 (public, not fitted on the data)
    b_i = span * (s - shift * cnt) / np.maximum(cnt + reg, reg)
    g = span * shift
    b_u = np.bincount(tr.users, weights=v - m - g - b_i[tr.items], minlength=ds.num_users) / (n_u + USER_REG)
    return m + g + b_i[te.items] + b_u[te.users]


def best_release(ds, sigma: float, seeds: int) -> dict:
    """The grid cell with the lowest test RMSE on all test ratings (mean of `seeds` noise draws), and that cell's RMSE
    on each user group of `benchmarks.sparse_variants.groups` (all, cold, light, rest): the bias model under
    user-level DP, as optimistic as a grid picked on the test ratings makes it."""
    best = None
    for c, alpha, lam, p in itertools.product(*GRID.values()):
        preds = [released_bias_predictions(ds, sigma, c, alpha, lam, p, np.random.default_rng(s)) for s in range(seeds)]
        by_group = group_rmses(ds, preds)
        if best is None or by_group["all"] < best[0]:
            best = (by_group["all"], {"c": c, "alpha": alpha, "lam": lam, "p": p}, by_group)
    return {"rmse": best[0], "best": best[1], "groups": best[2]}


def main() -> None:
    """Best grid cell per dataset variant and epsilon; prints the table and writes the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 8.0])
    ap.add_argument("--targets", nargs="+", type=float, default=[0.0],
                    help="data.train_per_user of the variants (0: the full split), as benchmarks.sparse_variants")
    ap.add_argument("--cold", type=float, default=0.1, help="data.cold_fraction of the sparse variants")
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="data overrides of every cell (the scale)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    doc = {"command": "python -m benchmarks.user_dp_bias_release", "date": date.today().isoformat(), "cells": []}
    rows = []
    for name in args.datasets:
        for target in args.targets:
            cold = args.cold if target else 0.0
            ds, label = load_variant(name, args.data_dir, target, args.cold, args.extra)
            for eps in args.epsilons:
                sigma = gaussian_releases_sigma(1, eps)
                found = best_release(ds, sigma, args.seeds)
                doc["cells"].append({"dataset": name, "set": list(args.extra), "train_per_user": target,
                                     "cold_fraction": cold, "epsilon": eps, "sigma": sigma, **found})
                groups_text = ", ".join(f"{g} {v:.4f}" for g, v in found["groups"].items() if g != "all")
                rows.append([label, eps, f"{sigma:.3f}", f"{found['rmse']:.4f}", groups_text,
                             json.dumps(found["best"])])
                print(rows[-1], flush=True)
    print(markdown_table(["variant", "epsilon", "sigma", "test RMSE (best cell)", "groups", "cell"], rows))
    atomic_write(args.out, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
