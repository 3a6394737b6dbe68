"""The trivial and bias baselines a model's RMSE is shown beside."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.data import (
    RatingDataset,
    Ratings,
    RatingScale,
    UserPartitions,
    prepare_partitions,
)
from fedrec_flwr.reference.baselines import baseline_rmses, best_trivial, fit_biases


def _ds(train, test, users=3, items=3):
    def part(rows):
        u, i, v = (np.asarray(c) for c in zip(*rows))
        return Ratings(u.astype(np.int64), i.astype(np.int64), v.astype(np.float32))
    return RatingDataset("toy", users, items, RatingScale(1.0, 5.0, 1.0), part(train), part(test))


def test_each_baseline_predicts_what_it_names():
    # user 0 rates high, item 1 is rated low; user 2 and item 2 have no training ratings
    ds = _ds([(0, 0, 5), (0, 1, 3), (1, 0, 3), (1, 1, 1)], [(0, 0, 4), (2, 1, 2), (1, 2, 3)])
    out = baseline_rmses(ds)
    mu = 3.0
    assert out["global_mean"] == pytest.approx(np.sqrt(((4 - mu) ** 2 + (2 - mu) ** 2 + 0) / 3))
    # user means 4 and 2; user 2 falls back to the global mean
    assert out["user_mean"] == pytest.approx(np.sqrt(((4 - 4) ** 2 + (2 - mu) ** 2 + (3 - 2) ** 2) / 3))
    # item means 4 and 2; item 2 falls back to the global mean
    assert out["item_mean"] == pytest.approx(np.sqrt(((4 - 4) ** 2 + (2 - 2) ** 2 + (3 - mu) ** 2) / 3))
    assert best_trivial(out) == out["item_mean"]


def test_biases_fit_a_purely_additive_dataset():
    rng = np.random.default_rng(0)
    users, items = 200, 50
    b_u, b_i = rng.normal(0, 0.5, users), rng.normal(0, 0.5, items)
    pairs = [(u, i) for u in range(users) for i in rng.choice(items, 30, replace=False)]
    rows = [(u, i, 3 + b_u[u] + b_i[i]) for u, i in pairs]
    ds = _ds(rows[::2], rows[1::2], users, items)
    mu, fu, fi = fit_biases(ds, reg_user=0.0, reg_item=0.0, passes=30)
    pred = mu + fu[ds.test.users] + fi[ds.test.items]
    assert np.sqrt(np.mean((pred - ds.test.values) ** 2)) < 0.02
    out = baseline_rmses(ds)
    assert out["bias"] < 0.6 * min(out["user_mean"], out["item_mean"])  # regularised, still far ahead


def test_partitions_give_back_the_split_they_were_built_from(tiny_cfg):
    from fedrec_flwr.data import load_from_config

    cfg = tiny_cfg()
    ds = load_from_config(cfg.data)
    back = UserPartitions(prepare_partitions(cfg.data)).ratings()
    for a, b in ((ds.train, back.train), (ds.test, back.test)):
        order = np.lexsort((a.items, a.users))
        np.testing.assert_array_equal(a.users[order], b.users)
        np.testing.assert_array_equal(a.items[order], b.items)
        np.testing.assert_array_equal(a.values[order], b.values)
    assert baseline_rmses(ds) == pytest.approx(baseline_rmses(back))
