"""The lever "alternating least squares on noisy sufficient statistics" (DPALS, Chien et al. 2021): what it gives.

    python -m benchmarks.user_dp_als --data-dir DATA [--datasets ml-100k douban] [--epsilons 1 8]
    python -m benchmarks.user_dp_als --data-dir DATA --targets 9 3.5 --epsilons 8 --ranks 0 --seeds 3 \
        --out benchmarks/results/user_dp_als_sparse.json   # the sparse and cold variants, per user group

The mechanism, computed centrally as SecAgg+ would deliver its sums. The model is r = m + b_u + b_i + u.v_i, m the
scale's public midpoint. The user side (u, b_u) is solved on each device against the released item side, in closed
form with ridge `USER_REG`; it never leaves the device and costs no privacy. The item side (v_i, b_i) is released T
times. Each release is one Gaussian sum, over every user, of the per-item sufficient statistics of the item ridge
problem with the user's augmented factor a = [u, 1]:
- the Gram part, alpha * a a^T on each rated item (upper triangle), and
- the vector part, clip(r - m - b_u, +-c) * a on each rated item.

Every user scales its own vector (its whole contribution to all items) to L2 norm at most 1, from its own data
alone. The sensitivity of adding or removing one user is then 1. The sum carries Gaussian noise of std sigma, with
sigma calibrated by dp-accounting (RDP, T Gaussian releases composed) so that the whole run spends epsilon at
delta = 1e-5. The server solves (G_i / alpha + lambda I) x = h_i for each item; the Gram is symmetrised, and its
eigenvalues are floored at lambda where the noise made it indefinite. The factors u are clipped to norm 1 (Chien
et al.'s Gamma_u), so a user's Gram part stays bounded.

Rank 0 (biases only) is the item-bias release of `benchmarks.user_dp_bias_release`, iterated. The grid over (rank,
T, lambda, alpha, c) is scored on the test ratings and the best cell is reported: an optimistic bound on what the
lever can give, before any training. Mean of --seeds noise draws (one random public start each). Writes
benchmarks/results/user_dp_als.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from datetime import date
from pathlib import Path

import numpy as np
from scipy import sparse

from benchmarks.common import add_data_dir, markdown_table
from benchmarks.sparse_variants import group_rmses, load_variant
from fedrec_flwr.fedgnn.accounting import gaussian_releases_sigma
from fedrec_flwr.fsutil import atomic_write

OUT = Path("benchmarks/results/user_dp_als.json")
GRID = {"rank": (0, 2, 5), "releases": (1, 2, 3), "lam": (0.5, 2.0, 5.0, 20.0), "alpha": (0.3, 1.0), "c": (2.0,)}
USER_REG = 5.0  # the device's ridge on (u, b_u), as the bias model shrinks a user bias (k = 5 pseudo-ratings)
FACTOR_NORM = 1.0  # Gamma_u: every user's factor u is clipped to this norm before it enters a release
# ratings are fitted in units of a quarter of the scale's span (a star on 1-5), so that c = 2 clips a residual at half
# the span and the grid means the same on every scale (1-5 scales fit their own ratings as they are)
SCALE_UNITS = 4.0


def _indicator(index: np.ndarray, size: int) -> sparse.csr_matrix:
    """[size, ratings]: 1 where rating k belongs to row index[k]; a sum over each user's (item's) ratings is then one
    sparse product."""
    return sparse.csr_matrix((np.ones(index.size), (index, np.arange(index.size))), shape=(size, index.size))


def _solve_users(by_user, items, resid, v, b_i, reg):
    """Each device's closed-form ridge for (u, b_u) against the item side (v, b_i): r - b_i = u.v_i + b_u."""
    k = v.shape[1]
    x = np.concatenate([v[items], np.ones((items.size, 1))], 1)  # [ratings, k + 1]
    gram = (by_user @ (x[:, :, None] * x[:, None, :]).reshape(items.size, -1)).reshape(-1, k + 1, k + 1)
    rhs = by_user @ ((resid - b_i[items])[:, None] * x)
    sol = np.linalg.solve(gram + reg * np.eye(k + 1), rhs[..., None])[..., 0]
    u, b_u = sol[:, :k], sol[:, k]
    norm = np.linalg.norm(u, axis=1, keepdims=True)
    return u * np.minimum(1.0, FACTOR_NORM / np.maximum(norm, 1e-12)), b_u


def _release_items(users, by_user, by_item, resid, u, b_u, lam, alpha, c, sigma, rng):
    """One noisy release of the item ridge statistics (module docstring), solved by the server for (v, b_i)."""
    k = u.shape[1]
    a = np.concatenate([u[users], np.ones((users.size, 1))], 1)  # [ratings, k + 1]
    target = np.clip(resid - b_u[users], -c, c)
    iu = np.triu_indices(k + 1)
    gram_part = alpha * (a[:, :, None] * a[:, None, :])[:, iu[0], iu[1]]  # [ratings, (k+1)(k+2)/2]
    vec_part = target[:, None] * a
    # each user's whole contribution scaled to L2 norm <= 1 (its own data only): sensitivity 1
    norm = np.sqrt(by_user @ ((gram_part ** 2).sum(1) + (vec_part ** 2).sum(1)))
    scale = (1.0 / np.maximum(1.0, norm))[users]
    g_sum = by_item @ (scale[:, None] * gram_part)
    h_sum = by_item @ (scale[:, None] * vec_part)
    g_sum += rng.normal(0, sigma, g_sum.shape)
    h_sum += rng.normal(0, sigma, h_sum.shape)
    gram = np.zeros((g_sum.shape[0], k + 1, k + 1))
    gram[:, iu[0], iu[1]] = g_sum / alpha
    gram = gram + np.triu(gram, 1).transpose(0, 2, 1)
    w, q = np.linalg.eigh(gram)
    gram = q @ (np.maximum(w, 0.0)[..., None] * q.transpose(0, 2, 1))  # the noise's negative part dropped
    sol = np.linalg.solve(gram + lam * np.eye(k + 1), h_sum[..., None])[..., 0]
    return sol[:, :k], sol[:, k]


def als_predictions(ds, rank: int, releases: int, lam: float, alpha: float, c: float, sigma: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Predictions on every test rating of the DPALS model after `releases` noisy item releases (see the module
    docstring); a user without training ratings gets the item side alone (u = 0, b_u = 0)."""
    tr, te = ds.train, ds.test
    m = (ds.scale.low + ds.scale.high) / 2
    unit = (ds.scale.high - ds.scale.low) / SCALE_UNITS
    resid = (tr.values.astype(np.float64) - m) / unit
    by_user, by_item = _indicator(tr.users, ds.num_users), _indicator(tr.items, ds.num_items)
    v = rng.normal(0, 1 / np.sqrt(max(rank, 1)), (ds.num_items, rank))  # public random start
    b_i = np.zeros(ds.num_items)
    u, b_u = _solve_users(by_user, tr.items, resid, v, b_i, USER_REG)
    for _ in range(releases):
        v, b_i = _release_items(tr.users, by_user, by_item, resid, u, b_u, lam, alpha, c, sigma, rng)
        u, b_u = _solve_users(by_user, tr.items, resid, v, b_i, USER_REG)
    return m + unit * (b_u[te.users] + b_i[te.items] + (u[te.users] * v[te.items]).sum(1))


def best_cell(ds, rank: int, eps: float, seeds: int) -> dict:
    """The grid cell of `rank` with the lowest test RMSE on all test ratings (mean of `seeds` noise draws; eps = inf:
    without noise), and that cell's RMSE on each user group of `benchmarks.sparse_variants.groups`."""
    best = None
    for releases, lam, alpha, c in itertools.product(*list(GRID.values())[1:]):
        sigma = 0.0 if not np.isfinite(eps) else gaussian_releases_sigma(releases, eps)
        preds = [als_predictions(ds, rank, releases, lam, alpha, c, sigma, np.random.default_rng(s))
                 for s in range(seeds)]
        by_group = group_rmses(ds, preds)
        if best is None or by_group["all"] < best[0]:
            best = (by_group["all"], {"releases": releases, "lam": lam, "alpha": alpha, "c": c, "sigma": sigma},
                    by_group)
    return {"rmse": best[0], "best": best[1], "groups": best[2]}


def main() -> None:
    """Best grid cell per dataset variant, epsilon and rank; prints the table and writes the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 8.0])
    ap.add_argument("--ranks", nargs="+", type=int, default=list(GRID["rank"]))
    ap.add_argument("--targets", nargs="+", type=float, default=[0.0],
                    help="data.train_per_user of the variants (0: the full split), as benchmarks.sparse_variants")
    ap.add_argument("--cold", type=float, default=0.1, help="data.cold_fraction of the sparse variants")
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="data overrides of every cell (the scale)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--no-noise", action="store_true", help="reference: the same releases without noise")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    doc = {"command": "python -m benchmarks.user_dp_als --data-dir DATA" + (" --no-noise" if args.no_noise else ""),
           "date": date.today().isoformat(), "grid": GRID,
           "user_reg": USER_REG, "factor_norm": FACTOR_NORM, "cells": []}
    rows = []
    epsilons = [float("inf")] if args.no_noise else args.epsilons
    for name in args.datasets:
        for target in args.targets:
            cold = args.cold if target else 0.0
            ds, label = load_variant(name, args.data_dir, target, args.cold, args.extra)
            for eps in epsilons:
                for rank in args.ranks:
                    found = best_cell(ds, rank, eps, args.seeds)
                    doc["cells"].append({"dataset": name, "set": list(args.extra), "train_per_user": target,
                                         "cold_fraction": cold, "epsilon": eps if np.isfinite(eps) else None,
                                         "rank": rank, **found})
                    groups_text = ", ".join(f"{g} {v:.4f}" for g, v in found["groups"].items() if g != "all")
                    rows.append([label, "none" if not np.isfinite(eps) else eps, rank, f"{found['rmse']:.4f}",
                                 groups_text, json.dumps(found["best"])])
                    print(rows[-1], flush=True)
    print(markdown_table(["variant", "epsilon", "rank", "test RMSE (best cell)", "groups", "cell"], rows))
    atomic_write(args.out, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
