"""Trivial and bias baselines of a rating split: what a model must beat to have learned anything.

All are centralized (fitted on the whole training split) and need no federation:
- global mean: one number for every rating;
- user mean: each user's own mean rating (a device can compute it alone, at no privacy cost);
- item mean: each item's mean rating;
- bias: global mean + regularised user bias + regularised item bias, fitted by alternating
  regularised means (the classic baseline predictor of Koren's "Factor in the neighbors").
Users or items without training ratings fall back to the global mean (zero bias).
Predictions are clipped to the dataset's rating scale, as the models' are.
"""

from __future__ import annotations

import numpy as np

from fedrec_flwr.data import RatingDataset, Ratings
from fedrec_flwr.metrics import rmse

BIAS_PASSES = 10
# shrinkage of each bias towards zero, in pseudo-ratings: 5 and 5 are near the best of a grid
# (0-25) on both ML-100K (0.955) and Douban (0.734, the GC-MC figure the FedGNN paper quotes),
# so the bias model is as strong a baseline as it can be made, not a straw man
BIAS_REG_USER = 5.0
BIAS_REG_ITEM = 5.0


def _group_mean(keys: np.ndarray, values: np.ndarray, size: int, reg: float = 0.0) -> np.ndarray:
    """Per-key sum / (count + reg); zero for keys without values."""
    sums = np.bincount(keys, weights=values, minlength=size)
    counts = np.bincount(keys, minlength=size).astype(np.float64)
    return np.divide(sums, counts + reg, out=np.zeros(size), where=counts + reg > 0)


def fit_biases(ds: RatingDataset, passes: int = BIAS_PASSES, reg_user: float = BIAS_REG_USER,
               reg_item: float = BIAS_REG_ITEM) -> tuple[float, np.ndarray, np.ndarray]:
    """(global mean, user biases, item biases) by `passes` alternating regularised means."""
    tr = ds.train
    values = tr.values.astype(np.float64)
    mu = float(values.mean())
    b_user = np.zeros(ds.num_users)
    b_item = np.zeros(ds.num_items)
    for _ in range(passes):
        b_item = _group_mean(tr.items, values - mu - b_user[tr.users], ds.num_items, reg_item)
        b_user = _group_mean(tr.users, values - mu - b_item[tr.items], ds.num_users, reg_user)
    return mu, b_user, b_item


def _mean_or_global(keys: np.ndarray, values: np.ndarray, size: int, mu: float) -> np.ndarray:
    counts = np.bincount(keys, minlength=size)
    return np.where(counts > 0, _group_mean(keys, values, size), mu)


def baseline_rmses(ds: RatingDataset, users: np.ndarray | list[int] | None = None,
                   items: np.ndarray | None = None) -> dict[str, float]:
    """Test RMSE of the global-mean, user-mean, item-mean and bias predictors on `ds`'s split: on every test
    rating, or on those of `users` (the users a federated evaluation scored) and of `items`, so that a model and
    its baselines are always measured on the same ratings. Fitted on the whole training split either way."""
    tr, te = ds.train, _test_of(ds, users, items)
    low, high = ds.scale.low, ds.scale.high
    values = tr.values.astype(np.float64)
    mu = float(values.mean())
    user_mean = _mean_or_global(tr.users, values, ds.num_users, mu)
    item_mean = _mean_or_global(tr.items, values, ds.num_items, mu)
    g, b_user, b_item = fit_biases(ds)
    target = te.values.astype(np.float64)
    return {
        "global_mean": rmse(np.full(target.size, mu), target, low, high),
        "user_mean": rmse(user_mean[te.users], target, low, high),
        "item_mean": rmse(item_mean[te.items], target, low, high),
        "bias": rmse(g + b_user[te.users] + b_item[te.items], target, low, high),
    }


def _test_of(ds: RatingDataset, users: np.ndarray | list[int] | None, items: np.ndarray | None = None) -> Ratings:
    """The split's test ratings, or those of `users` (and of `items`)."""
    if users is None and items is None:
        return ds.test
    keep = np.ones(len(ds.test), bool)
    if users is not None:
        keep &= np.isin(ds.test.users, np.asarray(users, np.int64))
    if items is not None:
        keep &= np.isin(ds.test.items, np.asarray(items, np.int64))
    return Ratings(ds.test.users[keep], ds.test.items[keep], ds.test.values[keep])


def baselines_on_users(ds: RatingDataset, users: list[int]) -> tuple[dict[str, float], int]:
    """(`baseline_rmses` on the test ratings of `users`, how many ratings that is): what a FedGNN run records
    beside the RMSE its evaluating users reported."""
    return baseline_rmses(ds, users), len(_test_of(ds, users))


def best_trivial(baselines: dict[str, float]) -> float:
    """The lowest RMSE among the three trivial baselines (global, user and item mean)."""
    return min(baselines[k] for k in ("global_mean", "user_mean", "item_mean"))

