"""Sparse and cold variants of a rating dataset: fewer training ratings per user, and users with none.

Public federated-recommendation splits are often far sparser than ML-100K or Douban (Flixster's and Yahoo
Music's sRGCNN subsets hold about 9 and 3.5 ratings a user, with users whose every rating is a test rating).
`data.train_per_user` and `data.cold_fraction` make such variants of any rating dataset, so that the presets can
be checked where users have little to learn from, on data this project has:

- a `cold_fraction` of the users that have test ratings keep none of their training ratings (cold users: the model
  must still predict their test ratings, at least as well as the global mean does);
- every other training rating is kept with one probability p, chosen so that the users keep `train_per_user`
  training ratings on average (over all users, cold ones included). One Bernoulli draw per rating keeps the
  shape of the degree distribution: heavy users stay heavier, and light ones may end with none;
- the test ratings are untouched, so every variant of a dataset is scored on the same ratings.

Seeded by `data.seed` alone, on a stream of its own: every run seed of a variant sees the same ratings.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .types import DataError, RatingDataset, Ratings


def sparse_variant(ds: RatingDataset, train_per_user: float, cold_fraction: float, seed: int) -> RatingDataset:
    """`ds` with cold users and its other training ratings thinned to `train_per_user` a user on average (0: kept
    all); `meta` says so. DataError if the dataset has too few training ratings for the target."""
    if train_per_user < 0 or not 0.0 <= cold_fraction < 1.0:
        raise DataError(f"data.train_per_user = {train_per_user}, data.cold_fraction = {cold_fraction}; expected "
                        "train_per_user >= 0 and 0 <= cold_fraction < 1")
    rng = np.random.default_rng([seed, 0x5BA5E])  # its own stream: the dataset's other seeded draws are untouched
    train = ds.train
    with_test = np.unique(ds.test.users)
    cold = rng.choice(with_test, size=int(round(cold_fraction * with_test.size)), replace=False)
    warm = ~np.isin(train.users, cold)
    keep = warm.copy()
    if train_per_user > 0:
        p = train_per_user * ds.num_users / max(int(warm.sum()), 1)
        if p > 1.0:
            raise DataError(f"dataset '{ds.name}': data.train_per_user = {train_per_user:g} asks for more than the "
                            f"{warm.sum() / ds.num_users:.2f} training ratings a user its warm users hold")
        keep &= rng.random(len(train)) < p
    if not keep.any():
        raise DataError(f"dataset '{ds.name}': data.train_per_user = {train_per_user:g} keeps no training rating")
    meta = {**ds.meta, "train_per_user": train_per_user, "cold_fraction": cold_fraction,
            "cold_users": int(cold.size)}
    return replace(ds, train=Ratings(train.users[keep], train.items[keep], train.values[keep]), meta=meta)
