"""Validation holdout: a split carved from the training ratings, for choosing a schedule without the test set.

With `data.holdout=validation` a rating dataset's training ratings are split once more: each user keeps
most of its own and lends a `data.validation_fraction` share of them to a validation set, which then
takes the test set's place everywhere (partitions, registration counts, evaluation, baselines). The real
test ratings are not read by that run at all, so a number of rounds chosen on its curve has never seen
them. The final figures come from a second run on the full training ratings (`data.holdout=test`).

How it is carved, per user (so that every user is held out in proportion to its ratings, light ones too):
k_u = floor(f * n_u + U_u) of its n_u training ratings, U_u uniform on [0, 1) (randomised rounding, so
E[k_u] = f * n_u exactly), never all of them (a user keeps at least one training rating); which ones
is a uniform draw. Seeded by `data.seed` alone: every run seed of a dataset sees the same split.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .types import DataError, RatingDataset, Ratings


def validation_split(ds: RatingDataset, fraction: float, seed: int) -> RatingDataset:
    """`ds` with its test ratings replaced by a per-user `fraction` of its training ratings (and those
    removed from training); `meta["holdout"]` says so. DataError if no rating could be held out."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"data.validation_fraction = {fraction}; expected 0 < fraction < 1")
    rng = np.random.default_rng([seed, 0x7A1D])  # its own stream: the dataset's other seeded draws are untouched
    train = ds.train
    order = np.argsort(train.users, kind="stable")
    users = train.users[order]
    counts = np.bincount(users, minlength=ds.num_users)
    take = np.minimum(np.floor(fraction * counts + rng.random(ds.num_users)).astype(np.int64),
                      np.maximum(counts - 1, 0))
    # a uniform pick of take[u] of user u's ratings: the take[u] smallest of one random key per rating
    keys = rng.random(len(users))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(users), np.int64)
    by_key = np.lexsort((keys, users))  # users ascending, then keys ascending
    rank[by_key] = np.arange(len(users)) - np.repeat(starts, counts)
    held = np.zeros(len(train), bool)
    held[order[rank < np.repeat(take, counts)]] = True
    if not held.any():
        raise DataError(f"dataset '{ds.name}': data.validation_fraction = {fraction} holds out no training rating "
                        f"({len(train)} ratings over {ds.num_users} users); expected a larger fraction")

    def part(mask: np.ndarray) -> Ratings:
        return Ratings(train.users[mask], train.items[mask], train.values[mask])

    meta = {**ds.meta, "holdout": "validation", "validation_fraction": fraction}
    return replace(ds, train=part(~held), test=part(held), meta=meta)
