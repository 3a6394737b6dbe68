"""Sparse and cold variants of a rating dataset (`data.train_per_user`, `data.cold_fraction`): the training ratings
thinned to a target per user, some users with none, the test ratings untouched and every one of them scored."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import DataError, load_from_config, prepare_partitions


def _data(tmp_path, *overrides):
    return load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={tmp_path / 'cache'}",
                                                     "data.synthetic.num_users=400", *overrides]).data


def test_a_sparse_variant_keeps_the_target_per_user_and_the_cold_users_keep_none(tmp_path):
    full = load_from_config(_data(tmp_path))
    sparse = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1"))
    again = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1"))
    for a, b in ((full.test, sparse.test), (sparse.train, again.train)):  # same test ratings; seeded
        assert np.array_equal(a.users, b.users) and np.array_equal(a.items, b.items)
        assert np.array_equal(a.values, b.values)
    assert len(sparse.train) / full.num_users == pytest.approx(3.5, abs=0.35)
    per_user = np.bincount(sparse.train.users, minlength=full.num_users)
    with_test = np.unique(full.test.users)
    cold = with_test[per_user[with_test] == 0]
    assert sparse.meta["cold_users"] == round(0.1 * with_test.size) and cold.size >= sparse.meta["cold_users"]
    # a kept rating is one of the full set's (a subset, not a redraw)
    full_keys = set(zip(full.train.users.tolist(), full.train.items.tolist()))
    assert set(zip(sparse.train.users.tolist(), sparse.train.items.tolist())) <= full_keys
    other = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1", "data.seed=1"))
    assert not np.array_equal(other.train.items[:50], sparse.train.items[:50])


def test_a_variant_has_its_own_cache_and_an_impossible_target_is_refused(tmp_path):
    assert prepare_partitions(_data(tmp_path)) != prepare_partitions(_data(tmp_path, "data.train_per_user=9"))
    with pytest.raises(DataError, match="asks for more than"):
        load_from_config(_data(tmp_path, "data.train_per_user=1000"))


def test_every_test_rating_of_a_sparse_variant_is_scored_cold_users_included(tiny_cfg):
    cfg = tiny_cfg("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2",
                   "federation.eval_every=2")
    out = run_in_process(cfg, log_every=0)
    assert out["eval_ratings"] == out["test_ratings"] > 0


def test_the_error_by_user_group_adds_up_to_the_run_s_and_names_the_cold_users(tiny_cfg):
    cfg = tiny_cfg("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2",
                   "federation.eval_every=2")
    out = run_in_process(cfg, log_every=0, by_group=True)
    groups = out["by_user_group"]
    assert groups["all"]["rmse"] == pytest.approx(out["rmse"], rel=1e-9)
    assert sum(groups[g]["test_ratings"] for g in ("cold", "light", "rest")) == groups["all"]["test_ratings"]
    assert groups["cold"]["users"] >= round(0.2 * 60 * 0.5) and groups["cold"]["test_ratings"] > 0
    squared = sum(groups[g]["rmse"] ** 2 * groups[g]["test_ratings"] for g in ("cold", "light", "rest")
                  if groups[g]["test_ratings"])
    assert squared / groups["all"]["test_ratings"] == pytest.approx(out["rmse"] ** 2, rel=1e-9)
